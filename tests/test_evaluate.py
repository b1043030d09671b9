"""Acceptance length: speculative decoding against tiny dense and hybrid targets is lossless (its
output is the target's own greedy decode, token for token), the decoding loop's tau is exact for an
oracle drafter and near 1 for a random one, and the `eval` command (decoding + cache estimate) works
end to end on a drafter trained for a few steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import run_cli
from dflash_offline import evaluate as ev
from dflash_offline.drafter import DFlashDrafter, DrafterConfig

LAYERS = [1, 2, 3, 4, 5]
MAX_NEW = 33


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def target(request, tiny_dense, tiny_hybrid):
    """(kind, folder, model, prompts, reference): reference = transformers' own generate()."""
    from transformers import AutoModelForCausalLM

    folder = tiny_dense if request.param == "qwen3" else tiny_hybrid
    model, _ = ev.load_target_for_decoding(str(folder), "cpu", "float32")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in (3, 11, 26, 40)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)[0, len(p):].tolist()
                 for p in prompts]
    return request.param, folder, model, prompts, reference


def random_drafter(folder, block_size=8, seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(str(folder), LAYERS, block_size=block_size, num_layers=2, mask_token_id=1)
    d = DFlashDrafter(cfg)
    d.load_frozen_from_target(str(folder))
    return d.eval()


class Oracle:
    """Test double: proposes the target's own greedy continuation (known in advance); with
    `corrupt`, replaces one draft slot at random with a wrong token, so rounds accept every
    length from 0 to B-1 and the caches are cut back by every amount."""

    def __init__(self, prompt, continuation, block_size, corrupt=False, seed=0):
        self.full = list(prompt) + list(continuation) + [3] * block_size
        self.block_size, self.corrupt = block_size, corrupt
        self.rng = np.random.default_rng(seed)

    def start(self, prompt, features):
        pass

    def observe(self, features):
        pass

    def propose(self, tokens):
        assert tokens == self.full[:len(tokens)], "the decoder committed a token the target would not produce"
        draft = self.full[len(tokens):len(tokens) + self.block_size - 1]
        if self.corrupt and self.rng.random() < 0.8:
            j = int(self.rng.integers(0, len(draft)))
            draft[j] = (draft[j] + 1) % 500 + 2
        return draft


class RandomProposer:
    def __init__(self, block_size, seed=0):
        self.block_size, self.rng = block_size, np.random.default_rng(seed)

    def start(self, prompt, features):
        pass

    def observe(self, features):
        pass

    def propose(self, tokens):
        return self.rng.integers(2, 512, size=self.block_size - 1).tolist()


def test_draft_path_equals_training_forward(tiny_dense):
    """Inference (cached context keys/values, no mask) = the training forward of the same block
    under the training mask: the drafter is trained and used on the same computation."""
    from dflash_offline import masks

    d = random_drafter(tiny_dense)
    S, B, anchor = 30, 8, 19
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, S, len(LAYERS) * 64, generator=g)
    block = torch.tensor([[int(torch.randint(2, 500, (1,), generator=g))] + [1] * (B - 1)])
    bpos = torch.arange(anchor, anchor + B)[None]
    mask = masks.dense_mask(torch.zeros(1, S, dtype=torch.int32), torch.tensor([[anchor]]), torch.tensor([[True]]), B)
    with torch.no_grad():
        train_h = d(feats, block, torch.arange(S)[None], bpos, mask)
    # Context committed in two pieces, as decoding does; positions at and after the anchor unused.
    kv1, kv2 = d.context_kv(feats[:, :7], torch.arange(7)[None]), d.context_kv(feats[:, 7:anchor], torch.arange(7, anchor)[None])
    kv = [(torch.cat([a[0], b[0]], 2), torch.cat([a[1], b[1]], 2)) for a, b in zip(kv1, kv2)]
    infer_h = d.draft_hidden(kv, block, bpos)
    torch.testing.assert_close(infer_h, train_h, rtol=1e-5, atol=1e-5)


def test_greedy_reference_and_speculative_decoding_are_lossless(target):
    kind, folder, model, prompts, reference = target
    session = ev.TargetSession(model, LAYERS)
    assert session.recurrent == (kind == "qwen3_5")
    proposer = ev.DFlashProposer(random_drafter(folder), "cpu")
    for p, ref in zip(prompts, reference):
        assert ev.greedy_decode(session, p, MAX_NEW, set()).tokens == ref
        out = ev.speculative_decode(session, proposer, p, MAX_NEW, set())
        assert out.tokens == ref
        assert sum(a + 1 for a in out.accepted) >= MAX_NEW - 1  # every round committed a + 1 tokens


@pytest.mark.parametrize("block_size", [4, 8])
def test_oracle_gives_tau_equal_to_block_size_and_random_near_one(target, block_size):
    kind, folder, model, prompts, reference = target
    session = ev.TargetSession(model, LAYERS)
    oracle = [ev.speculative_decode(session, Oracle(p, ref, block_size), p, MAX_NEW, set())
              for p, ref in zip(prompts, reference)]
    assert [r.tokens for r in oracle] == reference
    s = ev.summarize(oracle, block_size)
    assert s["tau"] == block_size and s["accept_rate"] == [1.0] * (block_size - 1)
    rand = [ev.speculative_decode(session, RandomProposer(block_size, seed=i), p, MAX_NEW, set())
            for i, p in enumerate(prompts)]
    assert [r.tokens for r in rand] == reference
    assert 1.0 <= ev.summarize(rand, block_size)["tau"] < 1.1


def test_partial_acceptance_rolls_back_every_amount(target):
    """Corrupted oracle drafts: rounds accept 0..B-1 tokens, so the target cache (and for the
    hybrid target the Gated DeltaNet state) is cut back by every amount; output stays exact."""
    kind, folder, model, prompts, reference = target
    session = ev.TargetSession(model, LAYERS)
    seen = set()
    for i, (p, ref) in enumerate(zip(prompts, reference)):
        out = ev.speculative_decode(session, Oracle(p, ref, 8, corrupt=True, seed=i), p, MAX_NEW, set())
        assert out.tokens == ref
        seen.update(out.accepted)
    assert {0, 3, 6, 7} <= seen, seen


def test_eos_stops_like_greedy(target):
    kind, folder, model, prompts, reference = target
    session = ev.TargetSession(model, LAYERS)
    eos = {reference[1][5]}  # a token the target emits mid-way
    want = ev.greedy_decode(session, prompts[1], MAX_NEW, eos).tokens
    assert want[-1] in eos and len(want) <= 6
    got = ev.speculative_decode(session, Oracle(prompts[1], reference[1], 8), prompts[1], MAX_NEW, eos)
    assert got.tokens == want


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_eval_command_with_a_trained_drafter(kind, tiny_dense, tiny_hybrid, tmp_path):
    """extract -> train a few steps -> `eval --prompts --cache --json`: every output equals the
    target's greedy decode, and the report carries tau, per-slot rates and speed for both modes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_offline.tiny import make_tiny_data

    folder = tiny_dense if kind == "qwen3" else tiny_hybrid
    data = make_tiny_data(tmp_path / "data.parquet", rows=24, min_len=30, max_len=90, seed=5)
    cache = tmp_path / "cache"
    r = run_cli(["extract", "--target", folder, "--data", data, "--cache", cache, "--topk", "0", "--max-len", "128",
                 "--batch-tokens", "512", "--shard-tokens", "1024", "--no-progress"])
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    r = run_cli(["train", "--target", folder, "--cache", cache, "--out", run, "--seq-len", "128", "--num-anchors", "8",
                 "--block-size", "8", "--global-batch-tokens", "256", "--mask-token-id", "1", "--num-layers", "2",
                 "--max-steps", "6", "--loader-workers", "0", "--no-progress"])
    assert r.returncode == 0, r.stderr
    rng = np.random.default_rng(3)
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": pa.array([10, 11, 12], pa.int64()),
                             "input_ids": [rng.integers(2, 512, size=n).tolist() for n in (4, 17, 33)]}), prompts)
    report = tmp_path / "eval.json"
    r = run_cli(["eval", "--target", folder, "--drafter", run / "export", "--drafter", run / "step-6",
                 "--prompts", prompts, "--cache", cache, "--max-new-tokens", "24", "--seq-len", "128",
                 "--num-anchors", "8", "--json", report, "--no-progress"])
    assert r.returncode == 0, r.stderr
    rep = json.loads(report.read_text())
    assert rep["num_prompts"] == 3 and rep["hybrid_target"] == (kind == "qwen3_5")
    assert rep["baseline"]["tokens"] == 3 * 24
    for e in rep["drafters"]:
        assert e["lossless"] is True and e["mismatched_prompt_ids"] == []
        assert e["tokens"] == 3 * 24 and 1.0 <= e["tau"] <= 8 and len(e["accept_rate"]) == 7
        assert e["speedup"] > 0 and e["cache_estimate"]["blocks"] > 0
        assert 1.0 <= e["cache_estimate"]["tau"] <= 8
    # The export (bf16 weights) and its checkpoint (fp32) are the same drafter up to rounding.
    assert abs(rep["drafters"][0]["cache_estimate"]["tau"] - rep["drafters"][1]["cache_estimate"]["tau"]) < 0.2
    assert "speculative decoding: 3 prompts" in r.stdout and "lossless" in r.stdout
    assert (run / "logs" / "eval.log").is_file()


def test_eval_refusals(tiny_dense, tiny_hybrid, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_offline.drafter import export_drafter

    d = random_drafter(tiny_dense)
    export = export_drafter(d, str(tmp_path / "export"))
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7], [4, 99999]]}), bad)
    r = run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--prompts", bad])
    assert r.returncode == 2 and "row 1 holds token id 99999" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli(["eval", "--target", tiny_dense, "--drafter", tmp_path, "--prompts", bad])
    assert r.returncode == 2 and "neither a drafter export" in r.stderr, r.stderr
    r = run_cli(["eval", "--target", tiny_dense, "--drafter", export])
    assert r.returncode == 2 and "--prompts" in r.stderr
