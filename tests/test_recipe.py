"""The training recipe's levers: the anchor budget per sample, a subset of the cache's layers,
distillation targets from the cache's top-k, and the held-out walk estimate that keeps best/."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import TRAIN, run_cli
from dflash_offline.blocks.packing import build_row, loss_weights


def _random_row(rng, S):
    """Samples of random lengths and loss masks (a prompt part, then a completion) that fill most of a row."""
    ids, lms, used = [], [], 0
    while True:
        n = int(rng.integers(3, 90))
        if used + n > S:
            break
        m = np.zeros(n, np.uint8)
        m[int(rng.integers(0, n)):] = 1
        if rng.random() < 0.2:
            m[int(rng.integers(0, n))] = 0  # a hole inside the completion
        ids.append(rng.integers(2, 500, n).astype(np.int64))
        lms.append(m)
        used += n
    return ids, lms


def _candidates(lms):
    """Brute force: per sample, the row positions p with loss_mask[p] and loss_mask[p + 1] in that sample."""
    out, start = [], 0
    for m in lms:
        out.append([start + p for p in range(len(m) - 1) if m[p] and m[p + 1]])
        start += len(m)
    return out


@pytest.mark.parametrize("per_sample,capacity", [(4, 512), (4, 20), (1000, 512), (1000, 30), (1, 3)])
def test_anchor_budget_follows_the_samples_of_a_row(per_sample, capacity):
    rng = np.random.default_rng(per_sample * 1000 + capacity)
    S, B = 512, 4
    for trial in range(25):
        ids, lms = _random_row(rng, S)
        cands = _candidates(lms)
        row = build_row(ids, lms, S, capacity, B, 1, loss_weights(B, 4.0), np.random.default_rng(trial),
                        anchors_per_sample=per_sample)
        chosen = row.anchors[row.anchor_valid]
        assert not row.anchor_valid[len(chosen):].any(), "valid anchors come first"
        assert np.all(np.diff(chosen) > 0), "sorted and distinct"
        owner = {p: d for d, c in enumerate(cands) for p in c}
        assert all(int(p) in owner for p in chosen), "every anchor is a candidate"
        per_doc = np.bincount([owner[int(p)] for p in chosen], minlength=len(cands))
        budget = np.array([min(per_sample, len(c)) for c in cands])
        if budget.sum() <= capacity:
            assert np.array_equal(per_doc, budget), (per_doc, budget)  # every sample gets its whole budget
        else:
            assert len(chosen) == capacity and np.all(per_doc <= budget)


def test_anchor_budget_subsamples_in_proportion_when_over_capacity():
    # Two samples, budgets 10 and 40, capacity 25: on average 5 and 20 anchors.
    ids = [np.arange(2, 14), np.arange(2, 44)]
    lms = [np.ones(12, np.uint8), np.ones(42, np.uint8)]
    counts = []
    for t in range(400):
        row = build_row(ids, lms, 64, 25, 4, 1, loss_weights(4, 4.0), np.random.default_rng(t), anchors_per_sample=40)
        counts.append(int((row.anchors[row.anchor_valid] < 12).sum()))
    assert abs(np.mean(counts) - 25 * 11 / (11 + 40)) < 0.5  # candidates: 11 and 41, budgets 11 and 40


def test_one_draw_per_row_is_the_previous_rule_bit_for_bit():
    rng = np.random.default_rng(5)
    for trial in range(20):
        ids, lms = _random_row(rng, 256)
        row = build_row(ids, lms, 256, 16, 4, 1, loss_weights(4, 4.0), np.random.default_rng(trial))
        cand = np.array([p for c in _candidates(lms) for p in c], np.int64)
        take = min(16, len(cand))
        ref = np.sort(np.random.default_rng(trial).choice(cand, size=take, replace=False)) if take else cand[:0]
        assert np.array_equal(row.anchors[:take], ref) and row.anchor_valid.sum() == take


# ----------------------------------------------------------------------------------------------
# Layer subset, distillation targets


@pytest.fixture(scope="module")
def layer_caches(valid_cache, tiny_dense, tiny_data, tmp_path_factory):
    """(the session's valid cache: layers 1-5, top-4; a cache of the same data with layers 2 and 4
    only, no top-k), made with the same small options."""
    from conftest import extract_args

    subset = tmp_path_factory.mktemp("layers") / "subset"
    r = run_cli(extract_args(tiny_dense, tiny_data, subset, "--capture-layers", "2,4", "--topk", "0"), timeout=300)
    assert r.returncode == 0, r.stderr
    return valid_cache, subset


def _train(target, cache, out, *extra):
    return run_cli(["train", "--target", str(target), "--cache", str(cache), "--out", str(out), *TRAIN,
                    "--epochs", "1", "--max-steps", "4", "--checkpoint-every", "100", *extra], timeout=600)


def _losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_layer_subset_trains_exactly_as_a_cache_of_only_those_layers(layer_caches, tiny_dense, tmp_path):
    superset, subset = layer_caches
    a = _train(tiny_dense, superset, tmp_path / "a", "--target-layers", "4,2")  # any order: the cache's is used
    assert a.returncode == 0, a.stderr
    b = _train(tiny_dense, subset, tmp_path / "b")
    assert b.returncode == 0, b.stderr
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    wa, wb = load_file(str(tmp_path / "a" / "step-4" / "drafter.safetensors")), \
        load_file(str(tmp_path / "b" / "step-4" / "drafter.safetensors"))
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
    cfg = json.loads((tmp_path / "a" / "export" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [2, 4]
    # A layer the cache does not hold: one line, before any work.
    r = _train(tiny_dense, superset, tmp_path / "c", "--target-layers", "2,6")
    assert r.returncode == 2 and "holds layers [1, 2, 3, 4, 5], not [6]" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "c" / "metrics.jsonl").exists()


def test_distillation_targets_are_the_top_k_of_the_position_before_each_slot(layer_caches):
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.blocks.packing import pack_rows, epoch_order
    from dflash_offline.blocks.stream import RowStream, Span

    superset, _ = layer_caches
    reader = CacheReader(str(superset))
    refs, lengths, tops = [], [], []
    for name in reader.shard_names:
        sh = reader.shard(name)
        offs = sh.offsets
        lengths.extend((offs[1:] - offs[:-1]).tolist())
        refs.extend((name, k, int(offs[k])) for k in range(len(sh)))
        g = sh.group
        tops.extend((g["topk_ids"][offs[k]:offs[k + 1]], g["topk_logprobs"][offs[k]:offs[k + 1]]) for k in range(len(sh)))
    lengths = np.asarray(lengths, np.int64)
    B, S = 8, 256
    spec = {"seed": 0, "seq_len": S, "num_anchors": 16, "block_size": B, "mask_token_id": 1, "gamma": 4.0,
            "hidden_size": 64, "num_layers": 5, "hidden_dtype": "bfloat16", "topk": 4, "anchors_per_sample": 512}
    stream = RowStream(str(superset), refs, lengths, spec, Span(0, 0, 2), 0, 1, 1)
    rows = pack_rows(lengths, epoch_order(len(refs), 0, 0), S)
    for g, mb in enumerate(stream):
        # Where each row position comes from: (sample, token in sample).
        where = [(smp, t) for smp, keep in rows[g] for t in range(keep)]
        anchors, valid = mb["anchors"][0].numpy(), mb["anchor_valid"][0].numpy()
        ids, lps = mb["soft_ids"][0].numpy().reshape(-1, B, 4), mb["soft_logprobs"][0].numpy().reshape(-1, B, 4)
        w = mb["weights"][0].numpy().reshape(-1, B)
        checked = 0
        for n in np.flatnonzero(valid):
            for j in range(1, B):
                if w[n, j] == 0:
                    continue
                smp, t = where[anchors[n] + j - 1]
                assert np.array_equal(ids[n, j], tops[smp][0][t]) and np.array_equal(lps[n, j], tops[smp][1][t])
                checked += 1
        assert checked > 20


def test_distillation_trains_and_needs_top_k_in_the_cache(layer_caches, tiny_dense, tmp_path):
    superset, subset = layer_caches
    r = _train(tiny_dense, superset, tmp_path / "kd", "--kd-weight", "0.5")
    assert r.returncode == 0, r.stderr
    hard = _train(tiny_dense, superset, tmp_path / "hard")
    assert hard.returncode == 0, hard.stderr
    kd, ce = _losses(tmp_path / "kd"), _losses(tmp_path / "hard")
    assert all(np.isfinite(kd)) and kd != ce
    r = _train(tiny_dense, subset, tmp_path / "nok", "--kd-weight", "0.5")
    assert r.returncode == 2 and "holds no top-k log-probabilities" in r.stderr and "Traceback" not in r.stderr


def test_held_out_walk_keeps_the_best_drafter(layer_caches, tiny_dense, tmp_path):
    superset, subset = layer_caches
    out = tmp_path / "run"
    # The subset as the held-out cache of a run on the superset's layers 2 and 4: extracted from the
    # same input, so said in a warning (the training cache itself is refused).
    r = _train(tiny_dense, subset, tmp_path / "same", "--eval-cache", subset)
    assert r.returncode == 2 and "is the training cache" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = _train(tiny_dense, superset, out, "--target-layers", "2,4", "--eval-cache", subset, "--eval-every", "2",
               "--eval-samples", "8")
    assert r.returncode == 0, r.stderr
    assert "was extracted from the same input as --cache" in r.stderr
    lines = [json.loads(x) for x in (out / "heldout.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4]
    best = json.loads((out / "best.json").read_text())
    assert best["tau_pooled"] == max(x["tau_pooled"] for x in lines) and best["samples"] == 8
    assert [x["best"] for x in lines][0] is True
    from dflash_offline.drafter.export import load_exported

    assert load_exported(str(out / "best"), str(tiny_dense)).cfg.target_layer_ids == [2, 4]
    assert "best held-out drafter: step" in r.stdout
    # Finished: its processes are in phase done, not in the held-out evaluation they ended with.
    st = json.loads(run_cli(["status", out, "--json"]).stdout)
    assert st["processes"] and all(p["state"] == p["phase"] == "done" for p in st["processes"]), st["processes"]
    assert "phase held-out evaluation" not in run_cli(["status", out]).stdout
    # A held-out cache without the drafter's layers: refused before training, in one line.
    r = _train(tiny_dense, superset, tmp_path / "bad", "--eval-cache", subset)
    assert r.returncode == 2 and "--eval-cache" in r.stderr and "not [1, 3, 5]" in r.stderr
    assert "Traceback" not in r.stderr
