"""Issue 20, hardening (second part): a stale distributed environment refused instead of a hang,
refused and side processes that leave a run's status alone, and damaged checkpoints named in one
line. Each case checks the one line, the exit code, no traceback, and that nothing committed
changed; the hang cases also that the command returns within a time limit."""

from __future__ import annotations

import os
import socket
import time

import pytest
from conftest import TRAIN, run_cli, tree_digest


def _one_line(r, code: int, start: str) -> str:
    """The command's whole stderr is one line starting with `start`, exit `code`, no traceback."""
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# A stale distributed environment


def test_stale_rank_env_is_refused_before_any_work(valid_cache, tiny_dense, tiny_data):
    """RANK/WORLD_SIZE left in the shell by an earlier torchrun: not a torchrun launch, refused at
    once (the cache, logs included, untouched), instead of committing a share and waiting forever."""
    before = tree_digest(valid_cache, exclude=())
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    t0 = time.time()
    r = run_cli(["extract", "--target", tiny_dense, "--data", tiny_data, "--cache", valid_cache, "--devices", "cpu",
                 "--topk", "4", "--max-len", "128", "--batch-tokens", "512", "--no-progress"], env=env, timeout=60)
    line = _one_line(r, 2, "error: the environment has RANK=0 WORLD_SIZE=2 ")
    assert "not a torchrun launch" in line and "unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT" in line
    assert time.time() - t0 < 60
    assert tree_digest(valid_cache, exclude=()) == before


def test_complete_looking_stale_env_ends_after_the_rendezvous_timeout(arith_cache, tiny_dense, tmp_path):
    """All of RANK, WORLD_SIZE > 1, LOCAL_RANK, MASTER_ADDR, MASTER_PORT but no torchrun: the rank
    waits for the others (said in its log) and gives up after the timeout, in one line."""
    before = tree_digest(arith_cache, exclude=())
    out = tmp_path / "run"
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "DFLASH_OFFLINE_RENDEZVOUS_S": "2"}
    t0 = time.time()
    r = run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN, "--devices", "cpu"],
                env=env, timeout=90)
    line = _one_line(r, 2, "error: the environment has RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 ")
    assert "the other ranks did not join" in line and "unset RANK WORLD_SIZE" in line
    assert time.time() - t0 < 90
    assert "waits up to 2s for the other 1 rank(s)" in (out / "logs" / "train-rank0.log").read_text()
    assert sorted(os.listdir(out)) == ["logs"]
    assert tree_digest(arith_cache, exclude=()) == before


def test_rank_zero_gives_up_waiting_without_progress(monkeypatch):
    """Rank 0 waiting for the other ranks' commits: a reason at once, and an end when none come."""
    from dflash_offline.runtime import wait_for_other_ranks

    monkeypatch.setenv("DFLASH_OFFLINE_RANK_WAIT_S", "1")
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"waited \d+s for the other ranks .*without a commit: 3/7 shards"):
        wait_for_other_ranks(lambda: {"status": "extracting"}, lambda m: "3/7 shards")
    assert time.time() - t0 < 10
