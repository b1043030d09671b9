"""Acceptance length: speculative decoding against tiny dense and hybrid targets is lossless (its
output is the target's own greedy decode, token for token), the decoding loop's tau is exact for an
oracle drafter and near 1 for a random one, the cache walk gives decoding's rounds exactly on the
target's own greedy completions, `--reference` checks outputs against given completions, and the
`eval` command (decoding + cache estimates) works end to end on a drafter trained for a few steps."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from conftest import fit_drafter_to_samples, run_cli
from dflash_offline.evaluate.inputs import read_reference
from dflash_offline.evaluate.speculative import (DFlashProposer, TargetSession, greedy_decode,
                                                 load_target_for_decoding, speculative_decode, summarize)
from dflash_offline.blocks.walk import cache_acceptance, cache_layer_columns, walk_acceptance, walk_rounds
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.model import DFlashDrafter

LAYERS = [1, 2, 3, 4, 5]
MAX_NEW = 33


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def target(request, tiny_dense, tiny_hybrid):
    """(kind, folder, model, prompts, reference): reference = transformers' own generate()."""
    from transformers import AutoModelForCausalLM

    folder = tiny_dense if request.param == "qwen3" else tiny_hybrid
    model, _ = load_target_for_decoding(str(folder), "cpu", "float32")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in (3, 11, 26, 40)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)[0, len(p):].tolist()
                 for p in prompts]
    return request.param, folder, model, prompts, reference


def random_drafter(folder, block_size=8, seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(str(folder), LAYERS, block_size=block_size, drafter_layers=2, mask_token_id=1)
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
    from dflash_offline.drafter import masks

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
    session = TargetSession(model, LAYERS)
    assert session.recurrent == (kind == "qwen3_5")
    proposer = DFlashProposer(random_drafter(folder), "cpu")
    for p, ref in zip(prompts, reference):
        assert greedy_decode(session, p, MAX_NEW, set()).tokens == ref
        out = speculative_decode(session, proposer, p, MAX_NEW, set())
        assert out.tokens == ref
        # The reference's count: every output token after the first is committed by one round, a + 1
        # tokens a round (the last round's cut to the output's end).
        assert sum(out.committed) == len(out.tokens) - 1 and len(out.committed) == len(out.accepted)
        assert out.committed[:-1] == [a + 1 for a in out.accepted[:-1]]
        assert out.committed[-1] in (out.accepted[-1], out.accepted[-1] + 1)


@pytest.mark.parametrize("block_size", [4, 8])
def test_oracle_gives_tau_equal_to_block_size_and_random_near_one(target, block_size):
    kind, folder, model, prompts, reference = target
    session = TargetSession(model, LAYERS)
    oracle = [speculative_decode(session, Oracle(p, ref, block_size), p, MAX_NEW, set())
              for p, ref in zip(prompts, reference)]
    assert [r.tokens for r in oracle] == reference
    s = summarize(oracle, block_size)
    # MAX_NEW - 1 = 32 tokens after the first: whole blocks of 4 or 8, every round commits B.
    assert (MAX_NEW - 1) % block_size == 0 and all(r.committed == [block_size] * ((MAX_NEW - 1) // block_size)
                                                   for r in oracle)
    assert s.tau == block_size and s.accept_rate == [1.0] * (block_size - 1)
    assert s.committed == len(prompts) * (MAX_NEW - 1) and s.tau == s.committed / s.rounds
    rand = [speculative_decode(session, RandomProposer(block_size, seed=i), p, MAX_NEW, set())
            for i, p in enumerate(prompts)]
    assert [r.tokens for r in rand] == reference
    assert 1.0 <= summarize(rand, block_size).tau < 1.1


def test_partial_acceptance_rolls_back_every_amount(target):
    """Corrupted oracle drafts: rounds accept 0..B-1 tokens, so the target cache (and for the
    hybrid target the Gated DeltaNet state) is cut back by every amount; output stays exact."""
    kind, folder, model, prompts, reference = target
    session = TargetSession(model, LAYERS)
    seen = set()
    for i, (p, ref) in enumerate(zip(prompts, reference)):
        out = speculative_decode(session, Oracle(p, ref, 8, corrupt=True, seed=i), p, MAX_NEW, set())
        assert out.tokens == ref
        seen.update(out.accepted)
    assert {0, 3, 6, 7} <= seen, seen


def test_eos_stops_like_greedy(target):
    kind, folder, model, prompts, reference = target
    session = TargetSession(model, LAYERS)
    eos = {reference[1][5]}  # a token the target emits mid-way
    want = greedy_decode(session, prompts[1], MAX_NEW, eos).tokens
    assert want[-1] in eos and len(want) <= 6
    got = speculative_decode(session, Oracle(prompts[1], reference[1], 8), prompts[1], MAX_NEW, eos)
    assert got.tokens == want
    # The round that emits the end-of-sequence token commits it and nothing after it.
    assert sum(got.committed) == len(want) - 1 and got.committed[-1] <= got.accepted[-1] + 1


# ----------------------------------------------------------------------------------------------
# The walk estimate: decoding's rounds from per-anchor acceptance


PLANTED = np.random.default_rng(5).integers(0, 10, size=256)


def planted_accept(anchor: int, block_size: int) -> int:
    """The draft slot (0-based) planted wrong at an anchor = the drafts it accepts; B-1: none wrong."""
    return min(int(PLANTED[anchor]), block_size - 1)


class PlantedOracle(Oracle):
    """The target's greedy continuation with one wrong draft at a slot fixed by the anchor's
    position, so the acceptance of every anchor is known without running anything."""

    def propose(self, tokens):
        draft = super().propose(tokens)
        j = planted_accept(len(tokens) - 1, self.block_size)
        if j < len(draft):
            draft[j] = (draft[j] + 1) % 500 + 2
        return draft


@pytest.mark.parametrize("eos_at", [None, 9])
def test_walk_rounds_equal_decoding_rounds(target, eos_at):
    """walk_rounds over the known per-anchor acceptance = speculative_decode's rounds, round for
    round, for every way a decode ends: at max_new mid-round, or at an end-of-sequence token."""
    kind, folder, model, prompts, reference = target
    B, max_new = 8, MAX_NEW - 8  # the continuation covers every slot the last round verifies
    session = TargetSession(model, LAYERS)
    seen = set()
    for p, ref in zip(prompts, reference):
        eos = {ref[eos_at]} if eos_at is not None else set()
        out = speculative_decode(session, PlantedOracle(p, ref, B), p, max_new, eos)
        stop = next((k + 1 for k, t in enumerate(ref[:max_new]) if t in eos), max_new)
        assert out.tokens == ref[:stop]
        accepted = [planted_accept(len(p) + i, B) for i in range(max_new)]
        assert walk_rounds(accepted, stop, max_new) == out.accepted
        # The reference's count: every output token after the first is committed by some round.
        assert sum(out.committed) == stop - 1 and len(out.committed) == len(out.accepted)
        seen.update(out.accepted)
    assert len(seen) >= 4, seen


WALK_NEW = 20  # decode length of the walk tests; the cache holds WALK_NEW + B completion tokens
WALK_B = 8


@pytest.fixture(scope="module")
def own_cache(tiny_dense, tmp_path_factory):
    """(cache, data parquet, {id: prompt}) of the tiny dense target's own greedy completions
    (WALK_NEW + WALK_B tokens each, no end-of-sequence stop), extracted by the real `extract`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("own")
    model, _ = load_target_for_decoding(str(tiny_dense), "cpu", "float32")
    session = TargetSession(model, LAYERS)
    rng = np.random.default_rng(11)
    prompts = {100 + k: rng.integers(2, 512, size=int(n)).tolist() for k, n in enumerate((3, 9, 17, 30, 5, 12))}
    done = {i: greedy_decode(session, p, WALK_NEW + WALK_B, set()).tokens for i, p in prompts.items()}
    data = root / "own.parquet"
    pq.write_table(pa.table({"id": pa.array(list(prompts), pa.int64()),
                             "input_ids": pa.array([prompts[i] + done[i] for i in prompts], pa.list_(pa.int32())),
                             "loss_mask": pa.array([[0] * len(prompts[i]) + [1] * len(done[i]) for i in prompts],
                                                   pa.list_(pa.int8()))}), data)
    cache = root / "cache"
    r = run_cli(["extract", "--target", tiny_dense, "--data", data, "--cache", cache, "--topk", "0", "--max-len", "128",
                 "--batch-tokens", "512", "--shard-tokens", "1024", "--no-progress"])
    assert r.returncode == 0, r.stderr
    return cache, data, prompts


def fit_drafter(d: DFlashDrafter, cache, steps: int = 15, seed: int = 0) -> DFlashDrafter:
    """A few optimiser steps on the cache itself (the features it stores)."""
    from dflash_offline.cache.reader import CacheReader

    reader = CacheReader(str(cache))
    cols = cache_layer_columns(reader.manifest, d.cfg, str(cache)) or list(range(len(LAYERS)))
    samples = list(reader.samples())
    S = max(len(s.input_ids) for s in samples)
    feats = torch.zeros(len(samples), S, len(cols) * d.cfg.hidden_size)
    for i, s in enumerate(samples):
        feats[i, :len(s.input_ids)] = torch.from_numpy(s.hidden[:, cols].reshape(len(s.input_ids), -1))
    return fit_drafter_to_samples(d, feats, [s.input_ids.astype(np.int64) for s in samples],
                                  [s.loss_mask for s in samples], steps, anchors=16, seed=seed)


class CacheFeatures:
    """The real DFlashProposer, fed the features the cache stores (bf16) instead of the target's
    fp32 ones, so that decoding and the walk give the drafter the same inputs and must agree
    exactly; the target still verifies every block."""

    def __init__(self, inner, stored, full=False):
        self.inner, self.stored, self.block_size, self.full = inner, stored, inner.block_size, full

    def start(self, prompt, features):
        self.n = len(prompt)
        self.inner.start(prompt, self.stored[:self.n])

    def observe(self, features):
        T = features.shape[0]
        self.inner.observe(self.stored[self.n:self.n + T])
        self.n += T

    def draft_logits(self, tokens, n):
        # full: always the whole block (what the walk scores), its first n drafts used; otherwise
        # decoding's own rule (an output's last round drafts a shorter block).
        return self.inner.draft_logits(tokens, self.block_size - 1 if self.full else n)[:n]


def decode_cache_prompts(session, drafter, cache, ids, max_new, full=False):
    from dflash_offline.cache.reader import CacheReader

    reader = CacheReader(str(cache))
    cols = cache_layer_columns(reader.manifest, drafter.cfg, str(cache)) or list(range(len(LAYERS)))
    runs = []
    for i in ids:
        s = reader.sample(i)
        p0 = int(np.flatnonzero(s.loss_mask)[0])
        stored = torch.from_numpy(np.ascontiguousarray(s.hidden[:, cols]).reshape(len(s.input_ids), -1))
        out = speculative_decode(session, CacheFeatures(DFlashProposer(drafter, "cpu"), stored, full),
                                 s.input_ids[:p0].tolist(), max_new, set())
        assert out.tokens == s.input_ids[p0:p0 + max_new].tolist()  # the cache holds the greedy decode
        runs.append(out)
    return runs


def full_block_rounds(run, max_new: int, block_size: int) -> int:
    """How many of a decode's first rounds drafted a whole block (max_new - tokens out >= B - 1):
    the rounds before the shortened blocks of the output's end."""
    n, k = 1, 0
    while k < len(run.committed) and max_new - n >= block_size - 1:
        n += run.committed[k]
        k += 1
    return k


def test_walk_equals_decoding_tau_on_own_greedy_completions(own_cache, tiny_dense):
    """walk_acceptance on a cache of the target's own greedy completions = speculative decoding of
    the same prompts: the rounds of every prompt, tau pooled (the reference's rule: committed
    tokens / rounds) and the per-prompt mean, exactly, when decoding drafts whole blocks as the walk
    scores them; decoding's own last rounds (a shorter block, the reference's rule) differ from the
    walk at most from the first shortened block on. For a random drafter and for one fitted to
    accept some blocks; the drafter reads a subset of the captured layers in another order (the
    column choice; all layers is the plain case)."""
    layers = [4, 2]
    cache, _, prompts = own_cache
    model, _ = load_target_for_decoding(str(tiny_dense), "cpu", "float32")
    session = TargetSession(model, layers)
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(str(tiny_dense), layers, block_size=WALK_B, drafter_layers=2, mask_token_id=1)
    drafter = DFlashDrafter(cfg)
    drafter.load_frozen_from_target(str(tiny_dense))
    for fitted in (False, True):
        d = fit_drafter(drafter, cache) if fitted else drafter.eval()
        walk = walk_acceptance(str(cache), d, "cpu", max_new=WALK_NEW, per_sample=True)
        ids = [x["id"] for x in walk["per_sample"]]
        assert sorted(ids) == sorted(prompts) and walk["samples"] == len(prompts)
        runs = decode_cache_prompts(session, d, cache, ids, WALK_NEW, full=True)
        assert [x["accepted"] for x in walk["per_sample"]] == [r.accepted for r in runs]
        s = summarize(runs, WALK_B)
        assert s.committed == len(prompts) * (WALK_NEW - 1) and s.tau == s.committed / s.rounds
        assert walk["tau_pooled"] == s.tau and walk["rounds"] == s.rounds
        assert walk["accept_rate"] == s.accept_rate
        assert walk["tau_per_prompt_mean"] == s.tau_per_prompt_mean
        assert s.tau_per_prompt == [sum(r.committed) / len(r.committed) for r in runs]
        # Every candidate anchor: all completion tokens but the last of each sample.
        assert walk["anchors"] == len(prompts) * (WALK_NEW + WALK_B - 1)
        assert 1.0 <= walk["tau_all_anchors"] <= WALK_B and len(walk["slot_accuracy"]) == WALK_B - 1
        # Decoding's own rule: the same rounds up to the first shortened block.
        own = decode_cache_prompts(session, d, cache, ids, WALK_NEW)
        for x, r in zip(walk["per_sample"], own):
            k = full_block_rounds(r, WALK_NEW, WALK_B)
            assert k >= 1 and x["accepted"][:k] == r.accepted[:k]
            assert sum(r.committed) == WALK_NEW - 1
    # The fitted drafter: rounds that accept nothing and rounds that accept every draft.
    assert {0, WALK_B - 1} <= {a for x in walk["per_sample"] for a in x["accepted"]}, walk

    # The anchors in smaller pieces and batches, from a drafter left in train mode: same numbers.
    d.train()
    again = walk_acceptance(str(cache), d, "cpu", max_new=WALK_NEW, per_sample=True, anchors_per_row=5, batch_rows=3)
    assert d.training
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in walk.items() if k != "seconds"}
    d.eval()

    # Without max_new the walk stops where the data ends (WALK_NEW + WALK_B tokens); decoding to
    # that length commits nothing past it either (its last rounds draft only what they can
    # commit), so with whole blocks drafted the rounds are the same, the last one included.
    full = walk_acceptance(str(cache), d, "cpu", per_sample=True)
    runs = decode_cache_prompts(session, d, cache, ids, WALK_NEW + WALK_B, full=True)
    assert [x["accepted"] for x in full["per_sample"]] == [r.accepted for r in runs]
    assert full["tau_pooled"] == summarize(runs, WALK_B).tau


def test_random_anchor_estimate_reads_a_layer_subset(own_cache, tiny_dense):
    """cache_acceptance with a drafter on a subset of the cache's layers: with room for every
    anchor it scores exactly the walk's anchors (the same columns, the same numbers); a drafter
    layer the cache lacks is refused by both."""
    from dflash_offline.runtime.errors import UserError

    cache, _, _ = own_cache
    cfg = DrafterConfig.from_target(str(tiny_dense), [4, 2], block_size=WALK_B, drafter_layers=2, mask_token_id=1)
    torch.manual_seed(1)
    d = DFlashDrafter(cfg)
    d.load_frozen_from_target(str(tiny_dense))
    d = fit_drafter(d, cache, steps=8)
    est = cache_acceptance(str(cache), d, "cpu", seq_len=128, num_anchors=128)
    walk = walk_acceptance(str(cache), d, "cpu")
    assert est["blocks"] == walk["anchors"]
    assert est["tau"] == pytest.approx(walk["tau_all_anchors"], rel=1e-12)
    assert est["slot_accuracy"] == pytest.approx(walk["slot_accuracy"], rel=1e-12)
    bad = DFlashDrafter(DrafterConfig.from_target(str(tiny_dense), [2, 6], block_size=WALK_B, drafter_layers=1,
                                                  mask_token_id=1))
    for fn in (lambda: walk_acceptance(str(cache), bad, "cpu"),
               lambda: cache_acceptance(str(cache), bad, "cpu", 128, 16)):
        with pytest.raises(UserError, match=r"holds layers \[1, 2, 3, 4, 5\] but the drafter reads \[2, 6\] \(no \[6\]\)"):
            fn()


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
                 "--block-size", "8", "--global-batch-tokens", "256", "--mask-token-id", "1", "--drafter-layers", "2",
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
        assert e["cache_walk"]["rounds"] > 0 and 1.0 <= e["cache_walk"]["tau_pooled"] <= 8
    # The export (bf16 weights) and its checkpoint (fp32) are the same drafter up to rounding.
    assert abs(rep["drafters"][0]["cache_estimate"]["tau"] - rep["drafters"][1]["cache_estimate"]["tau"]) < 0.2
    assert "speculative decoding: 3 prompts" in r.stdout and "lossless" in r.stdout
    assert "note: 3 prompt(s)," in r.stdout and "the speed-up says little" in r.stdout  # too few to time
    assert (run / "logs" / "eval.log").is_file()
    # One prompt at a time: both targets through the static decoder (auto).
    assert rep["decoder"] == "static" and rep["batch_size"] == 1
    assert rep["decoding"] in r.stdout and "one prompt at a time" in rep["decoding"]
    for e in rep["drafters"]:
        assert [sum(c) for c in e["committed_per_prompt"]] == [24 - 1] * 3  # the reference's count
        assert e["committed"] == 3 * 23 and e["tau"] == e["committed"] / e["rounds"]
        assert [len(c) for c in e["committed_per_prompt"]] == [len(a) for a in e["accepted_per_prompt"]]
    # Batched (2 prompts per forward): the same rounds, so the same tau; the target alone is
    # batched through the same decoder, so there is a speed-up figure, for the hybrid target too.
    # Auto: static buffers (and recurrent states settled at the accepted length, for the hybrid);
    # --decoder transformers: KV caches (recurrent states rolled back per row): the same rounds.
    runs = [([], "static", "static buffers"), (["--decoder", "transformers"], "transformers", "KV caches")]
    for opts, name, how in runs:
        batched = tmp_path / "eval-batched.json"
        r = run_cli(["eval", "--target", folder, "--drafter", run / "export", "--drafter", run / "step-6",
                     "--prompts", prompts, "--max-new-tokens", "24", "--batch-size", "2", "--json", batched,
                     "--no-progress", *opts])
        assert r.returncode == 0, r.stderr
        bat = json.loads(batched.read_text())
        assert "batch_decoder" not in bat and bat["batch_size"] == 2
        assert bat["decoder"] == name and how in bat["decoding"] and "2 prompts per forward" in bat["decoding"], bat
        assert bat["decoding"] in r.stdout
        assert bat["baseline"]["tokens"] == 3 * 24
        for one, e in zip(rep["drafters"], bat["drafters"]):
            assert e["lossless"] is True and e["rounds"] == one["rounds"] and e["tau"] == one["tau"]
            assert e["committed_per_prompt"] == one["committed_per_prompt"]
            assert e["speedup"] > 0


def test_eval_refusals(tiny_dense, tiny_hybrid, arith_cache, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_offline.drafter.export import export_drafter

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
    # Cache-estimate settings that cannot work are refused before any decoding (one line, exit 2).
    prompts = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7]]}), prompts)
    for opts, says in ((["--seq-len", "16", "--num-anchors", "100000"], "--num-anchors 100000 exceeds --seq-len 16"),
                       (["--seq-len", "8"], "--seq-len 8 must exceed the drafter's block size (8)")):
        r = run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--prompts", prompts, "--cache", arith_cache,
                     *opts, "--no-progress"])
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "speculative" not in r.stdout  # nothing decoded
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--prompts", prompts, "--log-dir", afile])
    assert r.returncode == 2 and f"--log-dir {afile}: cannot write the log folder there" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and afile.read_text() == "x"


@pytest.mark.parametrize("table, says", [
    ({"input_ids": [["1", "2"]]}, "column 'input_ids' must be a list of integers (token ids), found list<element: string>"),
    ({"input_ids": [1, 2]}, "column 'input_ids' must be a list of integers (token ids), found int64"),
    ({"input_ids": [[[1], [2]]]}, "column 'input_ids' must be a list of integers (token ids), found list<element: list"),
    ({"id": ["a"], "input_ids": [[1, 2]]}, "column 'id' must be an integer, found string"),
    ({"id": [1.5, 2.5], "input_ids": [[1], [2]]}, "column 'id' must be an integer, found double"),
    ({"id": [None, 1], "input_ids": [[1], [2]]}, "row 0 has a null id"),
    ({"id": [7, 7], "input_ids": [[1], [2]]}, "id 7 occurs twice"),
    ({"input_ids": [[1], None]}, "row 1 is null"),
])
def test_eval_prompt_file_refusals(table, says, tmp_path):
    """Each malformed --prompts file is one UserError naming the file and the problem, not a
    TypeError from deep inside the decoder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_offline.evaluate.inputs import read_prompts
    from dflash_offline.runtime.errors import UserError

    types = {"id": pa.int64() if table.get("id") and None in table["id"] else None,
             "input_ids": pa.list_(pa.int64()) if None in table["input_ids"] else None}
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({k: pa.array(v, types[k]) for k, v in table.items()}), path)
    with pytest.raises(UserError, match=re.escape(f"--prompts {path}: {says}")):
        read_prompts(str(path), 512)


def test_eval_of_a_downloaded_drafter_writes_no_folder_beside_it(tiny_dense, tmp_path):
    """A drafter outside any training run (downloaded, copied): eval's log goes to ./dflash-logs
    (or --log-dir), never into a new logs/ folder beside someone's model."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_offline.drafter.export import export_drafter

    models, work = tmp_path / "models", tmp_path / "work"
    work.mkdir()
    export = export_drafter(random_drafter(tiny_dense), str(models / "drafter"))
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7, 8]]}), prompts)
    args = ["eval", "--target", tiny_dense, "--drafter", export, "--prompts", prompts, "--max-new-tokens", "4",
            "--no-progress"]
    r = run_cli(args, cwd=work)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in models.iterdir()) == ["drafter"]
    assert (work / "dflash-logs" / "eval.log").is_file()
    r = run_cli([*args, "--log-dir", tmp_path / "mine"], cwd=work)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "mine" / "eval.log").is_file()


# ----------------------------------------------------------------------------------------------
# --reference: the lossless check against given greedy completions


def write_rows(path, ids, rows, masks=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {"id": pa.array(ids, pa.int64()), "input_ids": pa.array(rows, pa.list_(pa.int32()))}
    if masks is not None:
        cols["loss_mask"] = pa.array(masks, pa.list_(pa.int8()))
    pq.write_table(pa.table(cols), path)
    return path


def test_read_reference(tmp_path):
    """The expected outputs are the completions cut where greedy decoding stops; every way a
    reference cannot serve is refused in one line that names the file."""
    from dflash_offline.runtime.errors import UserError

    ids, prompts = [1, 2], [[5, 6], [7]]
    good = write_rows(tmp_path / "good.parquet", [2, 1, 9], [[7, 10, 11, 12, 13], [5, 6, 20, 21, 22, 23], [4, 4]],
                      [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [0, 1]])
    assert read_reference(str(good), ids, prompts, 3, set()) == [[20, 21, 22], [10, 11, 12]]
    assert read_reference(str(good), ids, prompts, 9, {11, 21}) == [[20, 21], [10, 11]]  # stops at eos
    cases = {
        "short": ((ids, prompts, 5, set()), r"id 1: its completion ends after 4 tokens without an end-of-sequence token, "
                                            r"before --max-new-tokens 5"),
        "missing": (([1, 3], [[5, 6], [8]], 3, set()), r"no row for prompt id\(s\) \[3\] \(1 of 2\)"),
        "prompt": ((ids, [[5, 6], [8]], 3, set()), r"id 2: its prompt \(1 tokens\) differs from the --prompts row \(1 tokens\) "
                                                   r"from token 0 on"),
    }
    for name, (args, msg) in cases.items():
        with pytest.raises(UserError, match=msg) as e:
            read_reference(str(good), *args)
        assert str(good) in str(e.value) and "\n" not in str(e.value), name
    holey = write_rows(tmp_path / "holey.parquet", [1, 2], [[5, 6, 1, 2], [7, 1]], [[0, 0, 1, 0], [0, 1]])
    with pytest.raises(UserError, match="id 1: loss_mask is not 0 on a prompt then 1 on the completion"):
        read_reference(str(holey), ids, prompts, 1, set())
    no_mask = write_rows(tmp_path / "prompts.parquet", ids, prompts)
    with pytest.raises(UserError, match="no loss_mask column"):
        read_reference(str(no_mask), ids, prompts, 1, set())
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="not a readable Parquet file"):
        read_reference(str(tmp_path / "junk.parquet"), ids, prompts, 1, set())


def test_eval_with_reference_and_cache_walk(own_cache, tiny_dense, tmp_path):
    """`eval --reference` checks the outputs against the target's greedy completions without a
    target-alone decode (lossless, or not for the id whose reference was changed); a reference
    that does not complete the prompts is refused before decoding (exit 2, one line). The same
    run's `--cache` prints and records the walk beside the random-anchor estimate."""
    import pyarrow.parquet as pq

    from dflash_offline.drafter.export import export_drafter

    cache, data, prompts = own_cache
    export = export_drafter(random_drafter(tiny_dense, block_size=WALK_B), str(tmp_path / "export"))
    ids = list(prompts)
    prompt_file = write_rows(tmp_path / "prompts.parquet", ids, [prompts[i] for i in ids])
    common = ["eval", "--target", tiny_dense, "--drafter", export, "--prompts", prompt_file, "--max-new-tokens",
              WALK_NEW, "--ignore-eos", "--no-progress"]
    report = tmp_path / "eval.json"
    r = run_cli(common + ["--reference", data, "--cache", cache, "--seq-len", "128", "--num-anchors", "16",
                          "--json", report])
    assert r.returncode == 0, r.stderr
    rep = json.loads(report.read_text())
    e = rep["drafters"][0]
    assert "baseline" not in rep and rep["lossless_against"] == str(data) and "speedup" not in e
    assert e["lossless"] is True and e["mismatched_prompt_ids"] == [] and e["tokens"] == len(ids) * WALK_NEW
    assert f"lossless (against {data}), no baseline decode (no speed-up)" in r.stdout
    walk = e["cache_walk"]
    assert walk["samples"] == len(ids) and walk["rounds"] > 0 and 1.0 <= walk["tau_pooled"] <= WALK_B
    assert e["cache_estimate"]["blocks"] > 0 and "walk" in r.stdout and "random" in r.stdout

    rows = pq.read_table(data).to_pylist()
    changed = next(x for x in rows if x["id"] == 102)
    changed["input_ids"][len(prompts[102]) + 5] = (changed["input_ids"][len(prompts[102]) + 5] + 1) % 500 + 2
    bad_token = write_rows(tmp_path / "changed.parquet", [x["id"] for x in rows], [x["input_ids"] for x in rows],
                           [x["loss_mask"] for x in rows])
    # Not lossless: the report and its JSON say which prompt, and the command fails (exit 1).
    r = run_cli(common + ["--reference", bad_token, "--json", report, "--log-dir", tmp_path / "lg"])
    assert r.returncode == 1, (r.returncode, r.stderr)
    # A failed check is not a crash: the process ended as done, no traceback in its log.
    assert json.loads((tmp_path / "lg" / "eval.heartbeat.json").read_text())["state"] == "done"
    assert "Traceback" not in (tmp_path / "lg" / "eval.log").read_text()
    e = json.loads(report.read_text())["drafters"][0]
    assert e["lossless"] is False and e["mismatched_prompt_ids"] == [102]
    assert "NO (1)" in r.stdout and "1 of" in r.stderr and "differ from the target's greedy decode" in r.stderr

    other = {**prompts, 103: prompts[103][:-1] + [prompts[103][-1] % 500 + 2]}
    bad_prompt = write_rows(tmp_path / "other.parquet", ids, [other[i] for i in ids])
    r = run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--prompts", bad_prompt, "--reference", data,
                 "--max-new-tokens", WALK_NEW])
    assert r.returncode == 2 and f"--reference {data}: id 103: its prompt" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
