"""A stale distributed environment refused instead of a hang,
refused and side processes that leave a run's status alone, and damaged checkpoints named in one
line. Each case checks the one line, the exit code, no traceback, and that nothing committed
changed; the hang cases also that the command returns within a time limit."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
from conftest import STRAIGHT, TRAIN, extract_args, run_cli, tree_digest


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
    waits for the others (said in its early log) and gives up after the timeout, in one line."""
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
    # A refusal: nothing is written at --out, not even the log that said it waited (an early log,
    # deleted at exit: runtime/early_log.py).
    assert not out.exists(), sorted(os.listdir(out))
    assert tree_digest(arith_cache, exclude=()) == before


def test_rank_zero_gives_up_waiting_without_progress(monkeypatch):
    """Rank 0 waiting for the other ranks' commits: a reason at once, and an end when none come."""
    from dflash_offline.runtime.supervise import wait_for_other_ranks

    monkeypatch.setenv("DFLASH_OFFLINE_RANK_WAIT_S", "1")
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"waited \d+s for the other ranks .*without a commit: 3/7 shards"):
        wait_for_other_ranks(lambda: {"status": "extracting"}, lambda m: "3/7 shards")
    assert time.time() - t0 < 10


# ----------------------------------------------------------------------------------------------
# Status that lies: refused reruns and side processes leave a run's heartbeats alone


def _beats(logs, prefix: str) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(logs.glob(f"{prefix}*.heartbeat.json"))}


def _status(path) -> dict:
    r = run_cli(["status", path, "--json"])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_refused_reruns_and_eval_leave_a_finished_run_finished(straight_run, arith_cache, tiny_dense, tmp_path):
    from dflash_offline.cache.location import Location

    out = tmp_path / "run"
    shutil.copytree(straight_run("cpu"), out)
    finished = _status(out)["verdict"]  # STRAIGHT stops at 12 steps of a longer plan: said so
    assert finished.startswith("finished at step 12 of the plan's ") and "a --max-steps stop" in finished, finished
    committed, beats = tree_digest(out), _beats(out / "logs", "train-")
    assert beats
    again = ["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN, *STRAIGHT, "--devices", "cpu"]
    # A rerun with another setting: refused by the checkpoint's settings.
    r = run_cli([*again, "--seed", "1"])
    _one_line(r, 2, f"error: {out}/step-12 was made with seed = 0, this run has 1")
    # ... or with another start for its layers (which the checkpoint would record as its own).
    r = run_cli([*again, "--init-layers", "0,1"])
    _one_line(r, 2, f"error: {out}/step-12 was made with init_layers = unset (its default rule), this run has [0, 1]")
    # The same rerun while the run holds its folder (as a running one does).
    fd = Location(str(out)).try_run_lock()
    assert fd is not None
    try:
        r = run_cli(again)
    finally:
        os.close(fd)
    _one_line(r, 2, f"error: --out {out}: another training run is using this folder")
    # An eval of the run's export that fails after its log opened (its log goes beside the export).
    r = run_cli(["eval", "--target", tiny_dense, "--drafter", out / "export", "--cache", arith_cache, "--devices", "7"])
    _one_line(r, 2, "error: --devices asks for GPU 7")
    assert "--devices asks for GPU" in r.stderr and "use --devices cpu to run on the CPU" in r.stderr
    assert tree_digest(out) == committed and _beats(out / "logs", "train-") == beats
    st = _status(out)
    assert st["verdict"] == finished, st
    assert st["processes"] and all(p["name"].startswith("train-") and p["state"] == "done" for p in st["processes"])
    assert st["last_error"] is None or Path(st["last_error"]["log"]).name.startswith("train-"), st["last_error"]


def test_refused_extract_rerun_leaves_the_heartbeats(valid_cache, tiny_dense, tiny_data, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(valid_cache, cache)
    committed, beats = tree_digest(cache), _beats(cache / "logs", "")
    r = run_cli(extract_args(tiny_dense, tiny_data, cache, "--topk", "2"))
    assert "the cache was made with capture.topk = 4 but this run has 2" in _one_line(r, 2, "error: ")
    assert tree_digest(cache) == committed and _beats(cache / "logs", "") == beats
    assert _status(cache)["verdict"] == "complete"


# ----------------------------------------------------------------------------------------------
# Damaged checkpoints: the folder, the file and the fix in one line, before any rank starts


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("name,damage,what", [
    ("drafter.safetensors", _cut, "cut short"),
    ("trainer.pt", _cut, "not a complete torch.save file"),
    ("state.json", lambda p: p.write_text('{"step": 12, "cache_fing'), "not valid JSON"),
])
def test_damaged_latest_checkpoint_is_named_with_the_fix(straight_run, arith_cache, tiny_dense, tmp_path, name, damage,
                                                         what):
    out = tmp_path / "run"
    shutil.copytree(straight_run("cpu"), out)
    shutil.copytree(out / "step-12", out / "step-6")  # an earlier checkpoint to go back to
    damage(out / "step-12" / name)
    committed, beats = tree_digest(out), _beats(out / "logs", "train-")
    r = run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN, *STRAIGHT,
                 "--max-steps", "14", "--devices", "cpu"])
    line = _one_line(r, 2, f"error: {out}/step-12/{name}: {what}")
    assert f"the checkpoint is damaged: delete {out}/step-12 to resume from {out}/step-6" in line, line
    if name == "drafter.safetensors":
        r = run_cli(["export", "--run", out, "--to", tmp_path / "exported"])
        line = _one_line(r, 2, f"error: {out}/step-12/{name}: {what}")
        assert "export the one before with --step 6" in line, line
        assert not (tmp_path / "exported").exists()
    assert tree_digest(out) == committed and _beats(out / "logs", "train-") == beats


def test_rerunning_a_finished_run_adds_no_tensorboard_file(straight_run, arith_cache, tiny_dense, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight_run("cpu"), out)
    events = sorted(p.name for p in (out / "tensorboard").glob("events.*"))
    r = run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN, *STRAIGHT, "--devices",
                 "cpu"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (out / "tensorboard").glob("events.*")) == events
