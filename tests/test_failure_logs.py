"""Logs exist from the first second: a failure at any phase of either stage (a broken torch install
at import, weight loading, the first micro-batch where the GPU compiles, the first step, mid-run)
leaves, in the cache's or run's `logs/`, the failing process's log with the traceback and the phase,
and `dflash-offline status` names the failed process, its phase and the error. A failure in the
preflight, before the process holds its run, leaves its early log instead, named by the error line,
and nothing at the cache or run path (runtime/early_log.py).

Failures are injected with DFLASH_OFFLINE_RAISE_AT (runtime.fault_point) and, for the import, by a
`torch` package on PYTHONPATH that raises ImportError the way a broken install does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import SMALL_OPTS, TRAIN, run_cli

BROKEN = "injected: libtorch_cpu.so: cannot open shared object file"


@pytest.fixture(scope="module")
def broken_torch(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("broken-site")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    return site


def inject(case: str, broken_torch: Path) -> tuple[dict, str]:
    """(environment, text the error must contain) for a case named `point:N` or `import`."""
    if case == "import":
        return {"PYTHONPATH": os.pathsep.join([str(broken_torch), os.environ.get("PYTHONPATH", "")])}, BROKEN
    return {"DFLASH_OFFLINE_RAISE_AT": case}, f"injected failure at {case.split(':')[0]}"


def check_failure(r, logs: Path, path: Path, process: str, phase: str, expect: str) -> None:
    ctx = f"rc={r.returncode}\nstderr:\n{r.stderr[-3000:]}"
    assert r.returncode == 1, ctx
    assert r.stderr.strip().splitlines()[-1].startswith("failed:"), ctx
    if phase == "preflight":
        # Before the process holds its run, its log is the early one (runtime/early_log.py): the
        # error line names it, and nothing is written at the path the command was given.
        m = re.search(r"\(traceback in (\S+)\)", r.stderr)
        assert m and Path(m.group(1)).name == f"{process}.log", ctx
        log = Path(m.group(1)).read_text()
        shutil.rmtree(Path(m.group(1)).parent)
        assert not path.exists(), sorted(os.listdir(path))
    else:
        log = (logs / f"{process}.log").read_text()
    assert "Traceback (most recent call last)" in log and expect in log, log[-3000:]
    assert f"(phase: {phase})" in log, log[-3000:]
    if phase == "preflight":
        return
    st = run_cli(["status", path, "--json"])
    assert st.returncode == 0, st.stderr
    procs = {p["name"]: p for p in json.loads(st.stdout)["processes"]}
    assert procs[process]["state"] == "failed" and procs[process]["phase"] == phase, procs[process]
    assert expect in procs[process]["error"], procs[process]
    text = run_cli(["status", path]).stdout
    assert f"{process}" in text and f"phase {phase}" in text and "last error: " in text and expect in text, text


EXTRACT_CASES = [  # (case, failing process, phase)
    ("import", "extract-launcher", "preflight"),  # the launcher checks the weights' shapes with torch
    ("load-target:1", "extract-rank0", "load target"),
    ("batch-done:3", "extract-rank0", "extract"),  # mid-run: shards already committed
]

TRAIN_CASES = [
    ("import", "train-launcher", "preflight"),  # the launcher reads the target's shapes with torch
    ("load-weights:1", "train-launcher", "load weights"),
    ("compile:1", "train-launcher", "first step"),  # on a GPU: "first step: compile"
    ("train-step:1", "train-launcher", "first step: backward done"),
    ("train-step:4", "train-launcher", "train"),
]


def test_extract_failures_leave_log_traceback_and_phase(tiny_dense, tiny_data, broken_torch, tmp_path):
    def one(case):
        env, expect = inject(case, broken_torch)
        cache = tmp_path / case.replace(":", "-")
        return run_cli(["extract", "--target", tiny_dense, "--data", tiny_data, "--cache", cache, *SMALL_OPTS],
                       env=env), cache, expect

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, [c for c, _, _ in EXTRACT_CASES]))
    for (case, process, phase), (r, cache, expect) in zip(EXTRACT_CASES, results):
        check_failure(r, cache / "logs", cache, process, phase, expect)
        if process != "extract-launcher":
            launcher = (cache / "logs" / "extract-launcher.log").read_text()
            # The launcher's line carries the worker's own error (sent before the worker exits).
            assert f"worker 0 (cpu) failed: InjectedFault: {expect}" in launcher, case
            assert f"failed: worker 0 (cpu) failed: InjectedFault: {expect}" in r.stderr, case
    mid = json.loads((tmp_path / "batch-done-3" / "logs" / "extract-rank0.heartbeat.json").read_text())
    assert mid["tokens_done"] > 0 and mid["shard"], mid  # it failed mid-run, after batches went through


def test_train_failures_leave_log_traceback_and_phase(arith_cache, tiny_dense, broken_torch, tmp_path):
    def one(case):
        env, expect = inject(case, broken_torch)
        out = tmp_path / case.replace(":", "-")
        return run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN,
                        "--epochs", "1", "--max-steps", "6"], env=env), out, expect

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, [c for c, _, _ in TRAIN_CASES]))
    for (case, process, phase), (r, out, expect) in zip(TRAIN_CASES, results):
        check_failure(r, out / "logs", out, process, phase, expect)


def test_the_rank_that_failed_first_is_named(arith_cache, tiny_dense, tmp_path):
    """Two ranks; rank 1 fails at step 2 (DFLASH_OFFLINE_FAULT_RANK), rank 0 then fails in its
    broken collective. The launcher's one line names rank 1 and its own error, not rank 0's
    consequence (the launchers of both stages share one supervisor, runtime/supervise.py)."""
    out = tmp_path / "run"
    r = run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN, "--epochs", "1",
                 "--max-steps", "6", "--devices", "cpu,cpu"],
                env={"DFLASH_OFFLINE_RAISE_AT": "train-step:2", "DFLASH_OFFLINE_FAULT_RANK": "1"})
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("failed: training rank 1 failed: ") and "injected failure at train-step" in last, r.stderr
    assert f"see {out / 'logs' / 'train-rank1.log'}" in last, last
    assert "Traceback" not in r.stderr
