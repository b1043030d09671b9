"""Samples longer than --seq-len: split into pieces that train every trained token once per epoch
(the default), or cut to their first --seq-len tokens with one warning that counts what is lost
(--long-samples truncate); resume stays exact, --follow splits them too, and a checkpoint of an
earlier version (which cut them) is not resumed under the other rule."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import run_cli

S = 64  # --seq-len: most of the samples below are longer
OPTS = ["--seq-len", str(S), "--num-anchors", "16", "--block-size", "8", "--global-batch-tokens", str(S),
        "--lr", "3e-3", "--mask-token-id", "1", "--drafter-layers", "1", "--loader-workers", "0", "--no-progress"]


def _rows(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, loss_mask) of samples shaped like chat data: short ones that fit, long prompts
    whose first S tokens train nothing (what made `loss 0.0` steps), multi-turn ones with trained
    spans far apart, fully trained long ones, and long ones with no trained token at all."""
    def arith(n: int) -> np.ndarray:
        return ((int(rng.integers(0, 32)) + int(rng.integers(1, 3)) * np.arange(n)) % 32 + 2).astype(np.int32)

    out = []
    for _ in range(14):  # fit a row
        n = int(rng.integers(16, S + 1))
        p = int(rng.integers(1, n // 2))
        out.append((arith(n), np.r_[np.zeros(p), np.ones(n - p)]))
    for _ in range(8):  # a prompt longer than a row, then the completion
        n, p = int(rng.integers(150, 230)), int(rng.integers(S + 10, 140))
        out.append((arith(n), np.r_[np.zeros(p), np.ones(n - p)]))
    for _ in range(6):  # turns: trained spans with untrained gaps longer than a row between them
        n = int(rng.integers(200, 260))
        m = np.zeros(n)
        m[20:50] = 1
        m[130:150] = 1
        m[n - 25:] = 1
        out.append((arith(n), m))
    for _ in range(4):  # trained nearly throughout
        n = int(rng.integers(130, 200))
        out.append((arith(n), np.r_[np.zeros(3), np.ones(n - 3)]))
    for _ in range(2):  # nothing to train on
        n = int(rng.integers(90, 140))
        out.append((arith(n), np.zeros(n)))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


@pytest.fixture(scope="module")
def long_cache(tiny_dense, tmp_path_factory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("long")
    rows = _rows(np.random.default_rng(11))
    pq.write_table(pa.table({
        "input_ids": pa.array([r[0].tolist() for r in rows], type=pa.list_(pa.int32())),
        "loss_mask": pa.array([r[1].astype(np.int8).tolist() for r in rows], type=pa.list_(pa.int8())),
        "id": pa.array(np.arange(len(rows)), type=pa.int64())}), root / "long.parquet")
    cache = root / "cache"
    r = run_cli(["extract", "--target", tiny_dense, "--data", root / "long.parquet", "--cache", cache, "--topk", "0",
                 "--max-len", "512", "--batch-tokens", "1024", "--shard-tokens", "1500", "--no-progress"])
    assert r.returncode == 0, r.stderr
    return cache


def _samples(cache: Path) -> dict[int, np.ndarray]:
    """sample id -> loss mask, read straight from the cache (the brute-force reference's input)."""
    from dflash_offline.cache.reader import CacheReader

    return {s.sample_id: np.asarray(s.loss_mask) for s in CacheReader(str(cache)).samples()}


def _train(tiny_dense, cache, out, *extra, env=None):
    return run_cli(["train", "--target", tiny_dense, "--cache", cache, "--out", out, *OPTS, *extra], env=env,
                   timeout=600)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.lower().startswith("warning:")]


def test_split_samples_train_every_trained_token_once(long_cache, tiny_dense, tmp_path):
    masks = _samples(long_cache)
    trained = sum(int(m.sum()) for m in masks.values())
    long = {i: m for i, m in masks.items() if m.shape[0] > S}
    assert len(long) >= 20 and trained > 0
    out = tmp_path / "run"
    r = _train(tiny_dense, long_cache, out, "--epochs", "1")
    assert r.returncode == 0, r.stderr
    said = _warnings(r.stderr)
    assert len(said) == 1, r.stderr
    longest = max(m.shape[0] for m in masks.values())
    assert f"{len(long)} of {len(masks)} samples are longer than --seq-len {S} (up to {longest} tokens): split into" in said[0]
    assert f"all {sum(int(m.sum()) for m in long.values()):,} of their trained tokens are trained" in said[0]
    assert "2 of them hold no trained token and are left out" in said[0]
    assert f"--seq-len {longest} keeps every sample whole" in said[0]
    # One row a step (global batch = one row, one rank) and one epoch: no row is left over, so
    # the steps' trained tokens add up to every trained token of the cache, and none trains nothing.
    m = _metrics(out)
    assert all(x["trained_tokens"] > 0 for x in m), [x["trained_tokens"] for x in m]
    assert sum(x["trained_tokens"] for x in m) == trained
    log = (out / "logs" / "train-launcher.log").read_text()
    assert said[0][len("warning: "):] in log


def test_every_epoch_holds_each_trained_token_once_and_rows_read_the_pieces(long_cache, tiny_dense, tmp_path):
    """The plan preflight hands the ranks, epoch by epoch, against a brute force over the cache's
    loss masks: each trained token (sample, position) in exactly one row; each piece is at most a
    row and holds a trained token; and the loader's rows carry the pieces' own hidden states,
    tokens and positions (read from the piece's start)."""
    import torch

    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.train.config import TrainConfig
    from dflash_offline.blocks.packing import epoch_order
    from dflash_offline.blocks.pieces import pack_pieces
    from dflash_offline.train.preflight import preflight
    from dflash_offline.blocks.stream import RowSpec, RowStream, Span

    masks = _samples(long_cache)
    want = Counter((i, int(p)) for i, m in masks.items() for p in np.flatnonzero(m))
    cfg = TrainConfig(cache=str(long_cache), target=str(tiny_dense), out=str(tmp_path / "run"), seq_len=S,
                      num_anchors=16, block_size=8, global_batch_tokens=S, mask_token_id=1, drafter_layers=1, epochs=3)
    plan = preflight(cfg)
    ep = plan.epochs
    ids = [int(i) for name in CacheReader(str(long_cache)).shard_names
           for i in CacheReader(str(long_cache)).shard(name).ids]
    for e in range(3):
        rows = pack_pieces(ep.pieces, epoch_order(len(ep.refs), cfg.seed, e), S)
        got = Counter()
        for row in rows:
            assert sum(p.length for p in row) <= S
            for p in row:
                m = masks[ids[p.sample]][p.start:p.start + p.length]
                assert p.length == m.shape[0] and (m.any() or masks[ids[p.sample]].shape[0] <= S)
                got.update((ids[p.sample], p.start + int(q)) for q in np.flatnonzero(m))
        assert got == want, f"epoch {e}: missing {list((want - got).items())[:5]}, extra {list((got - want).items())[:5]}"
    assert ep.steps_per_epoch * 3 == plan.total_steps
    # The loader: each row's context is its pieces' tokens, hidden states and positions.
    reader = CacheReader(str(long_cache))
    by_id = {s.sample_id: s for s in reader.samples()}
    spec = RowSpec(seed=cfg.seed, seq_len=S, num_anchors=16, block_size=8, mask_token_id=1, gamma=4.0,
                   hidden_size=plan.hidden_size, row_layers=plan.target_layer_count)
    stream = RowStream(str(long_cache), ep.refs, ep.lengths, spec, Span(0, 0, ep.steps_per_epoch), 0, 1, 1,
                       pieces=ep.pieces)
    rows = stream.rows(0)
    split_seen = 0
    for g, mb in enumerate(stream):
        at = 0
        for d, p in enumerate(rows[g]):
            smp = by_id[ids[p.sample]]
            sl = slice(at, at + p.length)
            want_h = np.asarray(smp.hidden_bits[p.start:p.start + p.length]).reshape(p.length, -1)
            assert np.array_equal(mb.target_hidden[0, sl].view(torch.int16).numpy().view(np.uint16), want_h), (g, d)
            assert mb.ctx_positions[0, sl].tolist() == list(range(p.start, p.start + p.length))
            assert (mb.doc_ids[0, sl] == d).all()
            split_seen += p.start > 0
            at += p.length
        assert int(mb.trained) == sum(int(masks[ids[p.sample]][p.start:p.start + p.length].sum()) for p in rows[g])
    assert split_seen > 5


def test_resume_after_sigkill_with_split_samples_equals_straight_run(long_cache, tiny_dense, tmp_path):
    run = ["--epochs", "2", "--max-steps", "14"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = _train(tiny_dense, long_cache, straight, *run, "--checkpoint-every", "100")
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "DFLASH_OFFLINE_KILL_AT": "checkpoint-saved:1"}
    r = _train(tiny_dense, long_cache, resumed, *run, "--checkpoint-every", "7", env=env)
    assert r.returncode == -signal.SIGKILL, r.stderr
    r = _train(tiny_dense, long_cache, resumed, *run, "--checkpoint-every", "7")
    assert r.returncode == 0, r.stderr
    a, b = _metrics(straight), _metrics(resumed)
    assert [x["step"] for x in b] == list(range(1, 15))
    assert [(x["loss"], x["trained_tokens"]) for x in a] == [(x["loss"], x["trained_tokens"]) for x in b]
    wa, wb = (load_file(str(o / "step-14" / "drafter.safetensors")) for o in (straight, resumed))
    assert wa.keys() == wb.keys()
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


def test_truncate_warns_with_what_is_lost_and_the_rule_is_part_of_a_resume(long_cache, tiny_dense, tmp_path):
    masks = _samples(long_cache)
    trained = sum(int(m.sum()) for m in masks.values())
    long = [m for m in masks.values() if m.shape[0] > S]
    lost = sum(int(m.sum()) - int(m[:S].sum()) for m in long)
    keep_none = sum(not m[:S].any() for m in long)
    out = tmp_path / "cut"
    r = _train(tiny_dense, long_cache, out, "--long-samples", "truncate", "--epochs", "1", "--max-steps", "2")
    assert r.returncode == 0, r.stderr
    said = _warnings(r.stderr)
    assert len(said) == 1, r.stderr
    assert (f"and keep their first {S} tokens (--long-samples truncate): {lost:,} of the {trained:,} trained tokens "
            f"({100 * lost / trained:.1f}%) are not trained; {keep_none} of them keep no trained token and train "
            "nothing; --long-samples split trains them all") in said[0], said[0]
    # The rule decides every row: a checkpoint resumes only under its own rule.
    r = _train(tiny_dense, long_cache, out, "--epochs", "1", "--max-steps", "3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert 'long_samples = "truncate", this run has "split"' in r.stderr
    # A checkpoint of a version before the option cut long samples: resumed under truncate only.
    state = out / "step-2" / "state.json"
    saved = json.loads(state.read_text())
    del saved["config"]["long_samples"]
    state.write_text(json.dumps(saved))
    r = _train(tiny_dense, long_cache, out, "--epochs", "1", "--max-steps", "3")
    assert r.returncode == 2 and 'long_samples = "truncate"' in r.stderr, r.stderr
    r = _train(tiny_dense, long_cache, out, "--long-samples", "truncate", "--epochs", "1", "--max-steps", "3")
    assert r.returncode == 0, r.stderr
    assert [x["step"] for x in _metrics(out)] == [1, 2, 3]


def test_rule_is_moot_when_every_sample_fits(long_cache, tiny_dense, tmp_path):
    """At a --seq-len that holds every sample, split and truncate make the same rows: no warning, and
    a checkpoint saved under one rule (or before the option) resumes under the other."""
    longest = max(m.shape[0] for m in _samples(long_cache).values())
    out = tmp_path / "fit"
    opts = ["--seq-len", str(longest), "--global-batch-tokens", str(longest), "--epochs", "1"]
    r = _train(tiny_dense, long_cache, out, *opts, "--max-steps", "1", "--long-samples", "truncate")
    assert r.returncode == 0 and not _warnings(r.stderr), r.stderr
    state = out / "step-1" / "state.json"
    saved = json.loads(state.read_text())
    del saved["config"]["long_samples"]
    state.write_text(json.dumps(saved))
    r = _train(tiny_dense, long_cache, out, *opts, "--max-steps", "2")
    assert r.returncode == 0 and not _warnings(r.stderr), r.stderr


def test_follow_splits_long_samples_in_each_window(long_cache, tiny_dense, tmp_path):
    """--follow packs each window's pieces: every trained token trained once, each sample recorded
    once in consumed.jsonl, and the terminal told once."""
    masks = _samples(long_cache)
    cache = tmp_path / "cache"
    shutil.copytree(long_cache, cache)  # a follower records itself in the manifest
    out = tmp_path / "follow"
    r = _train(tiny_dense, cache, out, "--epochs", "1", "--follow", "--follow-window", "2")
    assert r.returncode == 0, r.stderr
    said = _warnings(r.stderr)
    assert len(said) == 1 and said[0].lower().startswith("warning: window 0: ") and "split into" in said[0], r.stderr
    m = _metrics(out)
    assert all(x["trained_tokens"] > 0 for x in m)
    assert sum(x["trained_tokens"] for x in m) == sum(int(v.sum()) for v in masks.values())
    recorded = [i for line in (out / "consumed.jsonl").read_text().splitlines() for i in json.loads(line)["sample_ids"]]
    assert len(recorded) == len(set(recorded))
    assert set(recorded) == {i for i, v in masks.items() if v.shape[0] <= S or v.any()}


def _earlier_pack_rows(lengths, order, seq_len):
    """The packing of versions before pieces, literally: the rows a checkpoint of theirs resumes into."""
    rows, cur, used = [], [], 0
    for s in order.tolist():
        t = min(int(lengths[s]), seq_len)
        if used + t > seq_len:
            rows.append(cur)
            cur, used = [], 0
        cur.append((s, t))
        used += t
    if cur:
        rows.append(cur)
    return rows


def test_rows_of_samples_that_fit_and_of_truncate_are_the_earlier_rows():
    from dflash_offline.blocks.packing import epoch_order
    from dflash_offline.blocks.pieces import Pieces, pack_pieces

    rng = np.random.default_rng(5)
    for seq_len, top in ((64, 64), (64, 300), (256, 90)):  # all fit; some longer (truncate); all fit
        lengths = rng.integers(1, top + 1, size=300)
        for e in range(3):
            order = epoch_order(len(lengths), 7, e)
            got = [[(p.sample, p.length) for p in row] for row in pack_pieces(Pieces.make(lengths, seq_len), order, seq_len)]
            assert got == _earlier_pack_rows(lengths, order, seq_len)
            assert all(p.start == 0 for row in pack_pieces(Pieces.make(lengths, seq_len), order, seq_len) for p in row)


def _fewest_covering(points: np.ndarray, width: int) -> int:
    """Brute force: the fewest windows of `width` consecutive positions that hold all `points`
    (greedy from the first point, the textbook optimum for points on a line)."""
    n, end = 0, -1
    for q in points.tolist():
        if q > end:
            n, end = n + 1, q + width - 1
    return n


def test_split_trained_holds_each_trained_token_once_in_fewest_pieces():
    from dflash_offline.blocks.pieces import split_trained

    rng = np.random.default_rng(9)
    for _ in range(400):
        n, S = int(rng.integers(2, 400)), int(rng.integers(2, 80))
        m = np.zeros(n, np.uint8)
        for _ in range(int(rng.integers(0, 6))):  # a few trained spans of any length
            a = int(rng.integers(0, n))
            m[a:a + int(rng.integers(1, 120))] = 1
        parts = split_trained(m, S)
        trained = np.flatnonzero(m)
        held = [a + int(q) for a, k in parts for q in np.flatnonzero(m[a:a + k])]
        assert held == trained.tolist()  # each trained token once, in token order
        assert all(1 <= k <= S and m[a + k - 1] for a, k in parts)  # a row at most; ends on a trained token
        assert all(a + k <= b for (a, k), (b, _) in zip(parts, parts[1:]))
        assert len(parts) == _fewest_covering(trained, S)
        # Each piece reaches back as far as a row allows: to the sample's start or S tokens.
        assert all(k == S or a == 0 for a, k in parts)
