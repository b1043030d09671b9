"""The bounded cache: `extract --max-bytes --passes` filling it while `train --follow --stream`
drains it, both killed with SIGKILL at random moments and restarted.

At the end: the multiset of samples the trainer trained on (its consumed.jsonl) equals the source
ids x passes, the shard bytes on storage never exceeded the budget (sampled every 20 ms), and no
shard is left on storage. A second, quick test: the budget refusals and the order of passes.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq

from conftest import ROOT, SCHEMA_PATH, kill_tree, run_cli

PASSES = 2
EXTRACT = ["--devices", "cpu", "--topk", "0", "--max-len", "128", "--batch-tokens", "512", "--shard-tokens", "1024",
           "--no-progress", "--passes", str(PASSES)]
TRAIN = ["--seq-len", "128", "--num-anchors", "8", "--block-size", "4", "--global-batch-tokens", "256",
         "--mask-token-id", "1", "--drafter-layers", "1", "--epochs", "1", "--follow", "--stream", "--follow-window", "2",
         "--loader-workers", "0", "--checkpoint-every", "4", "--keep-checkpoints", "1", "--no-progress"]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    f = open(log, "a")
    # Its own process group: SIGKILL goes to the whole tree (workers, writer processes).
    return subprocess.Popen([sys.executable, "-m", "dflash_offline", *args], stdout=f, stderr=subprocess.STDOUT,
                            cwd=ROOT, env=env, start_new_session=True)


def _shard_bytes(shards: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(shards):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:  # deleted while we walk
                pass
    return total


def test_follow_stream_with_sigkills_loses_nothing_and_stays_in_budget(tiny_dense, tiny_data, tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run"
    budget = 2_400_000  # about 4 of this cache's ~0.6 MB shards; the whole cache (2 passes) is about 4.8 MB
    ext = ["extract", "--target", str(tiny_dense), "--data", str(tiny_data), "--cache", str(cache), *EXTRACT,
           "--max-bytes", str(budget)]
    tr = ["train", "--target", str(tiny_dense), "--cache", str(cache), "--out", str(out), *TRAIN]
    rng = random.Random(7)
    kills = {"extract": [rng.uniform(2.0, 7.0) for _ in range(3)], "train": [rng.uniform(2.0, 9.0) for _ in range(3)]}
    print("kill after (s from each start):", {k: [round(x, 1) for x in v] for k, v in kills.items()})
    logs = {"extract": tmp_path / "extract.out", "train": tmp_path / "train.out"}
    args = {"extract": ext, "train": tr}

    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # I/O only: how much shard data is on storage right now
        while not stop.is_set():
            if (cache / "shards").is_dir():
                peak[0] = max(peak[0], _shard_bytes(cache / "shards"))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    procs = {name: _start(a, logs[name]) for name, a in args.items()}
    started = {name: time.time() for name in procs}
    done, killed = set(), collections.Counter()
    t_end = time.time() + 420
    try:
        while len(done) < 2:
            if time.time() > t_end:
                raise AssertionError(f"not finished in time; killed {dict(killed)}; logs in {tmp_path}")
            for name, p in procs.items():
                if name in done:
                    continue
                rc = p.poll()
                if rc is not None:
                    if rc != 0:
                        tail = "".join(logs[name].read_text().splitlines(keepends=True)[-30:])
                        raise AssertionError(f"{name} failed with exit code {rc}:\n{tail}")
                    done.add(name)
                elif kills[name] and time.time() - started[name] > kills[name][0]:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    kills[name].pop(0)
                    killed[name] += 1
                    procs[name] = _start(args[name], logs[name])
                    started[name] = time.time()
            time.sleep(0.05)
    finally:
        stop.set()
        watcher.join()
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    print(f"killed {dict(killed)}; peak shard bytes on storage {peak[0]} of budget {budget}")
    assert killed == {"extract": 3, "train": 3}, killed  # each side was killed while it still ran

    m = json.loads((cache / "manifest.json").read_text())
    jsonschema.validate(m, json.loads(SCHEMA_PATH.read_text()))  # released, consumers, passes included
    assert m["status"] == "complete" and m["shards"] == [] and not m.get("reserved")
    assert len(m["released"]) == m["plan"]["num_shards"]
    consumer = m["consumers"][str(out.resolve())]
    assert consumer["finished"] == sorted(s["name"] for s in m["released"])
    # Nothing left behind: every shard consumed and deleted, no half-written debris.
    assert sorted(os.listdir(cache / "shards")) == []
    assert peak[0] <= budget, (peak[0], budget)

    # The multiset of trained samples = the source ids, once per pass; each window once.
    records = [json.loads(line) for line in (out / "consumed.jsonl").read_text().splitlines() if line.strip()]
    windows = [r["window"] for r in records]
    assert windows == list(range(len(windows))), windows
    trained = collections.Counter(i for r in records for i in r["sample_ids"])
    rows = pq.read_table(tiny_data).num_rows
    source = pq.read_table(tiny_data).column("id").to_pylist() if "id" in pq.read_table(tiny_data).column_names \
        else list(range(rows))
    assert trained == collections.Counter(source * PASSES)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in metrics] == list(range(1, len(metrics) + 1))
    assert sum(r["steps"] for r in records) == len(metrics)
    assert (out / "export").is_dir()

    # The cache no longer holds its samples: a plain trainer, or a second streaming one, is refused.
    base = ["train", "--target", str(tiny_dense), "--cache", str(cache), *TRAIN]
    r = run_cli([a for a in base if a not in ("--follow", "--stream")] + ["--out", str(tmp_path / "plain")])
    assert r.returncode != 0 and "consumed and deleted by a streaming trainer" in r.stderr, r.stderr
    r = run_cli([*base, "--out", str(tmp_path / "second")])
    assert r.returncode != 0 and "already consumed and deleted by another trainer" in r.stderr, r.stderr


def test_budget_refusal_and_pass_orders(tiny_dense, tiny_data, tmp_path):
    # A budget that cannot hold one shard is refused before any work, naming the shard.
    r = run_cli(["extract", "--target", str(tiny_dense), "--data", str(tiny_data), "--cache", str(tmp_path / "c"),
                 *EXTRACT, "--max-bytes", "10kB"])
    assert r.returncode != 0
    assert "--max-bytes 10.00 kB cannot hold one shard" in r.stderr and "shard-000000" in r.stderr, r.stderr
    assert not (tmp_path / "c" / "manifest.json").exists()
    # --stream without --follow, and --follow with several epochs, are refused in one line.
    base = ["train", "--target", str(tiny_dense), "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "o")]
    r = run_cli([*base, "--stream"])
    assert r.returncode != 0 and "--stream needs --follow" in r.stderr
    r = run_cli([*base, "--follow", "--epochs", "3"])
    assert r.returncode != 0 and "--epochs must be 1" in r.stderr and "--passes" in r.stderr

    from dflash_offline.extract.plan import make_plan

    lengths = pq.read_table(tiny_data).column("input_ids").combine_chunks().value_lengths().to_numpy()
    # Windows of 16 rows: each pass's permutation puts other rows together (one window over all the
    # rows would sort every pass the same way, longest first).
    one = make_plan(lengths, 128, 1024, 16, 1)
    two = make_plan(lengths, 128, 1024, 16, 2)
    first = [r for s in two[:len(one)] for r in s.tolist()]
    assert first == [r for s in one for r in s.tolist()]  # pass 0 is the one-pass plan
    rest = [r for s in two[len(one):] for r in s.tolist()]
    assert sorted(rest) == list(range(len(lengths))) and rest != first  # every row once more, another order


def test_follow_resume_after_sigkill_equals_straight_run(tiny_dense, valid_cache, tmp_path):
    """A follow run killed right after its second checkpoint (mid-window) and resumed gives the
    losses, learning rates (the schedule follows the plan's tokens) and final weights of a run
    that was never killed."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file

    cache = tmp_path / "cache"
    shutil.copytree(valid_cache, cache)  # a follower records itself in the manifest
    opts = ["--seq-len", "128", "--num-anchors", "8", "--block-size", "4", "--global-batch-tokens", "256",
            "--mask-token-id", "1", "--drafter-layers", "1", "--epochs", "1", "--follow", "--follow-window", "2",
            "--loader-workers", "0", "--checkpoint-every", "3", "--no-progress"]
    base = ["train", "--target", str(tiny_dense), "--cache", str(cache), *opts]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = run_cli([*base, "--out", str(straight)])
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "DFLASH_OFFLINE_KILL_AT": "checkpoint-saved:2"}
    r = run_cli([*base, "--out", str(resumed)], env=env)
    assert r.returncode == -signal.SIGKILL, r.stderr
    r = run_cli([*base, "--out", str(resumed)])
    assert r.returncode == 0, r.stderr

    def records(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]

    a, b = records(straight), records(resumed)
    assert len(a) > 6 and [x["step"] for x in b] == list(range(1, len(a) + 1))
    assert [(x["loss"], x["lr"]) for x in a] == [(x["loss"], x["lr"]) for x in b]
    assert a[-1]["lr"] < 0.1 * max(x["lr"] for x in a)  # the schedule ran to its end
    last = max(int(p.name[5:]) for p in straight.glob("step-*"))
    wa, wb = (load_file(str(o / f"step-{last}" / "drafter.safetensors")) for o in (straight, resumed))
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)
    assert (straight / "consumed.jsonl").read_text() == (resumed / "consumed.jsonl").read_text()


def test_follow_says_on_the_terminal_when_extraction_is_gone(tiny_dense, tiny_data, tmp_path):
    """A follower waiting for shards that no live extract process will write says so on the
    terminal (the periodic waiting lines go to the log only), instead of waiting in silence."""
    cache, out = tmp_path / "cache", tmp_path / "run"
    ext = ["extract", "--target", str(tiny_dense), "--data", str(tiny_data), "--cache", str(cache),
           *EXTRACT[:EXTRACT.index("--passes")]]
    r = run_cli(ext, env={**os.environ, "DFLASH_OFFLINE_KILL_AT": "shard-committed:2"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    m = json.loads((cache / "manifest.json").read_text())
    assert m["status"] != "complete" and len(m["shards"]) < m["plan"]["num_shards"]
    opts = [x for x in TRAIN if x not in ("--stream",)]
    opts[opts.index("--follow-window") + 1] = "1"
    log = tmp_path / "train.txt"
    p = _start(["train", "--target", str(tiny_dense), "--cache", str(cache), "--out", str(out), *opts], log)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and "no extract process of" not in log.read_text() and p.poll() is None:
            time.sleep(0.5)
        text = log.read_text()
        assert "no extract process of" in text and "run the extract command again (it resumes)" in text, text[-3000:]
        assert "died" in text
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            raise


def test_a_follow_checkpoint_place_is_typed_and_reads_back_as_written():
    """state.json's "follow" is a FollowPosition in the code and the same JSON object on disk as
    before it was typed; a later version's extra key is ignored, an epochs place has no follow."""
    from dflash_offline.runs.checkpoint import CheckpointState, FollowPosition, Place

    at = FollowPosition(window=3, window_start=120, tokens_before=40960)
    state = CheckpointState(step=130, cache_fingerprint="f", config={}, drafter={}, **Place(follow=at)._asdict())
    on_disk = json.loads(json.dumps(state.to_json()))
    assert on_disk["follow"] == {"window": 3, "window_start": 120, "tokens_before": 40960}
    assert "epoch" not in on_disk and "step_in_epoch" not in on_disk
    back = CheckpointState.from_json({**on_disk, "follow": {**on_disk["follow"], "later": 1}})
    assert back.follow == at and back == state
    epochs = CheckpointState.from_json(CheckpointState(step=4, cache_fingerprint="f", config={}, drafter={},
                                                       **Place(epoch=1, step_in_epoch=0)._asdict()).to_json())
    assert epochs.follow is None and (epochs.epoch, epochs.step_in_epoch) == (1, 0)


def test_the_follow_schedule_sets_each_step_rate_from_its_place():
    """TokenSchedule: warm-up then cosine over the plan's tokens, set before the step (LambdaLR's
    step() after it changes nothing), with no state of its own in a checkpoint."""
    import torch

    from dflash_offline.train.schedule import TokenSchedule, lr_at

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    sched = TokenSchedule(opt, 1e-3, 0.1)
    for progress in (0.0, 0.05, 0.1, 0.5, 0.99, 1.3):
        sched.at(progress)
        sched.step()
        assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == 1e-3 * lr_at(min(1.0, progress), 0.1)
    assert sched.state_dict() == {}
    sched.load_state_dict({"last_epoch": 7, "base_lrs": [1e-3]})  # an earlier main's LambdaLR state: unused
    assert sched.get_last_lr()[0] == 0.0
