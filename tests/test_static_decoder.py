"""The static decoder (targets/static.py, evaluate/drafter_buffers.py, evaluate/graphed.py) against brute force on tiny dense targets
(Qwen3, Llama, Qwen2 with its attention biases) and a tiny hybrid (Qwen3.5: Gated DeltaNet and
gated attention), in fp32 on the CPU (eager; CUDA graphs replay the same round on a GPU):

- `StaticTarget.forward` over preallocated per-position key/value buffers (and per-row recurrent
  state) gives transformers' own logits and layer outputs: right-padded prompts of different
  lengths, then blocks written at positions that still hold stale entries (rejected drafts,
  garbage further ahead; on the hybrid, blocks whose tokens are dropped from the recurrent state);
- the target alone (no drafter) gives `greedy_decode`'s tokens, one prompt at a time and in
  batches (a final partial batch with filler rows; end-of-sequence tokens ending rows early, so
  unfinished rows are compacted into smaller buckets);
- speculative decoding with a drafter fitted to accept some blocks gives `speculative_decode`'s
  tokens, accepted drafts and committed tokens per round, greedy and sampled (keyed noise: the
  same tokens whatever the decoder or batch);
- on the hybrid, a decoder that keeps rejected drafts in the recurrent state (what cropping a
  transformers cache does) decodes other tokens than the target alone: the case is live;
- a sliding-window target is refused with the reason, by `unsupported_reason` and by `eval
  --decoder static` (exit 2, one line naming --decoder transformers); `--decoder auto` takes the
  static decoder for a hybrid target, lossless.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_offline.evaluate.graphed import StaticDecoder
from dflash_offline.evaluate.speculative import (DFlashProposer, TargetSession, greedy_decode,
                                                 load_target_for_decoding, speculative_decode)
from dflash_offline.targets.static import StaticTarget, unsupported_reason
from dflash_offline.sampling import Sampling

LAYERS = [1, 2]
B = 8
MAX_NEW = 27  # not a multiple of the block: the last rounds draft from shorter blocks


def make_dense_target(folder, kind: str, num_layers: int = 4, seed: int = 0):
    """A seeded random tiny causal LM of a family tiny.py does not make (llama, qwen2), saved as a
    Hugging Face folder; the LM head scaled as tiny.py does, so greedy choices are clear."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
    torch.manual_seed(seed)
    cfg = config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        if kind == "qwen2":  # visible biases (zero at init): the static path must add them
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def targets(tiny_dense, tiny_hybrid, tmp_path_factory):
    """{kind: folder}: the conftest's tiny Qwen3 and Qwen3.5 targets, Llama / Qwen2 targets made here."""
    root = tmp_path_factory.mktemp("static-targets")
    return {"qwen3": tiny_dense, "qwen3_5": tiny_hybrid, "llama": make_dense_target(root / "llama", "llama"),
            "qwen2": make_dense_target(root / "qwen2", "qwen2")}


def prompts_of(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 500, size=int(n)).tolist() for n in lengths]


def hf_forward(model, seq: list[int], layer_ids: list[int]):
    """transformers' own forward of one whole sequence: (logits [T, V], raw layer outputs [T, n*H])."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    # hidden_states[i + 1] is layer i's raw output for every layer but the last (after the norm).
    return out.logits[0].float(), torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], -1)


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2", "qwen3_5"])
def test_static_target_forward_equals_transformers(targets, kind):
    """Prompts of 3, 11 and 7 tokens right-padded into one forward, then blocks: each row's logits
    and layer outputs equal a fresh transformers forward of its whole sequence. Before each real
    block, a garbage block is written at and beyond the row's next positions; the real block
    overwrites part of it (the rest stays ahead, as rejected drafts do in decoding), and the next
    block starts after the tokens kept, over the stale entries of the rejected ones. The recurrent
    layers keep none of the garbage block and `keep` tokens of each real block (`settle`)."""
    model, _ = load_target_for_decoding(str(targets[kind]), "cpu", "float32")
    assert unsupported_reason(model) is None
    prompts = prompts_of(1, (3, 11, 7))
    R, P, cap = len(prompts), max(map(len, prompts)), 48
    target = StaticTarget(model, LAYERS, R, cap)
    assert bool(target.recurrent) == (kind == "qwen3_5")
    ids = torch.zeros((R, P), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p)
        ids[r, len(p):] = 77  # padding, attended by no real position
    with torch.inference_mode():
        hidden, feats = target.forward(ids, torch.arange(P)[None].expand(R, P), features=True,
                                       keep=torch.tensor([len(p) for p in prompts]), span=P)
        logits = target.logits(hidden)
    for r, p in enumerate(prompts):
        want_logits, want_feats = hf_forward(model, p, LAYERS)
        torch.testing.assert_close(logits[r, :len(p)], want_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feats[r, :len(p)], want_feats, atol=1e-5, rtol=1e-5)
    seqs = [list(p) for p in prompts]
    g = np.random.default_rng(2)
    for keep, T in ((2, 4), (4, 4), (1, 6), (6, 6)):  # tokens kept of each block, block length
        pos = torch.tensor([len(s) for s in seqs])[:, None]
        with torch.inference_mode():
            junk = torch.from_numpy(g.integers(2, 500, size=(R, T + 3)))
            target.forward(junk, pos + torch.arange(T + 3), features=True)  # stale entries ahead
            target.settle(torch.zeros(R, dtype=torch.long))
            block = torch.from_numpy(g.integers(2, 500, size=(R, T)))
            hidden, feats = target.forward(block, pos + torch.arange(T), features=True)
            target.settle(torch.full((R,), keep))
            logits = target.logits(hidden)
        for r in range(R):
            want_logits, want_feats = hf_forward(model, seqs[r] + block[r].tolist(), LAYERS)
            torch.testing.assert_close(logits[r], want_logits[-T:], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(feats[r], want_feats[-T:], atol=1e-5, rtol=1e-5)
            seqs[r] += block[r, :keep].tolist()


GREEDY_LENGTHS = (4, 19, 9, 30, 2)


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_5"])
def test_target_alone_equals_greedy_decode(targets, kind):
    """drafter=None: one token per round, the target's greedy decode, prompt for prompt; rows 1, 3
    (5 prompts: a batch of 3 and a partial one with a filler row) and 4; an end-of-sequence token
    ends two prompts early (rows finish at different rounds and are compacted)."""
    model, _ = load_target_for_decoding(str(targets[kind]), "cpu", "float32")
    session = TargetSession(model, [])
    prompts = prompts_of(3, GREEDY_LENGTHS)
    full = [greedy_decode(session, p, MAX_NEW, set()).tokens for p in prompts]
    eos = {full[1][5], full[3][11]}
    want = [greedy_decode(session, p, MAX_NEW, eos).tokens for p in prompts]
    assert len(want[1]) <= 6 and len(want[3]) <= 12 and sum(len(w) == MAX_NEW for w in want) >= 2
    longest = max(map(len, prompts))
    for stop, expect in ((set(), full), (eos, want)):
        for rows in (1, 3, 4):
            dec = StaticDecoder(model, None, rows, longest, MAX_NEW, stop)
            got = dec.decode_all(prompts)
            assert [d.tokens for d in got] == expect, (rows, stop)
            for d in got:
                assert d.accepted == [0] * (len(d.tokens) - 1) and d.committed == [1] * (len(d.tokens) - 1)
                assert d.target_forwards == len(d.tokens)
    # A decoder is reused batch after batch: a batch decoded again gives the same tokens.
    dec = StaticDecoder(model, None, 3, longest, MAX_NEW, eos)
    first = [d.tokens for d in dec.decode(prompts[:3])]
    dec.decode(prompts[3:])
    assert [d.tokens for d in dec.decode(prompts[:3])] == first == want[:3]


@pytest.fixture(scope="module")
def fitted(targets):
    """{kind: (model, drafter, prompts)}: a drafter fitted for a few steps to the target's own
    greedy completions of the prompts, so that rounds accept from nothing to every draft."""
    from conftest import fitted_drafter

    out = {}
    for kind in ("qwen3", "llama", "qwen3_5"):
        folder = targets[kind]
        model, _ = load_target_for_decoding(str(folder), "cpu", "float32")
        session = TargetSession(model, LAYERS)
        prompts = prompts_of(5, (6, 21, 13, 34, 3))
        completions = [greedy_decode(session, p, MAX_NEW + B, set()).tokens for p in prompts]
        out[kind] = (model, fitted_drafter(folder, session, prompts, completions, LAYERS, B), prompts)
    return out


def test_every_decoder_is_one_interface(fitted):
    """`Decoders.decoder` hands back each kind eval can run (the static decoder, transformers' KV
    batches, one prompt at a time, whole sequences re-run) behind one interface, `decode_all`, and each decodes the hybrid
    target alone and with the drafter to the same greedy tokens: what a new decoder must do to
    join them (docs/architecture.md, "A decoder")."""
    from dflash_offline.evaluate.batched import BatchDFlashProposer
    from dflash_offline.evaluate.decoders import Decoder, Decoders, KVBatched, OneAtATime, Rerun

    model, drafter, prompts = fitted["qwen3_5"]
    keys = list(range(len(prompts)))
    want = None
    for choice, batch, kind in (("static", 2, StaticDecoder), ("transformers", 2, KVBatched),
                                ("transformers", 1, OneAtATime)):
        decoders = Decoders(model, choice, batch, max(map(len, prompts)), MAX_NEW, set(), Sampling(), "cpu", "float32")
        for d in (None, drafter):
            dec: Decoder = decoders.decoder(d, len(prompts))
            assert isinstance(dec, kind), (choice, batch, type(dec))
            got = [r.tokens for r in dec.decode_all(prompts, keys, lambda runs: None)]
            want = want or got
            assert got == want, (choice, batch, d is None)
    # The fourth kind, whole sequences re-run each round, is what Decoders picks for batches of a
    # sliding-window target; built directly here, it answers the same call with the same tokens.
    rerun: Decoder = Rerun(model, BatchDFlashProposer(drafter, "cpu", "float32"), list(drafter.cfg.target_layer_ids),
                           MAX_NEW, set(), 2)
    assert [r.tokens for r in rerun.decode_all(prompts, keys, lambda runs: None)] == want


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_5"])
def test_speculative_equals_one_prompt_decoder(fitted, kind):
    """The static decoder with a fitted drafter = speculative_decode, prompt for prompt: the tokens
    (the target's greedy decode), each round's accepted drafts and committed tokens; rows 1, 2
    (5 prompts: a partial last batch) and 5; with and without end-of-sequence tokens."""
    model, drafter, prompts = fitted[kind]
    session = TargetSession(model, LAYERS)
    proposer = DFlashProposer(drafter, "cpu")
    longest = max(map(len, prompts))
    plain = [greedy_decode(session, p, MAX_NEW, set()).tokens for p in prompts]
    eos = {plain[0][9], plain[3][17]}
    seen = set()
    for stop in (set(), eos):
        want = [speculative_decode(session, proposer, p, MAX_NEW, stop) for p in prompts]
        assert [w.tokens for w in want] == [greedy_decode(session, p, MAX_NEW, stop).tokens for p in prompts]
        for rows in (1, 2, 5):
            got = StaticDecoder(model, drafter, rows, longest, MAX_NEW, stop).decode_all(prompts)
            for k, (g, w) in enumerate(zip(got, want)):
                assert g.tokens == w.tokens, (rows, stop, k)
                assert g.accepted == w.accepted and g.committed == w.committed, (rows, stop, k, g.accepted, w.accepted)
                assert sum(g.committed) == len(g.tokens) - 1 and g.target_forwards == len(g.accepted) + 1
        seen.update(a for w in want for a in w.accepted)
    assert min(seen) < B - 1 and B - 1 in seen, f"accepted lengths {seen}: the comparison needs rejected drafts and whole rounds"


def test_hybrid_rollback_keeps_no_rejected_draft(fitted):
    """The case a cropped cache gets wrong, live: a decoder whose recurrent layers keep the whole
    verified block (rejected drafts included, as transformers' `Cache.crop` leaves them) decodes
    other tokens than the target alone, while the static decoder's `settle` gives the target's own
    tokens. Rows 1 and 3."""
    import copy

    model, drafter, prompts = fitted["qwen3_5"]
    # A random tiny target barely remembers (fast decay, small recurrent outputs): a few stray
    # tokens in its state move no argmax. Slow decay and a louder recurrent branch make the state
    # matter, as it does in a trained model.
    model = copy.deepcopy(model)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.fill_(-6.0)
                layer.linear_attn.out_proj.weight.mul_(10.0)
    longest = max(map(len, prompts))
    want = [d.tokens for d in StaticDecoder(model, None, 1, longest, MAX_NEW, set()).decode_all(prompts)]
    session = TargetSession(model, [])
    assert want == [greedy_decode(session, p, MAX_NEW, set()).tokens for p in prompts]

    class Cropped(StaticDecoder):
        def _round(self, k):
            settle = self.target.settle
            # every active row keeps all B block tokens in its recurrent state
            self.target.settle = lambda keep: settle(torch.where(keep > 0, B, 0))
            try:
                super()._round(k)
            finally:
                self.target.settle = settle

    for rows in (1, 3):
        got = StaticDecoder(model, drafter, rows, longest, MAX_NEW, set()).decode_all(prompts)
        assert [g.tokens for g in got] == want, rows
        assert any(a < B - 1 for g in got for a in g.accepted)  # drafts were rejected
        cropped = [d.tokens for d in Cropped(model, drafter, rows, longest, MAX_NEW, set()).decode_all(prompts)]
        assert cropped != want, rows


def test_finer_row_buckets_decode_the_same(fitted):
    """Buckets at every multiple of N rows (row_buckets(rows, N)) change only how many rows a round
    runs over: tokens, accepted drafts and committed tokens equal the halving buckets', prompt for
    prompt; the trace shows the finer buckets were used."""
    from dflash_offline.evaluate.graphed import row_buckets

    assert row_buckets(200) == [200, 100, 50, 25, 13, 7, 4, 2, 1]
    assert row_buckets(20, 8) == [20, 16, 8, 4, 2, 1] and row_buckets(5, 1) == [5, 4, 3, 2, 1]
    with pytest.raises(ValueError):
        row_buckets(5, 0)
    model, drafter, prompts = fitted["qwen3"]
    longest = max(map(len, prompts))
    want = StaticDecoder(model, drafter, 5, longest, MAX_NEW, set()).decode_all(prompts)
    fine = StaticDecoder(model, drafter, 5, longest, MAX_NEW, set(), bucket_step=1)
    fine.trace = []
    got = fine.decode_all(prompts)
    assert [(g.tokens, g.accepted, g.committed) for g in got] == [(w.tokens, w.accepted, w.committed) for w in want]
    active = [a for _, a, _ in fine.trace]
    assert fine.buckets == [5, 4, 3, 2, 1]
    assert all(k == min(b for b in fine.buckets if b >= a) for (k, _, _), a in zip(fine.trace[1:], active))


def test_trace_records_each_read_back(fitted):
    """`trace` logs (bucket, unfinished rows) at each read-back: one per round plus the last, the
    bucket the smallest that holds the unfinished rows, rows that only finish; the prompt with the
    most rounds sets their number."""
    model, drafter, prompts = fitted["qwen3"]
    dec = StaticDecoder(model, drafter, 5, max(map(len, prompts)), MAX_NEW, set())
    dec.trace = []
    got = dec.decode(prompts)
    active = [a for _, a, _ in dec.trace]
    assert len(dec.trace) == max(len(g.committed) for g in got) + 1 and active[0] == 5 and active[-1] == 0
    assert all(a >= b for a, b in zip(active, active[1:]))
    times = [t for _, _, t in dec.trace]
    assert times == sorted(times)
    for (k, _, _), a in zip(dec.trace[1:], active):  # the bucket a round ran in, after the read-back before it
        assert k == min(b for b in dec.buckets if b >= a)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_sampled_decoding_equals_one_prompt_decoder(fitted, kind):
    """Sampling (temperature, top-p, top-k; noise keyed by seed, prompt key and output index): the
    static decoder draws what the one-prompt decoders draw, for the target alone and speculative,
    whatever the batch."""
    model, drafter, prompts = fitted[kind]
    session = TargetSession(model, LAYERS)
    proposer = DFlashProposer(drafter, "cpu")
    longest = max(map(len, prompts))
    sampling = Sampling(temperature=0.9, top_p=0.95, seed=11, top_k=50)
    keys = [40 + k for k in range(len(prompts))]
    alone = [greedy_decode(session, p, MAX_NEW, set(), sampling, key) for p, key in zip(prompts, keys)]
    spec = [speculative_decode(session, proposer, p, MAX_NEW, set(), sampling, key) for p, key in zip(prompts, keys)]
    greedy = [greedy_decode(session, p, MAX_NEW, set()).tokens for p in prompts]
    assert [r.tokens for r in alone] != greedy  # sampled, not greedy
    for rows in (1, 3):
        got = StaticDecoder(model, None, rows, longest, MAX_NEW, set(), sampling).decode_all(prompts, keys)
        assert [g.tokens for g in got] == [r.tokens for r in alone], rows
        got = StaticDecoder(model, drafter, rows, longest, MAX_NEW, set(), sampling).decode_all(prompts, keys)
        assert [g.tokens for g in got] == [r.tokens for r in spec], rows
        assert [g.accepted for g in got] == [r.accepted for r in spec], rows
        assert [g.committed for g in got] == [r.committed for r in spec], rows


def test_sliding_window_targets_are_refused_and_hybrids_run(targets, tiny_hybrid, tmp_path):
    """unsupported_reason names why (a sliding window, a layer type it lacks, another family); eval
    --decoder static on a sliding-window target exits 2 with one line naming --decoder
    transformers; on a hybrid target --decoder auto takes the static decoder, lossless."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from types import SimpleNamespace

    from conftest import run_cli
    from dflash_offline.drafter.config import DrafterConfig
    from dflash_offline.drafter.export import export_drafter
    from dflash_offline.drafter.model import DFlashDrafter

    hybrid, _ = load_target_for_decoding(str(tiny_hybrid), "cpu", "float32")
    assert unsupported_reason(hybrid) is None
    layered = SimpleNamespace(config=SimpleNamespace(model_type="qwen3", layer_types=["mamba", "full_attention"]))
    assert "its layers include mamba" in unsupported_reason(layered)
    other = SimpleNamespace(config=SimpleNamespace(model_type="gemma2"))
    assert "'gemma2' is not one of" in unsupported_reason(other)
    window = tmp_path / "qwen2-window"
    model, _ = load_target_for_decoding(str(targets["qwen2"]), "cpu", "float32")
    model.config.use_sliding_window, model.config.sliding_window, model.config.max_window_layers = True, 4, 0
    assert "sliding-window" in unsupported_reason(model)
    with pytest.raises(ValueError, match="the static decoder cannot run this target"):
        StaticTarget(model, LAYERS, 1, 16)
    model.save_pretrained(window)

    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7, 8], [9, 10, 11]]}), prompts)
    for folder, decoder in ((window, "static"), (tiny_hybrid, "auto")):
        torch.manual_seed(0)
        d = DFlashDrafter(DrafterConfig.from_target(str(folder), [1, 3], block_size=4, drafter_layers=1, mask_token_id=1))
        d.load_frozen_from_target(str(folder))
        export = export_drafter(d.eval(), str(tmp_path / f"export-{decoder}"))
        report = tmp_path / f"{decoder}.json"
        r = run_cli(["eval", "--target", folder, "--drafter", export, "--prompts", prompts, "--max-new-tokens", "6",
                     "--no-progress", "--decoder", decoder, "--batch-size", "2", "--json", report])
        if decoder == "static":
            assert r.returncode == 2, (r.returncode, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1 and "--decoder transformers" in r.stderr, r.stderr
            assert "sliding-window" in r.stderr and not report.exists()
            continue
        assert r.returncode == 0, r.stderr
        rep = json.loads(report.read_text())
        assert rep["decoder"] == "static", rep
        e = rep["drafters"][0]
        assert e["lossless"] is True and e["tokens"] == 2 * 6 and [sum(c) for c in e["committed_per_prompt"]] == [5, 5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_cuda_graphs_equal_eager(fitted, kind):
    """On a GPU the rounds (and the prefill) replay as CUDA graphs: the same tokens, accepted drafts
    and committed tokens as the eager rounds on the same device and the one-prompt decoder (on the
    hybrid: flash-linear-attention's kernels when installed)."""
    import copy

    model, drafter, prompts = fitted[kind]
    model, drafter = copy.deepcopy(model).to("cuda"), copy.deepcopy(drafter).to("cuda")  # the fixture's stay on the CPU
    session = TargetSession(model, LAYERS)
    proposer = DFlashProposer(drafter, "cuda")
    longest = max(map(len, prompts))
    plain = [greedy_decode(session, p, MAX_NEW, set()).tokens for p in prompts]
    eos = {plain[3][17]}
    want = [speculative_decode(session, proposer, p, MAX_NEW, eos) for p in prompts]
    for rows in (1, 3):
        graphed = StaticDecoder(model, drafter, rows, longest, MAX_NEW, eos, graphs=True).decode_all(prompts)
        eager = StaticDecoder(model, drafter, rows, longest, MAX_NEW, eos, graphs=False).decode_all(prompts)
        for g, e, w in zip(graphed, eager, want):
            assert g.tokens == e.tokens == w.tokens
            assert g.accepted == e.accepted == w.accepted and g.committed == e.committed == w.committed
        alone = StaticDecoder(model, None, rows, longest, MAX_NEW, eos, graphs=True).decode_all(prompts)
        assert [a.tokens for a in alone] == [w.tokens for w in want]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 96])  # one-token rounds, a verify block, a prefill (chunked kernel)
def test_fla_recurrence_equals_the_loop(T):
    """flash-linear-attention's kernels (fused recurrent; chunked from 64 tokens) give the PyTorch
    loop's outputs and final state, from a non-zero state, with grouped value heads and decay and
    beta zeroed past each row's kept tokens (the replay of `settle`)."""
    pytest.importorskip("fla")
    from dflash_offline.targets.recurrent import kernels_for, recurrence, recurrence_loop

    kernels = kernels_for(torch.device("cuda"))
    assert kernels is not None
    g = torch.Generator().manual_seed(0)
    R, Hk, Hv, dk, dv = 3, 2, 4, 32, 16
    q, k = (torch.randn(R, T, Hk, dk, generator=g) for _ in range(2))
    v = torch.randn(R, T, Hv, dv, generator=g)
    decay = -torch.rand(R, T, Hv, generator=g)
    beta = torch.rand(R, T, Hv, generator=g)
    keep = torch.tensor([T, T // 2, 0])
    kept = (torch.arange(T)[None] < keep[:, None])[..., None]
    decay, beta = decay * kept, beta * kept
    state = torch.randn(R, Hv, dk, dv, generator=g) * 0.1
    want_out, want_state = recurrence_loop(q, k, v, decay, beta, state)
    cuda = [x.cuda() for x in (q, k, v, decay, beta, state)]
    out, final = recurrence(*cuda, kernels)
    torch.testing.assert_close(final.cpu(), want_state, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.cpu()[:, : max(1, T // 2)], want_out[:, : max(1, T // 2)], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(final.cpu()[2], state[2], atol=1e-6, rtol=0)  # nothing kept: unchanged
    # The in-place launch (one-token steps, verify replays): the same state, written over the old one.
    from dflash_offline.targets.recurrent import advance_state

    moved = cuda[5].clone()
    out = advance_state(*cuda[:5], moved, kernels)
    torch.testing.assert_close(moved.cpu(), want_state, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.cpu()[:, : max(1, T // 2)], want_out[:, : max(1, T // 2)], atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tile", ["8x1", "16x2", "32x4", "64x4", "64x8", "128x4", "128x8"])
def test_in_place_tiles_equal_the_loop(tile, monkeypatch):
    """Every state tile the in-place kernel may run with (the 27B shape's head sizes, 128 x 128)
    moves the state as the PyTorch loop does, one-token rounds and a verify replay alike."""
    pytest.importorskip("fla")
    from dflash_offline.targets import recurrent

    monkeypatch.setattr(recurrent, "IN_PLACE_TILE", recurrent.StateTile.parse(tile))
    kernels = recurrent.kernels_for(torch.device("cuda"))
    g = torch.Generator().manual_seed(1)
    for T in (1, 8):
        R, Hk, Hv, dk, dv = 3, 2, 4, 128, 128
        q, k = (torch.randn(R, T, Hk, dk, generator=g) for _ in range(2))
        v = torch.randn(R, T, Hv, dv, generator=g)
        keep = torch.tensor([T, T // 2, 0])
        kept = (torch.arange(T)[None] < keep[:, None])[..., None]
        decay, beta = -torch.rand(R, T, Hv, generator=g) * kept, torch.rand(R, T, Hv, generator=g) * kept
        state = torch.randn(R, Hv, dk, dv, generator=g) * 0.1
        want_out, want_state = recurrent.recurrence_loop(q, k, v, decay, beta, state)
        moved = state.cuda()
        out = recurrent.advance_state(*(x.cuda() for x in (q, k, v, decay, beta)), moved, kernels)
        torch.testing.assert_close(moved.cpu(), want_state, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(out.cpu()[:, : max(1, T // 2)], want_out[:, : max(1, T // 2)], atol=2e-3, rtol=2e-3)
        assert torch.equal(moved.cpu()[2], state[2])  # nothing kept: not a bit moves
