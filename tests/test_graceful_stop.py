"""Graceful stop: SIGTERM or SIGINT (Ctrl-C reaches the whole process group) ends a run at a safe
point. Extraction finishes the shards being written and commits them; training finishes its step
and saves a checkpoint there. The process exits with 128 + the signal, prints one line that says how
to resume, leaves no debris, and the resumed run equals an uninterrupted one.

The runs wait at a fault point (DFLASH_OFFLINE_HOLD_AT: mid-shard, or right after a step's optimizer
update) until the stop request arrives, so the signal lands while a shard or a step is in progress
in every worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import _LAUNCH_VARS, STRAIGHT, TRAIN, run_cli
from test_extract_resume import OPTS, assert_no_debris, shard_table
from test_train import metrics, weights


def start(args, env: dict) -> subprocess.Popen:
    """The CLI in its own process group (as a terminal would run it), stderr captured."""
    full = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    full.update(PYTHONUNBUFFERED="1", **env)
    return subprocess.Popen([sys.executable, "-m", "dflash_offline", *map(str, args)], env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_until(cond, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not cond():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (rc {proc.returncode}) before the signal:\n{out}\n{err}")
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the run never reached the point to signal")
        time.sleep(0.1)


def held(log_dir: Path, names: list[str]) -> bool:
    """Every named process is waiting at the fault point."""
    for name in names:
        try:
            if not json.loads((log_dir / f"{name}.heartbeat.json").read_text())["phase"].startswith("held at"):
                return False
        except (OSError, ValueError, KeyError):
            return False
    return True


def heartbeat(log_dir: Path, name: str) -> dict:
    return json.loads((log_dir / f"{name}.heartbeat.json").read_text())


def committed(cache: Path) -> int:
    try:
        return len(json.loads((cache / "manifest.json").read_text())["shards"])
    except (OSError, json.JSONDecodeError, KeyError):
        return 0


def signal_run(proc: subprocess.Popen, sig: int, group: bool) -> tuple[int, str]:
    """SIGTERM to the launcher alone (a scheduler, `kill PID`) or SIGINT to the whole group (Ctrl-C)."""
    if group:
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, err


@pytest.mark.parametrize("sig, group, devices", [
    (signal.SIGTERM, False, "cpu"),      # kill -TERM LAUNCHER: the launcher forwards it
    (signal.SIGINT, True, "cpu,cpu"),    # Ctrl-C: every process of the group gets it at once
], ids=["sigterm-launcher", "sigint-group-2-workers"])
def test_extract_stops_at_a_batch_and_resumes(sig, group, devices, extract_reference, tiny_dense, tiny_data, tmp_path):
    """A stop lands at the next batch (seconds, where a shard on a CPU may take minutes): the shard in
    progress is dropped, the shards before it commit, nothing is left half-written."""
    import time

    cache = tmp_path / "cache"
    args = ["extract", "--target", tiny_dense, "--data", tiny_data, "--cache", cache, "--devices", devices, *OPTS]
    workers = [f"extract-rank{r}" for r in range(len(devices.split(",")))]
    # each worker at its third batch: the first of its second shard (two batches a shard with OPTS)
    proc = start(args, {"DFLASH_OFFLINE_HOLD_AT": "batch-done:3"})
    wait_until(lambda: held(cache / "logs", workers), proc)
    in_progress = {heartbeat(cache / "logs", w)["shard"] for w in workers}
    t0 = time.monotonic()
    rc, err = signal_run(proc, sig, group)
    took = time.monotonic() - t0
    name = signal.Signals(sig).name
    assert rc == 128 + sig, err
    assert took < 10, took
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped on {name}:") and "run the same command again to resume" in last, err
    assert "none half-written (a shard in progress is written anew)" in last, last
    m = json.loads((cache / "manifest.json").read_text())
    assert m["status"] != "complete" and len(m["shards"]) < m["plan"]["num_shards"]
    assert not in_progress & {sh["name"] for sh in m["shards"]}  # the shards in progress were dropped
    assert len(m["shards"]) >= len(workers)  # the ones before them committed
    assert_no_debris(cache)  # and none is left half-written
    assert not list(cache.glob("shards/.tmp*")) and not list(cache.glob(".tmp*"))
    assert f"{name} received: stopping at the next batch (seconds)" in (cache / "logs" / "extract-launcher.log").read_text()
    for w in workers:
        assert "stop requested by the launcher" in (cache / "logs" / f"{w}.log").read_text()
        assert name in heartbeat(cache / "logs", w)["error"], w  # the launcher's signal, not another
    st = run_cli(["status", cache, "--json"])
    procs = {p["name"]: p["state"] for p in json.loads(st.stdout)["processes"]}
    assert procs["extract-launcher"] == "stopped" and all(procs[w] == "stopped" for w in workers), procs
    assert "stopped on request" in json.loads(st.stdout)["verdict"]

    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    assert shard_table(cache) == shard_table(extract_reference)
    assert_no_debris(cache)


@pytest.mark.parametrize("sig, group, devices", [
    (signal.SIGTERM, False, "cpu"),
    (signal.SIGINT, True, "cpu,cpu"),    # two gloo ranks agree on the step to stop after
], ids=["sigterm-one-process", "sigint-group-2-ranks"])
def test_train_stops_after_the_step_checkpoints_and_resumes(sig, group, devices, arith_cache, tiny_dense,
                                                            straight_run, tmp_path):
    common = [*STRAIGHT, "--devices", devices]
    straight, stopped = straight_run(devices), tmp_path / "stopped"
    args = ["train", "--target", tiny_dense, "--cache", arith_cache, "--out", stopped, *TRAIN, *common]
    ranks = ["train-launcher"] if devices == "cpu" else ["train-rank0", "train-rank1"]
    proc = start(args, {"DFLASH_OFFLINE_HOLD_AT": "train-step:3"})  # every rank, right after step 3's update
    wait_until(lambda: held(stopped / "logs", ranks), proc)
    rc, err = signal_run(proc, sig, group)
    assert rc == 128 + sig, err
    last = err.strip().splitlines()[-1]
    steps = sorted(int(p.name[5:]) for p in stopped.glob("step-*"))
    assert steps == [3], (steps, err)  # the step in progress was finished and checkpointed
    assert last == (f"stopped on {signal.Signals(sig).name}: checkpoint step-{steps[0]} saved in {stopped}; "
                    "run the same command again to resume"), err
    assert metrics(stopped)[-1]["step"] == steps[0]  # stopped right after the step it checkpointed
    assert not (stopped / "export").exists() and not list(stopped.glob(".tmp-*"))
    st = json.loads(run_cli(["status", stopped, "--json"]).stdout)
    assert st["verdict"].startswith("stopped before the end") and f"step-{steps[0]}" in st["verdict"]

    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    assert [x["loss"] for x in metrics(straight)] == [x["loss"] for x in metrics(stopped)]
    wa, wb = weights(straight, 12), weights(stopped, 12)
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


def test_ctrl_c_while_workers_start_is_a_clean_stop(tiny_dense, tiny_data, tmp_path):
    """Ctrl-C while the launcher is starting its workers: the workers receive the request only once
    their handlers are set (the signals are blocked across their start), so the run stops cleanly
    (exit 130, one line, no traceback), with nothing half-written."""
    cache = tmp_path / "cache"
    args = ["extract", "--target", tiny_dense, "--data", tiny_data, "--cache", cache, "--devices", "cpu,cpu", *OPTS]
    proc = start(args, {})
    log = cache / "logs" / "extract-launcher.log"
    wait_until(lambda: log.exists() and "started 2 worker processes" in log.read_text(), proc)
    rc, err = signal_run(proc, signal.SIGINT, group=True)
    assert rc == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("stopped on SIGINT"), err
    m = json.loads((cache / "manifest.json").read_text())
    assert m["status"] != "complete"
    assert_no_debris(cache)


def test_follow_trainer_stopped_while_waiting_for_shards(tiny_dense, tiny_data, valid_cache, tmp_path):
    """`train --follow` waiting for a shard that extraction has not committed yet: SIGTERM saves a
    checkpoint of what it trained and stops; once extraction is done, the resumed trainer gives
    the losses and learning rates of a follow run over the complete cache."""
    import shutil

    from conftest import extract_args

    follow = ["--seq-len", "128", "--num-anchors", "8", "--block-size", "4", "--global-batch-tokens", "256",
              "--mask-token-id", "1", "--drafter-layers", "1", "--epochs", "1", "--follow", "--follow-window", "2",
              "--loader-workers", "0", "--checkpoint-every", "100", "--no-progress"]
    complete = tmp_path / "complete"
    shutil.copytree(valid_cache, complete)  # a follower records itself in the manifest
    straight = tmp_path / "straight"
    r = run_cli(["train", "--target", tiny_dense, "--cache", complete, "--out", straight, *follow])
    assert r.returncode == 0, r.stderr

    cache, out = tmp_path / "cache", tmp_path / "run"
    ex_args = extract_args(tiny_dense, tiny_data, cache)  # the plan of valid_cache
    extractor = start(ex_args, {"DFLASH_OFFLINE_HOLD_AT": "batch-done:8"})  # mid-way through the third (last) shard
    try:
        wait_until(lambda: held(cache / "logs", ["extract-rank0"]) and committed(cache) >= 2, extractor)
        tr_args = ["train", "--target", tiny_dense, "--cache", cache, "--out", out, *follow]
        trainer = start(tr_args, {})
        hb = cache.parent / "run" / "logs" / "train-launcher.heartbeat.json"
        wait_until(lambda: hb.exists() and json.loads(hb.read_text())["phase"] == "waiting for shards", trainer)
        rc, err = signal_run(trainer, signal.SIGTERM, group=False)
        assert rc == 128 + signal.SIGTERM, err
        steps = sorted(int(p.name[5:]) for p in out.glob("step-*"))
        assert steps and metrics(out)[-1]["step"] == steps[-1], (steps, err)
        assert err.strip().splitlines()[-1].startswith(f"stopped on SIGTERM: checkpoint step-{steps[-1]} saved"), err
    finally:
        if extractor.poll() is None:
            signal_run(extractor, signal.SIGTERM, group=False)
    r = run_cli(ex_args)
    assert r.returncode == 0, r.stderr
    r = run_cli(tr_args)
    assert r.returncode == 0, r.stderr
    a, b = metrics(straight), metrics(out)
    assert [(x["loss"], x["lr"]) for x in a] == [(x["loss"], x["lr"]) for x in b]
