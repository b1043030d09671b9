"""`dflash-offline generate`: the target's own completions, checked against a brute-force greedy
decode (no cache, one prompt at a time), reproducible sampling, SIGKILL + resume equal to an
uninterrupted run, refusals of bad input, and the hand-off to `extract`."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import communicate_tree, run_cli, run_tree

MAX_NEW = 24


def make_prompts(path: Path, rows: int = 14, seed: int = 0, vocab: int = 512, id_offset: int = 100,
                 min_len: int = 2, max_len: int = 30) -> Path:
    """Prompts of varied lengths (so batches are left-padded), ids not equal to row numbers."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, vocab, size=int(n)).tolist() for n in rng.integers(min_len, max_len + 1, size=rows)]
    pq.write_table(pa.table({"id": pa.array(np.arange(id_offset, id_offset + rows), pa.int64()),
                             "input_ids": pa.array(prompts, pa.list_(pa.int32()))}), path)
    return path


def read_output(out: Path) -> dict[int, dict]:
    """{id: row} of a generate output (a folder of parts, or a merged .parquet file)."""
    if out.suffix == ".parquet":
        table = pq.read_table(out)
    else:
        m = json.loads((out / "manifest.json").read_text())
        table = pa.concat_tables([pq.read_table(out / p["file"]) for p in m["parts"]])
    rows = table.to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate rows"
    return {r["id"]: r for r in rows}


def brute_force_greedy(target: Path, prompts: list[list[int]], max_new: int, eos: set[int]) -> list[list[int]]:
    """The target's plain greedy decode, one prompt at a time, a full forward per token (no cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            seq = list(p)
            while len(seq) - len(p) < max_new:
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
                if seq[-1] in eos:
                    break
            out.append(seq[len(p):])
    return out


GEN = ["--max-new-tokens", MAX_NEW, "--no-progress"]


@pytest.mark.parametrize("kind,batching,step", [("dense", "continuous", "plain"), ("hybrid", "continuous", "fused"),
                                               ("dense", "padded", "fused")])
def test_greedy_equals_plain_decode_of_each_prompt(kind, batching, step, tiny_dense, tiny_hybrid, tmp_path):
    target = tiny_dense if kind == "dense" else tiny_hybrid
    # Fewer prompts for the hybrid: its reference decode runs the PyTorch Gated DeltaNet kernels.
    rows = 14 if kind == "dense" else 9
    prompts_path = make_prompts(tmp_path / "prompts.parquet", rows=rows)
    prompts = pq.read_table(prompts_path).column("input_ids").to_pylist()
    free = brute_force_greedy(target, prompts, MAX_NEW, set())
    # An end-of-sequence id that some completions reach midway: those rows must stop after it.
    eos = free[0][MAX_NEW // 3]
    expected = [f[: f.index(eos) + 1] if eos in f else f for f in free]
    assert any(len(e) < MAX_NEW for e in expected) and any(len(e) == MAX_NEW for e in expected)
    out = tmp_path / "gen"
    # 3 slots (continuous: refilled as prompts end) or batches of 3 rows of mixed lengths (padded:
    # left padding), 3 parts over two worker processes.
    r = run_cli(["generate", "--target", target, "--prompts", prompts_path, "--out", out, "--devices", "cpu,cpu",
                 "--batch-tokens", 3 * (30 + MAX_NEW), "--chunk-prompts", 6, "--eos-token-ids", eos,
                 "--batching", batching, "--step", step, *GEN])
    assert r.returncode == 0, r.stderr[-3000:]
    log_text = (out / "logs" / "generate-rank0.log").read_text()
    assert ("continuous batching: 3 slots" in log_text) == (batching == "continuous"), log_text[-2000:]
    assert (f"{step} step" in log_text) == (batching == "continuous"), log_text[-2000:]
    got = read_output(out)
    assert sorted(got) == list(range(100, 100 + rows))
    for k, (p, e) in enumerate(zip(prompts, expected)):
        row = got[100 + k]
        assert row["input_ids"] == p + e, f"prompt id {100 + k}"
        assert row["loss_mask"] == [0] * len(p) + [1] * len(e)
        assert row["finish_reason"] == ("eos" if e[-1] == eos else "length")
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "complete" and m["totals"]["rows"] == rows
    assert m["totals"]["ended_by_eos"] == sum(e[-1] == eos for e in expected)


def test_sampling_is_reproducible_per_prompt(tiny_dense, tmp_path):
    prompts_path = make_prompts(tmp_path / "prompts.parquet", rows=12)
    sample = ["--temperature", "1.0", "--top-p", "0.9", "--chunk-prompts", 6, "--ignore-eos", *GEN]
    outs = {}
    # The same seed in other batches and processes (two torchrun ranks); then another seed.
    for name, extra in (("a", ["--seed", 3, "--batch-tokens", 2 * 54]),
                        ("b", ["--seed", 3, "--batch-tokens", 5 * 54]),
                        ("c", ["--seed", 4, "--batch-tokens", 2 * 54])):
        args = ["generate", "--target", tiny_dense, "--prompts", prompts_path, "--out", tmp_path / name, *sample, *extra]
        if name == "b":
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            r = run_tree([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "dflash_offline", *map(str, args)], env=env, timeout=300)
            assert {"generate-rank0.log", "generate-rank1.log"} <= set(os.listdir(tmp_path / name / "logs"))
        else:
            r = run_cli(args)
        assert r.returncode == 0, r.stderr[-3000:]
        outs[name] = read_output(tmp_path / name)
    assert outs["a"] == outs["b"]
    differ = sum(outs["a"][i]["input_ids"] != outs["c"][i]["input_ids"] for i in outs["a"])
    assert differ >= 10, differ
    greedy = brute_force_greedy(tiny_dense, pq.read_table(prompts_path).column("input_ids").to_pylist(), MAX_NEW, set())
    assert sum(outs["a"][100 + k]["input_ids"][-MAX_NEW:] != g for k, g in enumerate(greedy)) >= 10


def test_noise_is_splitmix64_and_sampling_follows_the_distribution():
    import torch

    from dflash_offline.generate.decoding import choose_tokens, uniform_noise
    from dflash_offline.sampling import Sampling

    # The noise equals a plain unsigned 64-bit splitmix64 (numpy uint64 arithmetic wraps by definition).
    def mix(x):
        x = np.uint64(x)
        with np.errstate(over="ignore"):
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    g = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        for seed, row, step in ((0, 0, 0), (7, 123456789, 300), (2**40 + 3, 2**50, 9)):
            key = mix(np.uint64(seed) * g + np.uint64(1))
            key = mix(key + np.uint64(row) * g)
            key = mix(key + np.uint64(step + 1) * g)
            want = [(float(mix(key + np.uint64(v + 1) * g) >> np.uint64(12)) + 0.5) / 2**52 for v in range(5)]
            got = uniform_noise(seed, torch.tensor([row]), step, 5)[0].tolist()
            assert got == want
    # Sampled frequencies follow softmax(logits / T), renormalised over the top-p nucleus.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = 40000
    ids = torch.arange(rows)
    p = torch.softmax(logits / 0.7, -1)
    tok = choose_tokens(logits.expand(rows, -1), Sampling(0.7, 1.0, 5), ids, 3)
    freq = torch.bincount(tok, minlength=5).double() / rows
    assert torch.allclose(freq, p.double(), atol=0.01), (freq, p)
    tok = choose_tokens(logits.expand(rows, -1), Sampling(0.7, 0.8, 5), ids, 3)
    keep = int((torch.cumsum(p, 0) - p < 0.8).sum())  # the nucleus: the smallest prefix reaching 0.8
    freq = torch.bincount(tok, minlength=5).double() / rows
    assert freq[keep:].sum() == 0
    assert torch.allclose(freq[:keep], (p[:keep] / p[:keep].sum()).double(), atol=0.01)
    # The same (seed, id, step) draws the same token in any batch.
    one = choose_tokens(logits.expand(1, -1), Sampling(0.7, 0.8, 5), ids[1234:1235], 3)
    assert int(one) == int(tok[1234])


# Kill points (with the device list): mid-part (after a batch), a part file written but not
# renamed, renamed but not committed, a manifest replacement cut short (one process: the third
# manifest write is its second commit).
KILLS = [("generate-batch:3", "cpu"), ("part-written:2", "cpu,cpu"), ("part-renamed:1", "cpu"),
         ("manifest-tmp-written:3", "cpu")]


# The settings of the kill and stop tests: 16 prompts in 4 parts of 4, batches of 2 rows.
PARTS = ["--chunk-prompts", 4, "--batch-tokens", 2 * 54, *GEN]


@pytest.fixture(scope="module")
def straight_generate(tiny_dense, tmp_path_factory):
    """(prompts, {id: row}) of an uninterrupted one-process `generate` of 16 prompts with PARTS:
    what the killed and the stopped runs must equal after they resume (made once per module)."""
    root = tmp_path_factory.mktemp("straight-generate")
    prompts_path = make_prompts(root / "prompts.parquet", rows=16)
    r = run_cli(["generate", "--target", tiny_dense, "--prompts", prompts_path, *PARTS, "--out", root / "straight",
                 "--devices", "cpu"])
    assert r.returncode == 0, r.stderr[-3000:]
    return prompts_path, read_output(root / "straight")


def test_sigkill_then_rerun_equals_an_uninterrupted_run(tiny_dense, straight_generate, tmp_path):
    prompts_path, straight = straight_generate
    args = ["generate", "--target", tiny_dense, "--prompts", prompts_path, *PARTS]
    for k, (point, devices) in enumerate(KILLS):
        out = tmp_path / f"killed{k}"
        r = run_cli([*args, "--out", out, "--devices", devices], env={"DFLASH_OFFLINE_KILL_AT": point})
        assert r.returncode == -9, (point, r.returncode, r.stderr[-2000:])
        m = json.loads((out / "manifest.json").read_text())
        assert m["status"] == "generating" and len(m["parts"]) < 4, point
        r = run_cli([*args, "--out", out, "--devices", "cpu"])
        assert r.returncode == 0, (point, r.stderr[-3000:])
        assert read_output(out) == straight, point
        listed = {p["file"] for p in json.loads((out / "manifest.json").read_text())["parts"]}
        on_disk = {f for f in os.listdir(out) if f.startswith("part-")}
        assert on_disk == listed, (point, on_disk - listed)  # no debris left


def test_samples_per_prompt_equal_the_copies_written_out(tiny_dense, tmp_path):
    """N samples of each prompt are the rows a prompts file with the N copies written out (ids
    i x N + k) gives: the same noise per row id, parts cut across one prompt's copies."""
    prompts_path = make_prompts(tmp_path / "prompts.parquet", rows=5)
    table = pq.read_table(prompts_path)
    n = 3
    copies = tmp_path / "copies.parquet"
    pq.write_table(pa.table({"id": pa.array([i * n + k for i in table["id"].to_pylist() for k in range(n)], pa.int64()),
                             "input_ids": pa.array([p for p in table["input_ids"].to_pylist() for _ in range(n)],
                                                   pa.list_(pa.int32()))}), copies)
    sample = ["--target", tiny_dense, "--temperature", "1.0", "--seed", 2, "--ignore-eos", *GEN]
    r = run_cli(["generate", "--prompts", prompts_path, "--out", tmp_path / "a", "--samples-per-prompt", n,
                 "--chunk-prompts", 4, "--batch-tokens", 3 * 54, *sample])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "15 prompts = 3 samples of each of 5" in (tmp_path / "a" / "logs" / "generate-launcher.log").read_text()
    r = run_cli(["generate", "--prompts", copies, "--out", tmp_path / "b", *sample])
    assert r.returncode == 0, r.stderr[-3000:]
    got = read_output(tmp_path / "a")
    assert sorted(got) == [i * n + k for i in range(100, 105) for k in range(n)]
    assert got == read_output(tmp_path / "b")
    distinct = [len({tuple(got[i * n + k]["input_ids"]) for k in range(n)}) for i in range(100, 105)]
    assert sum(d == n for d in distinct) >= 4, distinct
    # Another N on the same output is another plan; greedy copies would be equal: both refused.
    for extra, words in ((["--samples-per-prompt", 2], "settings.samples_per_prompt"),
                         (["--samples-per-prompt", 2, "--temperature", 0], "needs sampling")):
        r = run_cli(["generate", "--prompts", prompts_path, "--out", tmp_path / "a", *sample, *extra])
        assert r.returncode == 2, r.stderr
        assert "\n" not in r.stderr.strip() and words in r.stderr, r.stderr


def test_rerun_refuses_other_settings_and_says_complete(tiny_dense, tiny_hybrid, tmp_path):
    prompts_path = make_prompts(tmp_path / "prompts.parquet", rows=6)
    out = tmp_path / "gen.parquet"
    args = ["generate", "--prompts", prompts_path, "--out", out, *GEN]
    r = run_cli([*args, "--target", tiny_dense])
    assert r.returncode == 0, r.stderr[-3000:]
    merged = out.read_bytes()
    assert len(read_output(out)) == 6
    r = run_cli([*args, "--target", tiny_dense])
    assert r.returncode == 0 and "already complete" in r.stdout
    for extra, field in ((["--target", tiny_hybrid], "target.model_type"),
                         (["--target", tiny_dense, "--max-new-tokens", 9], "settings.max_new_tokens"),
                         (["--target", tiny_dense, "--temperature", 0.5], "settings.temperature")):
        r = run_cli([*args, *extra])
        assert r.returncode == 2, (extra, r.stderr)
        line = r.stderr.strip()
        assert "\n" not in line and field in line and "new --out" in line, line
    assert out.read_bytes() == merged


def _bad_prompts(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / f"{kind}.parquet"
    if kind == "no-input-ids":
        pq.write_table(pa.table({"tokens": pa.array([[3, 4]], pa.list_(pa.int32()))}), p)
    elif kind == "outside-vocab":
        pq.write_table(pa.table({"input_ids": pa.array([[3, 4], [5, 512]], pa.list_(pa.int32()))}), p)
    elif kind == "empty":
        pq.write_table(pa.table({"input_ids": pa.array([[3, 4], []], pa.list_(pa.int32()))}), p)
    elif kind == "too-long":  # the tiny targets have 1024 positions
        pq.write_table(pa.table({"input_ids": pa.array([[3] * 1010], pa.list_(pa.int32()))}), p)
    return p


@pytest.mark.parametrize("kind,words", [("no-input-ids", "missing column 'input_ids'"),
                                        ("outside-vocab", "row 1: token id 512 is outside"),
                                        ("empty", "row 1: input_ids is empty"),
                                        ("too-long", "exceeds the target's context (1024")])
def test_bad_prompts_are_refused_in_one_line(kind, words, tiny_dense, tmp_path):
    out = tmp_path / "gen"
    r = run_cli(["generate", "--target", tiny_dense, "--prompts", _bad_prompts(tmp_path, kind), "--out", out, *GEN])
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and words in line, line
    assert not (out / "manifest.json").exists()
    if kind == "empty":
        # The refused run left nothing there (not even a log folder): a corrected run goes on.
        good = make_prompts(tmp_path / "good.parquet", rows=2)
        r = run_cli(["generate", "--target", tiny_dense, "--prompts", good, "--out", out, *GEN])
        assert r.returncode == 0, r.stderr[-2000:]


def test_outputs_it_did_not_create_are_refused(tiny_dense, tmp_path):
    prompts_path = make_prompts(tmp_path / "prompts.parquet", rows=4)
    args = ["generate", "--target", tiny_dense, "--prompts", prompts_path, *GEN]
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    existing = tmp_path / "existing.parquet"
    existing.write_bytes(b"not ours")
    for out, words in ((blocker / "gen", "cannot write there"), (theirs, "not empty"),
                       (existing, "was not written by `generate`")):
        r = run_cli([*args, "--out", out])
        assert r.returncode == 2, (out, r.stderr)
        assert "\n" not in r.stderr.strip() and words in r.stderr, r.stderr
    assert (theirs / "notes.txt").read_text() == "mine" and sorted(os.listdir(theirs)) == ["notes.txt"]
    assert existing.read_bytes() == b"not ours"


def test_extract_reads_a_complete_output_and_refuses_an_incomplete_one(tiny_dense, tmp_path):
    prompts_path = make_prompts(tmp_path / "prompts.parquet", rows=8)
    args = ["generate", "--target", tiny_dense, "--prompts", prompts_path, "--chunk-prompts", 4, *GEN]
    r = run_cli([*args, "--out", tmp_path / "partial"], env={"DFLASH_OFFLINE_KILL_AT": "part-committed:1"})
    assert r.returncode == -9
    ext = ["extract", "--target", tiny_dense, "--devices", "cpu", "--topk", "4", "--no-progress"]
    r = run_cli([*ext, "--data", tmp_path / "partial", "--cache", tmp_path / "c1"])
    assert r.returncode == 2 and "generation not complete (1/2 parts)" in r.stderr, r.stderr
    r = run_cli([*args, "--out", tmp_path / "partial"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli([*ext, "--data", tmp_path / "partial", "--cache", tmp_path / "c2"])
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "c2" / "manifest.json").read_text())
    rows = read_output(tmp_path / "partial")
    assert m["totals"]["samples"] == 8
    assert m["totals"]["tokens"] == sum(len(r["input_ids"]) for r in rows.values())


def test_a_stop_lands_within_a_step_and_the_rerun_completes_the_output(tiny_dense, straight_generate, tmp_path):
    """SIGTERM, then Ctrl-C (SIGINT to the group), while both workers hold mid-part: each stops within
    a decoding step (seconds, not the part's end), the parts committed before it kept and the finished
    rows of its part in progress too (each the row an uninterrupted run writes); the run exits with
    128 + the signal saying what it kept and how to resume, `status` says stopped; the same command
    then decodes only the rest and completes the output, equal to an uninterrupted run."""
    import signal
    import time

    from test_graceful_stop import held, start, wait_until

    prompts_path, straight = straight_generate
    args = ["generate", "--target", tiny_dense, "--prompts", prompts_path, *PARTS, "--devices", "cpu,cpu"]
    # Held at a worker's first finished prompt (the second ends in the same step, two more take the
    # slots: the stop lands mid-part, two rows kept), then at its third (the fourth ends with it: the
    # part is committed whole and the stop lands before the next part: nothing to keep).
    for sig, hold, keeps in ((signal.SIGTERM, "generate-batch:1", True), (signal.SIGINT, "generate-batch:3", False)):
        out = tmp_path / f"stopped-{sig.name}"
        proc = start([*args, "--out", out], {"DFLASH_OFFLINE_HOLD_AT": hold})
        wait_until(lambda: held(out / "logs", ["generate-rank0", "generate-rank1"]), proc)
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)
        _, err = communicate_tree(proc, timeout=120)
        took = time.monotonic() - t0
        assert proc.returncode == 128 + sig, err
        assert took < 10, took  # the workers' start-up is behind them: a step, then the exit
        m = json.loads((out / "manifest.json").read_text())
        committed, kept_parts = len(m["parts"]), m.get("held") or {}
        kept = sum(e["rows"] for e in kept_parts.values())
        assert committed < 4 and (kept >= 2 if keeps else kept == 0), m
        said = f", and {kept} finished rows of the parts in progress kept" if keeps else ""
        assert f"{committed}/4 parts committed, none half-written{said} (the prompts not finished are decoded on " \
            "resume); run the same command again to resume" in err, err
        for name, e in kept_parts.items():  # each kept row is the row the uninterrupted run wrote
            rows = pq.read_table(out / e["file"]).to_pylist()
            assert len(rows) == e["rows"] and e["file"].startswith(f"{name}.held-")
            assert all({k: r[k] for k in ("input_ids", "loss_mask")} ==
                       {k: straight[r["id"]][k] for k in ("input_ids", "loss_mask")} for r in rows)
        assert f"{sig.name} received: stopping at the next decoding step (seconds)" in \
            (out / "logs" / "generate-launcher.log").read_text()
        st = run_cli(["status", out, "--json"])
        report = json.loads(st.stdout)
        assert report["kind"] == "generate" and report["parts_committed"] == committed, report
        assert report["held_rows"] == kept and not report["debris"], report
        assert report["verdict"].startswith("stopped on request"), report["verdict"]
        one = [a if a != "cpu,cpu" else "cpu" for a in args]  # the rest in one process: the same rows
        r = run_cli([*one, "--out", out])
        assert r.returncode == 0, r.stderr[-3000:]
        assert read_output(out) == straight
        m = json.loads((out / "manifest.json").read_text())
        assert not m.get("held") and not list(out.glob("*.held-*")), m  # in the parts now, their files gone
        st = run_cli(["status", out])
        assert st.returncode == 0 and f"generated {out}: complete" in st.stdout and "4/4 parts" in st.stdout, st.stdout


def test_two_stops_keep_the_finished_rows_of_a_sampled_padded_part(tiny_dense, tmp_path):
    """Padded batches, sampled: a part of 6 prompts in 3 batches of 2. A stop in its second batch
    keeps the first batch's 2 rows; the rerun decodes only the other 4, and a stop in their second
    batch keeps 4 (a new held file listed in place of the first, which goes); the third run decodes
    the last 2. Every row equals an uninterrupted run's."""
    import signal

    from test_graceful_stop import held, start, wait_until

    prompts = make_prompts(tmp_path / "prompts.parquet", rows=12)
    args = ["generate", "--target", tiny_dense, "--prompts", prompts, "--chunk-prompts", 6, "--batch-tokens", 2 * 54,
            "--batching", "padded", "--temperature", 1, "--seed", 3, *GEN, "--devices", "cpu"]
    r = run_cli([*args, "--out", tmp_path / "straight"])
    assert r.returncode == 0, r.stderr[-3000:]
    straight = read_output(tmp_path / "straight")
    out = tmp_path / "stopped"
    for want in (2, 4):
        proc = start([*args, "--out", out], {"DFLASH_OFFLINE_HOLD_AT": "generate-batch:1"})
        wait_until(lambda: held(out / "logs", ["generate-launcher"]), proc)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = communicate_tree(proc, timeout=120)
        assert proc.returncode == 128 + signal.SIGINT, err
        m = json.loads((out / "manifest.json").read_text())
        assert not m["parts"] and list(m["held"]) == ["part-00000"] and m["held"]["part-00000"]["rows"] == want, m
        assert sorted(f.name for f in out.glob("*.held-*")) == [f"part-00000.held-{want}.parquet"]
        assert f"0/2 parts committed, none half-written, and {want} finished rows of the parts in progress kept" in err
        rows = pq.read_table(out / m["held"]["part-00000"]["file"]).to_pylist()
        assert all(r["input_ids"] == straight[r["id"]]["input_ids"] for r in rows)
    r = run_cli([*args, "--out", out])
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_output(out) == straight
    assert "part-00000: 2 prompts to decode, 4 kept by a stop" in (out / "logs" / "generate-launcher.log").read_text()


_BAR = re.compile(r"(\d+)%\|[^|\r\n]*\| *([\d.]+k?)/([\d.]+k?) \[[\d:]+<([\d:?]+), *[^,\]]*, (\d+)/(\d+) prompts\]")


def test_the_bar_counts_new_tokens_within_one_batch(tiny_dense, tmp_path):
    """One batch of every prompt, decoding for seconds: the bar counts new tokens as they are
    decoded against rows x --max-new-tokens, with an ETA, before any prompt completes; rows that
    end early (end-of-sequence) take their unused tokens off the total, which ends at the tokens made."""
    from tqdm import tqdm

    prompts = make_prompts(tmp_path / "prompts.parquet", rows=4, max_len=10)
    args = ["generate", "--target", tiny_dense, "--prompts", prompts, "--batch-tokens", 4096]
    r = run_cli([*args, "--out", tmp_path / "long", "--max-new-tokens", 600, "--ignore-eos"])
    assert r.returncode == 0, r.stderr[-3000:]
    states = _BAR.findall(r.stderr)
    within = [s for s in states if s[4] == "0" and 0 < int(s[0]) < 100 and s[3] != "?"]
    assert within and all(s[2] == "2.40k" for s in within), r.stderr[-3000:]  # 4 rows x 600, an ETA shown
    assert states[-1][:3] == ("100", "2.40k", "2.40k") and states[-1][4:] == ("4", "4"), states[-1]
    assert "continuous batching: 4 slots" in (tmp_path / "long" / "logs" / "generate-launcher.log").read_text()
    # An end-of-sequence token that row 0 (and maybe others) writes early: the total shrinks to the tokens made
    first = read_output(tmp_path / "long")[100]
    eos = first["input_ids"][first["loss_mask"].index(1) + 30]
    r = run_cli([*args, "--out", tmp_path / "eos", "--max-new-tokens", 200, "--eos-token-ids", eos])
    assert r.returncode == 0, r.stderr[-3000:]
    made = json.loads((tmp_path / "eos" / "manifest.json").read_text())["totals"]["new_tokens"]
    assert made < 4 * 200
    last = _BAR.findall(r.stderr)[-1]
    assert last[:3] == ("100", tqdm.format_sizeof(made), tqdm.format_sizeof(made)) and last[4] == "4", (last, made)


def test_parts_on_the_cpu_hold_64_prompts_and_a_resumed_output_keeps_its_own(tiny_dense, tmp_path):
    """On the CPU a part (the unit of commit) holds 64 prompts unless told: committed progressively;
    an output made with another part size is resumed with it, without naming it again."""
    prompts = make_prompts(tmp_path / "prompts.parquet", rows=70, max_len=8)
    args = ["generate", "--target", tiny_dense, "--prompts", prompts, "--max-new-tokens", 2, "--no-progress"]
    r = run_cli([*args, "--out", tmp_path / "a"])
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["plan"]["chunk_prompts"] == 64 and [p["rows"] for p in m["parts"]] == [64, 6]
    r = run_cli([*args, "--out", tmp_path / "b", "--chunk-prompts", 30])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli([*args, "--out", tmp_path / "b"])
    assert r.returncode == 0 and "already complete" in r.stdout, r.stderr[-3000:]
    assert read_output(tmp_path / "a") == read_output(tmp_path / "b")


def test_the_default_new_tokens_fit_the_targets_context(tiny_dense, tmp_path):
    """--max-new-tokens left out: 2048, or the target's context less the longest prompt (the tiny
    target has 1024 positions: prompts of up to 1010 tokens leave 14), said in the log."""
    prompts = make_prompts(tmp_path / "p.parquet", rows=2, min_len=1000, max_len=1010)
    longest = max(len(r) for r in pq.read_table(prompts)["input_ids"].to_pylist())
    r = run_cli(["generate", "--target", tiny_dense, "--prompts", prompts, "--out", tmp_path / "out", "--ignore-eos",
                 "--no-progress"])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = read_output(tmp_path / "out")
    assert [sum(row["loss_mask"]) for row in rows.values()] == [1024 - longest] * 2  # every row its 14 new tokens
    assert f"--max-new-tokens {1024 - longest}: the target's 1024 positions less the longest prompt ({longest} tokens)" in \
        (tmp_path / "out" / "logs" / "generate-launcher.log").read_text() + r.stderr


def test_the_default_new_tokens_are_shared_by_a_conversations_replies():
    """For conversations of up to R replies the default is the context's room after the longest
    first prompt divided by R (in steps of 64): every reply may run to it and the last turn still
    fits. A given value, or a target without a context limit, is left as it is."""
    from types import SimpleNamespace

    from dflash_offline.config import GenerateConfig
    from dflash_offline.generate.plan import resolve_new_tokens

    cfg, lengths = GenerateConfig(target="t", prompts=["p"], out="o"), np.array([20, 40])
    ctx = SimpleNamespace(max_positions=1024)
    assert resolve_new_tokens(cfg, lengths, ctx).max_new_tokens == 984
    assert resolve_new_tokens(cfg, lengths, ctx, most_turns=2).max_new_tokens == 448  # 492 -> 448
    assert resolve_new_tokens(cfg, lengths, ctx, most_turns=30).max_new_tokens == 32  # under 64: as divided
    assert resolve_new_tokens(cfg, lengths, SimpleNamespace(max_positions=None), most_turns=3).max_new_tokens == 2048
    given = GenerateConfig(target="t", prompts=["p"], out="o", max_new_tokens=900)
    assert resolve_new_tokens(given, lengths, ctx, most_turns=2).max_new_tokens == 900
