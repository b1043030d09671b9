"""Shared fixtures and helpers: tiny targets and data (session-scoped), one valid cache made by a real
`extract` run, a CLI runner that runs the command in its own process group, and a tree digest to prove
that a refused run left a cache untouched."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "manifests" / "cache-manifest.schema.json"

# Small, fast options for every extract in the tests (a few seconds on 2 CPU cores).
SMALL_OPTS = ["--devices", "cpu", "--topk", "4", "--max-len", "128", "--batch-tokens", "512",
              "--shard-tokens", "1024", "--no-progress"]
TINY_DATA_ROWS = 48
TINY_DATA_MAX_LEN = 120

# Variables that would make the CLI believe it runs under torchrun; tests set them explicitly.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ----------------------------------------------------------------------------------------------
# Helpers


def run_cli(args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Run `python -m dflash_offline *args` in a new session (its own process group, so a fault
    point's SIGKILL of the group never reaches pytest), capturing stdout/stderr as text.

    `env`: variables layered over this process's environment (a value of None removes one).
    On timeout the whole process group (the CLI and its workers) is killed and TimeoutExpired is
    raised with what it had printed.
    """
    cmd = [sys.executable, "-m", "dflash_offline", *[str(a) for a in args]]
    full_env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = str(v)
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call started (start_new_session)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def tree_digest(path, exclude=("logs",)) -> dict[str, str]:
    """{relative posix path: sha256 of the bytes} of every file under `path`, skipping files under
    the top-level folders named in `exclude`."""
    root = Path(path)
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in exclude]
        for name in filenames:
            p = Path(dirpath) / name
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[(rel_dir / name).as_posix()] = h.hexdigest()
    return out


def extract_args(target, data, cache, *extra) -> list[str]:
    """`extract` arguments for the tiny setup with the small, fast options."""
    datas = data if isinstance(data, (list, tuple)) else [data]
    args = ["extract", "--target", str(target)]
    for d in datas:
        args += ["--data", str(d)]
    return args + ["--cache", str(cache), *SMALL_OPTS, *extra]


# ----------------------------------------------------------------------------------------------
# Markers


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return  # no torch import when nothing needs it
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


# ----------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory) -> Path:
    """A tiny dense Qwen3 target folder (8 layers, hidden 64, vocab 512, seed 0)."""
    from dflash_offline.tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("targets") / "tiny-qwen3", kind="qwen3")


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory) -> Path:
    """A tiny hybrid Qwen3.5 target folder (Gated DeltaNet + attention layers)."""
    from dflash_offline.tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("targets") / "tiny-qwen3_5", kind="qwen3_5")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A Parquet file of 48 rows (8..120 tokens, loss_mask and id columns)."""
    from dflash_offline.tiny import make_tiny_data

    return make_tiny_data(tmp_path_factory.mktemp("data") / "tiny-data.parquet", rows=TINY_DATA_ROWS,
                          max_len=TINY_DATA_MAX_LEN)


@pytest.fixture(scope="session")
def valid_cache(tmp_path_factory, tiny_dense, tiny_data) -> Path:
    """A complete cache made once per session by a real `extract` (tiny_dense, tiny_data, small
    options). Tests must not modify it: copy it first (shutil.copytree) to change anything."""
    cache = tmp_path_factory.mktemp("valid") / "cache"
    r = run_cli(extract_args(tiny_dense, tiny_data, cache), timeout=300)
    assert r.returncode == 0, f"extract failed ({r.returncode}):\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert (cache / "manifest.json").is_file()
    return cache
