"""`eval --batch-size N`: both batched speculative decoders (the KV-cache one, with per-row
recurrent-state rollback on hybrid targets, and the one that re-runs whole sequences each round,
rows right-padded) give what the one-prompt KV-cache decoder gives, prompt for prompt: the same tokens (the target's
greedy decode), the same rounds, accepted lengths and committed tokens (the reference's tau), on
dense and hybrid tiny targets, with the trained-drafter proposer and with oracle drafts (every
draft accepted) that are corrupted so that rounds accept every length."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_offline.evaluate.batched import BatchDFlashProposer, batched_speculative_decode
from dflash_offline.evaluate.kv_batch import KVBatchDFlashProposer, NoDrafts, kv_batched_decode
from dflash_offline.evaluate.speculative import (DFlashProposer, TargetSession, greedy_decode,
                                                 load_target_for_decoding, speculative_decode, summarize)
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.model import DFlashDrafter

LAYERS = [1, 3, 7]  # 7 = the last layer of the tiny targets: its features are read the same way
MAX_NEW = 29


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def target(request, tiny_dense, tiny_hybrid):
    folder = tiny_dense if request.param == "qwen3" else tiny_hybrid
    model, _ = load_target_for_decoding(str(folder), "cpu", "float32")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in (2, 9, 31, 17, 5)]
    session = TargetSession(model, LAYERS)
    reference = [greedy_decode(session, p, MAX_NEW, set()).tokens for p in prompts]
    return folder, model, prompts, reference


def drafts_for(full: list[int], n: int, width: int, corrupt: bool) -> list[int]:
    """The true continuation after n committed tokens, one slot made wrong for most n (a pure
    function of n, so both decoders receive the same drafts)."""
    draft = (full + [3] * (width + 1))[n:n + width]
    r = np.random.default_rng(n)
    if corrupt and r.random() < 0.8:
        j = int(r.integers(0, width))
        draft[j] = (draft[j] + 1) % 500 + 2
    return draft


class Oracle:  # the one-prompt decoder's proposer
    def __init__(self, full, block_size, corrupt):
        self.full, self.block_size, self.corrupt = full, block_size, corrupt

    def start(self, prompt, features):
        pass

    def observe(self, features):
        pass

    def propose(self, tokens):
        assert tokens == self.full[:len(tokens)]
        return drafts_for(self.full, len(tokens), self.block_size - 1, self.corrupt)


class BatchOracle:
    """fulls: {prompt index: (prompt length, prompt + greedy continuation)}. Proposes block_size - 1
    tokens whatever each row's block length (the decoders use only those that fit), and checks the
    block length the decoder gives: an output's last rounds get only the tokens they can still
    commit, min(B, max_new - tokens out + 1) with the anchor (the reference's verify_size)."""

    def __init__(self, fulls: dict, block_size, corrupt, max_new=MAX_NEW):
        self.fulls, self.block_size, self.corrupt, self.max_new = fulls, block_size, corrupt, max_new

    def propose(self, feats, ctx_len, anchors, seqs, block_len):
        assert ctx_len.tolist() == [len(s) - 1 for s in seqs] and anchors.tolist() == [s[-1] for s in seqs]
        out, want_len = [], []
        for s in seqs:
            n, full = next(f for f in self.fulls.values() if f[1][:len(s)] == s)
            out.append(drafts_for(full, len(s), self.block_size - 1, self.corrupt))
            want_len.append(min(self.block_size, self.max_new - (len(s) - n) + 1))
        assert block_len.tolist() == want_len
        return torch.tensor(out)


class KVBatchOracle(BatchOracle):
    """The oracle for the KV-cache batched decoder (anchors and positions instead of contexts)."""

    def start(self, feats, positions, valid):
        pass

    def observe(self, feats, positions, valid):
        pass

    def select(self, rows, slots):
        pass

    def propose(self, anchors, positions, seqs, block_len):
        assert positions.tolist() == [len(s) - 1 for s in seqs] and anchors.tolist() == [s[-1] for s in seqs]
        return BatchOracle.propose(self, None, positions, anchors, seqs, block_len)


@pytest.mark.parametrize("decoder", ["rerun", "kv"])
@pytest.mark.parametrize("corrupt", [False, True])
def test_batched_equals_one_prompt_decoding_with_oracle_drafts(target, corrupt, decoder):
    folder, model, prompts, reference = target
    B = 8
    fulls = {i: (len(p), list(p) + list(ref)) for i, (p, ref) in enumerate(zip(prompts, reference))}
    session = TargetSession(model, LAYERS)
    one = [speculative_decode(session, Oracle(fulls[i][1], B, corrupt), p, MAX_NEW, set())
           for i, p in enumerate(prompts)]
    if decoder == "kv":
        batched = kv_batched_decode(model, KVBatchOracle(fulls, B, corrupt), LAYERS, prompts, MAX_NEW, set(),
                                    batch_size=3)
    else:
        batched = batched_speculative_decode(model, BatchOracle(fulls, B, corrupt), LAYERS, prompts, MAX_NEW, set(),
                                             batch_size=3)
    assert [r.tokens for r in batched] == reference == [r.tokens for r in one]
    assert [r.accepted for r in batched] == [r.accepted for r in one]
    assert [r.committed for r in batched] == [r.committed for r in one]
    s = summarize(batched, B)
    # The reference's tau: every output token after the first is committed by one round.
    assert s.committed == len(prompts) * (MAX_NEW - 1) and s.tau == s.committed / s.rounds
    if corrupt:
        assert set(range(B)) <= {a for r in batched for a in r.accepted}  # every accepted length occurs
    else:
        assert [a for r in batched for a in r.accepted[:-1]] == [B - 1] * sum(len(r.accepted) - 1 for r in batched)
        # Whole blocks of B, then a last round that drafts (and commits) only the 28 % 8 = 4 left.
        whole, rest = divmod(MAX_NEW - 1, B)
        assert rest and all(r.committed == [B] * whole + [rest] and r.accepted[-1] == rest for r in batched)
        assert s.tau == (MAX_NEW - 1) / (whole + 1)


@pytest.mark.parametrize("decoder", ["rerun", "kv"])
def test_batched_equals_one_prompt_decoding_with_a_drafter(target, decoder):
    folder, model, prompts, reference = target
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(str(folder), LAYERS, block_size=4, drafter_layers=2, mask_token_id=1)
    d = DFlashDrafter(cfg)
    d.load_frozen_from_target(str(folder))
    d.eval()
    session = TargetSession(model, LAYERS)
    eos = {reference[2][6]}  # a token the target emits: that prompt ends early, the others go on
    want = [greedy_decode(session, p, MAX_NEW, eos).tokens for p in prompts]
    assert len(want[2]) <= 7 and want[2][-1] in eos
    one = [speculative_decode(session, DFlashProposer(d, "cpu"), p, MAX_NEW, eos) for p in prompts]
    if decoder == "kv":
        batched = kv_batched_decode(model, KVBatchDFlashProposer(d, "cpu"), LAYERS, prompts, MAX_NEW, eos,
                                    batch_size=4)
        alone = kv_batched_decode(model, NoDrafts(), LAYERS, prompts, MAX_NEW, eos, batch_size=4)
        assert [r.tokens for r in alone] == want  # block size 1: the target alone, batched
        assert all(r.accepted == [0] * (len(r.tokens) - 1) for r in alone)
        assert all(r.committed == [1] * (len(r.tokens) - 1) for r in alone)
    else:
        batched = batched_speculative_decode(model, BatchDFlashProposer(d, "cpu"), LAYERS, prompts, MAX_NEW, eos,
                                             batch_size=4)
    assert [r.tokens for r in batched] == want == [r.tokens for r in one]
    assert [r.accepted for r in batched] == [r.accepted for r in one]
    assert [r.committed for r in batched] == [r.committed for r in one]
    assert [sum(r.committed) for r in batched] == [len(w) - 1 for w in want]  # eos: nothing after it counts
    assert 1.0 <= summarize(batched, 4).tau < 1.2  # an untrained drafter: tau near 1


def test_kv_decoder_refuses_sliding_window_targets():
    from types import SimpleNamespace

    from dflash_offline.evaluate.kv_batch import unsupported_reason

    model = SimpleNamespace(config=SimpleNamespace(layer_types=["sliding_attention", "full_attention"]))
    assert "sliding_attention" in unsupported_reason(model)
    for types in (["full_attention"], ["linear_attention", "full_attention"], None):
        assert unsupported_reason(SimpleNamespace(config=SimpleNamespace(layer_types=types))) is None


def test_eval_features_are_the_raw_layer_outputs_extraction_stores(tiny_dense, tmp_path):
    """For a layer set with the last layer (7 of 8), both decoders give the drafter what `extract`
    stored for training: the layers' raw outputs. transformers' hidden_states[8] is the output
    after the final norm (what eval used to read): far from the stored features."""
    from conftest import extract_args, run_cli
    from dflash_offline.evaluate.batched import _target_forward
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.tiny import make_tiny_data

    data = make_tiny_data(tmp_path / "d.parquet", rows=3, min_len=20, max_len=40, seed=5)
    cache = tmp_path / "cache"
    r = run_cli(extract_args(tiny_dense, data, cache, "--capture-layers", "1,7", "--topk", "0"))
    assert r.returncode == 0, r.stderr
    model, _ = load_target_for_decoding(str(tiny_dense), "cpu", "float32")
    session = TargetSession(model, [1, 7])
    for s in CacheReader(str(cache)).samples():
        stored = torch.from_numpy(np.asarray(s.hidden, np.float32)).reshape(len(s.input_ids), -1)
        one = session.start(s.input_ids.tolist())[1]
        ids = torch.tensor([s.input_ids.tolist()])
        batched, _ = _target_forward(model, ids, [1, 7], torch.tensor([0]), 1)
        for got in (one, batched[0]):
            torch.testing.assert_close(got, stored, rtol=2e-2, atol=2e-2)  # stored in bf16
        with torch.no_grad():
            normed = model(input_ids=ids, output_hidden_states=True).hidden_states[8][0]
        assert (normed - stored[:, 64:]).abs().max() > 0.5  # the post-norm tensor is another feature


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_kv_batched_decoding_on_cuda_equals_one_prompt(kind, tiny_dense, tiny_hybrid):
    """On a GPU (fp32, grouped SDPA kernels, per-row positions and slot masks; a hybrid target's
    kernels and its per-row rollback) the KV-cache batched decoder gives the one-prompt decoder's
    tokens and rounds, and block size 1 the target alone."""
    folder = tiny_dense if kind == "qwen3" else tiny_hybrid
    model, _ = load_target_for_decoding(str(folder), "cuda", "float32")
    rng = np.random.default_rng(12)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in (3, 40, 11, 27, 8, 19)]
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.from_target(str(folder), LAYERS, block_size=4, drafter_layers=2, mask_token_id=1))
    d.load_frozen_from_target(str(folder))
    d.eval()
    session = TargetSession(model, LAYERS)
    want = [greedy_decode(session, p, 40, set()).tokens for p in prompts]
    one = [speculative_decode(session, DFlashProposer(d, "cuda"), p, 40, set()) for p in prompts]
    batched = kv_batched_decode(model, KVBatchDFlashProposer(d, "cuda"), LAYERS, prompts, 40, set(), batch_size=4)
    alone = kv_batched_decode(model, NoDrafts(), [], prompts, 40, set(), batch_size=6)
    if kind == "qwen3":
        assert [r.tokens for r in batched] == want == [r.tokens for r in one] == [r.tokens for r in alone]
        assert [r.accepted for r in batched] == [r.accepted for r in one]
        assert [r.committed for r in batched] == [r.committed for r in one]
        return
    # flash-linear-attention's chunked kernel multiplies in TF32 even for fp32 inputs (about 1e-3
    # relative to an fp64 reference, against fp32's 1e-6 for its one-token kernel): a different
    # split of the same tokens into forwards (padded batches, blocks, rollbacks) may flip a near-tie.
    # So: equal, or parting at a token the target's fp32 logits barely prefer (top-2 gap under
    # 1% of the largest logit), never at a clear choice; most prompts equal throughout.
    equal = 0
    for i, (p, w) in enumerate(zip(prompts, want)):
        for name, got in (("batched", batched[i].tokens), ("one-prompt", one[i].tokens), ("alone", alone[i].tokens)):
            equal += got == w
            if got != w:
                j = next(k for k, (a, b) in enumerate(zip(got, w)) if a != b)
                with torch.inference_mode():
                    logits = model(input_ids=torch.tensor([p + w[:j]], device="cuda")).logits[0, -1].float()
                top = logits.topk(2).values
                gap = float(top[0] - top[1]) / float(logits.abs().max())
                assert gap < 1e-2, f"{name} decode of prompt {i} parts from greedy at token {j}, a clear choice (gap {gap:.1e})"
    assert equal >= 3 * len(prompts) - 2
    for b, o, w in zip(batched, one, want):
        if b.tokens == o.tokens == w:
            assert b.accepted == o.accepted and b.committed == o.committed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hybrid_verify_forward_on_cuda_agrees_with_one_token_steps(tiny_hybrid):
    """A hybrid target on a GPU (flash-linear-attention's kernels when installed): a block verify
    (B tokens after a cached prefix) must choose the tokens that one-token steps choose, or every
    draft is refused. Oracle drafts (the target's own greedy continuation) are then accepted in
    full: tau = block size, output = the greedy decode."""
    model, _ = load_target_for_decoding(str(tiny_hybrid), "cuda", "float32")
    rng = np.random.default_rng(13)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in (5, 33, 70)]
    session = TargetSession(model, LAYERS)
    B = 8
    for p in prompts:
        want = greedy_decode(session, p, 40, set()).tokens
        got = speculative_decode(session, Oracle(list(p) + want, B, False), p, 40, set())
        assert got.tokens == want
        assert got.accepted[:-1] == [B - 1] * (len(got.accepted) - 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hybrid_cached_forwards_on_cuda_match_cpu(tiny_hybrid):
    """The cached paths a decoder takes (a prefill, one-token steps, a block after a cached
    prefix), on the GPU's kernels against CPU's reference path, same tokens fed to both (fp32):
    a recurrent state handed from one kernel to another in a different layout would show here as
    logits far apart (GPU convolutions may round through TF32, hence the tolerance)."""
    rng = np.random.default_rng(14)
    prompt = rng.integers(2, 512, size=37).tolist()
    cont = rng.integers(2, 512, size=12).tolist()
    outs = {}
    for dev in ("cpu", "cuda"):
        model, _ = load_target_for_decoding(str(tiny_hybrid), dev, "float32")
        s = TargetSession(model, LAYERS)
        got = [s.start(prompt, features=False)[0][-1:]]
        got += [s.forward([t], features=False)[0] for t in cont[:4]]  # one-token steps
        got.append(s.forward(cont[4:], features=False)[0])  # a block after the cached prefix
        outs[dev] = torch.cat(got).cpu()
    scale = outs["cpu"].abs().max()
    assert (outs["cuda"] - outs["cpu"]).abs().max() <= 2e-2 * scale


def test_a_batch_out_of_device_memory_names_the_setting():
    from types import SimpleNamespace

    from dflash_offline.evaluate.run import batch_fits
    from dflash_offline.runtime.errors import UserError

    cfg = SimpleNamespace(batch_size=512, max_new_tokens=384)
    with pytest.raises(UserError, match=r"--batch-size 512: .* does not fit in the memory of cuda:0; lower --batch-size"):
        with batch_fits(cfg, "cuda:0"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
