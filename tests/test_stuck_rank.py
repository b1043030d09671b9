"""A rank whose peer is stuck or gone: it stops on SIGTERM instead of waiting in a collective that no
signal but SIGKILL ends, and a test that times out leaves no process of its tree behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import _LAUNCH_VARS, TRAIN, communicate_tree, kill_tree, process_tree, run_tree
from dflash_offline.runtime.logs import pid_alive


def _heartbeat(log_dir, name: str) -> dict:
    try:
        return json.loads((log_dir / f"{name}.heartbeat.json").read_text())
    except (OSError, ValueError):
        return {}


def test_run_tree_kills_children_in_sessions_of_their_own_on_timeout(tmp_path):
    """torchrun starts each rank in a session of its own: killing the group it leads on timeout
    (what subprocess.run's timeout does not even do) leaves the ranks running; run_tree kills them."""
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(300)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_tree([sys.executable, "-c", script], timeout=5)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child), "the grandchild in its own session outlived the timeout"


def test_rank_waiting_for_a_stuck_rank_stops_on_sigterm(arith_cache, tiny_dense, tmp_path):
    """Two torchrun ranks; rank 0 is held after its export (`train-end`: stuck, it reads no
    collective) while rank 1 waits at the end-of-run barrier. SIGTERM to rank 1 alone ends it
    within seconds with the line of a stopped run; torchrun then stops rank 0, which finds rank 1
    gone at the barrier and stops too. No rank outlives the run."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(PYTHONUNBUFFERED="1", DFLASH_OFFLINE_HOLD_AT="train-end:1", DFLASH_OFFLINE_FAULT_RANK="0",
               DFLASH_OFFLINE_SLOW_RANK_S="0")  # rank 0 is stuck, not slow: no waiting for a long save
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dflash_offline",
           "train", "--target", str(tiny_dense), "--cache", str(arith_cache), "--out", str(out), *TRAIN,
           "--epochs", "1", "--max-steps", "2", "--devices", "cpu"]
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    logs = out / "logs"
    try:
        deadline = time.monotonic() + 240
        while not (_heartbeat(logs, "train-rank0").get("phase") == "held at train-end" and
                   _heartbeat(logs, "train-rank1").get("phase", "").startswith("waiting for the other ranks")):
            assert proc.poll() is None, communicate_tree(proc, 10)
            assert time.monotonic() < deadline, "the ranks never reached the end of the run"
            time.sleep(0.1)
        rank0, rank1 = _heartbeat(logs, "train-rank0")["pid"], _heartbeat(logs, "train-rank1")["pid"]
        assert _heartbeat(logs, "train-rank1")["phase"] == "waiting for the other ranks at the end of the run"
        tree = process_tree(proc.pid)
        assert rank0 in tree and rank1 in tree
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGTERM)
        while pid_alive(rank1) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert took < 15, f"rank 1 did not stop within {took:.0f}s of SIGTERM"
        _, err = communicate_tree(proc, timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.communicate()
    assert proc.returncode != 0
    assert "rank 1 stopped without the other ranks: they did not meet it at the end of the run (still pending " in err, \
        err[-3000:]
    assert "rank 0 stopped without the other ranks: they did not meet it at the end of the run" in err, err[-3000:]
    assert "checkpoint step-2 saved" in err and (out / "export").is_dir()  # the run's work was done
    assert not [p for p in tree if pid_alive(p)], "a process of the run outlived it"
    for name in ("train-rank0", "train-rank1"):
        assert _heartbeat(logs, name)["state"] == "stopped", _heartbeat(logs, name)


def test_exit_within_ends_a_process_whose_teardown_hangs(tmp_path):
    """After the end-of-run barrier a rank arms exit_within: a teardown that never returns ends with
    the threads' tracebacks in the process log and exit code 1. The hang here is a C call that
    holds the GIL (libc's sleep through ctypes.PyDLL), as a process group's C++ teardown does when
    the model that holds it is freed: no signal handler or Python thread runs then."""
    script = ("import ctypes, sys\n"
              "from dflash_offline.runtime.logs import open_process_log\n"
              "from dflash_offline.runtime.launch import exit_within\n"
              "open_process_log(sys.argv[1], 'rank', console=False)\n"
              "exit_within(1)\n"
              "ctypes.PyDLL(None).sleep(60)\n")
    t0 = time.monotonic()
    r = run_tree([sys.executable, "-c", script, str(tmp_path)], timeout=30)
    assert r.returncode == 1 and time.monotonic() - t0 < 20, (r.returncode, r.stderr)
    log = (tmp_path / "rank.log").read_text()
    assert "Timeout (0:00:01)!" in log and 'File "<string>", line 6' in log, log  # where the main thread was
