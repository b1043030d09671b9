"""A refused command writes nothing: not even its log folder at the path it refused.

Each stage command's own process logs from its first second into an early log in the system's
temporary space, which moves into OUT/logs/ (CACHE/logs/, ...) only once the preflight passed and
the run is held (runtime/logs.py, open_launcher_log). Checked here through the real CLI, for each
command whose refusal comes after its log opened (the fault point `launcher-log-opened` is reached
by the same arguments: the log was open when the refusal came): the path given is left absent, an
existing folder exactly as it was; a crash before the preflight ends names its early log, which
holds the traceback; a refusal deletes it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import SMALL_OPTS, TRAIN, run_cli, tree_digest


def _cases(t: Path, data: Path, cache: Path, out: Path) -> dict[str, list]:
    """Per command: arguments refused after the log opened, writing into `out`."""
    return {
        # An option checked against the target in the preflight.
        "extract": ["extract", "--target", t, "--data", data, "--cache", out, "--capture-layers", "99", *SMALL_OPTS],
        # No cache where --cache points.
        "train": ["train", "--target", t, "--cache", out.parent / "no-cache", "--out", out, *TRAIN],
        # Prompts longer than the target's context with the new tokens.
        "generate": ["generate", "--target", t, "--prompts", data, "--out", out, "--max-new-tokens", "100000",
                     "--no-progress"],
        # A target folder without tokenizer files (a model folder's weights only).
        "prepare": ["prepare", "--target", cache, "--data", data, "--out", out],
    }


@pytest.fixture
def setup(tiny_dense, tiny_data, valid_cache, tmp_path):
    return tiny_dense, tiny_data, valid_cache, tmp_path


def _early_log(stderr: str) -> Path:
    m = re.search(r"\(traceback in (\S+)\)", stderr)
    assert m, stderr
    return Path(m.group(1))


@pytest.mark.parametrize("command", ["extract", "train", "generate", "prepare"])
def test_refused_command_leaves_no_folder_and_a_crash_names_its_early_log(setup, command):
    t, data, cache, tmp = setup
    fresh = tmp / "parent" / "out"  # neither the folder nor its parent exists
    args = _cases(t, data, cache, fresh)[command]
    r = run_cli(args)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1, r.stderr
    assert not (tmp / "parent").exists(), sorted(os.listdir(tmp / "parent"))
    # An existing empty folder stays empty.
    empty = tmp / "empty"
    empty.mkdir()
    r = run_cli(_cases(t, data, cache, empty)[command])
    assert r.returncode == 2 and r.stderr.startswith("error: "), r.stderr
    assert os.listdir(empty) == []
    # The same arguments crashing as soon as the log opened: the line names the early log, which
    # holds the traceback; nothing is written at --out.
    r = run_cli(args, env={"DFLASH_OFFLINE_RAISE_AT": "launcher-log-opened:1"})
    assert r.returncode == 1 and "failed: injected failure at launcher-log-opened" in r.stderr, r.stderr
    early = _early_log(r.stderr)
    try:
        assert early.parent.name.startswith(f"dflash-offline-{command}-"), early
        text = early.read_text()
        assert "Traceback" in text and "InjectedFault: injected failure at launcher-log-opened" in text, text
        assert f"---- {command}-launcher started" in text or "---- prepare started" in text, text
    finally:
        shutil.rmtree(early.parent, ignore_errors=True)
    assert not (tmp / "parent").exists()


def test_refused_eval_leaves_no_log_folder(tiny_dense, tiny_data, tmp_path):
    """eval's default log folder is ./dflash-logs for a drafter outside a run folder."""
    work = tmp_path / "work"
    work.mkdir()
    args = ["eval", "--target", tiny_dense, "--drafter", tmp_path / "no-drafter", "--prompts", tiny_data, "--no-progress"]
    r = run_cli(args, cwd=work)
    assert r.returncode == 2 and "--drafter" in r.stderr and "no such folder" in r.stderr, r.stderr
    assert os.listdir(work) == []
    r = run_cli(args, cwd=work, env={"DFLASH_OFFLINE_RAISE_AT": "launcher-log-opened:1"})
    assert r.returncode == 1, r.stderr
    early = _early_log(r.stderr)
    try:
        assert "Traceback" in early.read_text()
    finally:
        shutil.rmtree(early.parent, ignore_errors=True)
    assert os.listdir(work) == []


def test_refused_demo_leaves_no_folder(tmp_path):
    r = run_cli(["demo", "--out", tmp_path / "demo", "--devices", "7"])
    assert r.returncode == 2 and "--devices asks for GPU 7" in r.stderr, r.stderr
    assert not (tmp_path / "demo").exists()


def test_refused_rerun_leaves_a_cache_and_its_logs_as_they_were(valid_cache, tiny_dense, tiny_data, tmp_path):
    """A rerun refused by the cache's settings appends no line to the cache's logs either."""
    cache = tmp_path / "cache"
    shutil.copytree(valid_cache, cache)
    before = tree_digest(cache, exclude=())
    r = run_cli(["extract", "--target", tiny_dense, "--data", tiny_data, "--cache", cache, *SMALL_OPTS, "--topk", "2"])
    assert r.returncode == 2 and "capture.topk" in r.stderr, r.stderr
    assert tree_digest(cache, exclude=()) == before


def test_early_log_in_the_temporary_space(tiny_dense, arith_cache, tmp_path):
    """The early log lives under TMPDIR: a refusal deletes it, a run that starts moves it into
    OUT/logs (its header first), and a SIGKILL before the preflight ends leaves it there and nothing at --out."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "run"
    args = ["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN, "--max-steps", "1"]
    r = run_cli([*args, "--mask-token-id", "100000"], env={"TMPDIR": tmp})
    assert r.returncode == 2 and r.stderr.startswith("error: --mask-token-id"), r.stderr
    assert not out.exists() and os.listdir(tmp) == []
    r = run_cli(args, env={"TMPDIR": tmp, "DFLASH_OFFLINE_KILL_AT": "launcher-log-opened:1"})
    assert r.returncode == -9 and not out.exists(), r.stderr
    (left,) = tmp.iterdir()
    assert "---- train-launcher started" in (left / "train-launcher.log").read_text()
    shutil.rmtree(left)
    r = run_cli(args, env={"TMPDIR": tmp})
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.listdir(tmp) == []
    log = (out / "logs" / "train-launcher.log").read_text()
    assert log.startswith(log[:23] + " INFO [dflash] ---- train-launcher started"), log[:300]
    assert "Traceback" not in log and "done" in (out / "logs" / "train-launcher.heartbeat.json").read_text()
