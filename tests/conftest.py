"""Shared fixtures and helpers: tiny targets and data (session-scoped), one valid cache made by a real
`extract` run, a CLI runner that runs the command in its own process group, and a tree digest to prove
that a refused run left a cache untouched."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import _zygote

# One compute thread per process, here and in every CLI process the tests start (they inherit the
# environment): two test processes (xdist -n 2) share the 2 cores, and a tiny model's forward in a
# second thread only waits on the other process. With torch's default (a thread per core), an
# in-process decode or the demo's target training runs 10-15x slower while the other test process
# computes (OpenMP threads spinning against each other). Results do not depend on it; set
# OMP_NUM_THREADS to choose otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): apply the same to it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "manifests" / "cache-manifest.schema.json"

# Small, fast options for every extract in the tests (a few seconds on 2 CPU cores).
SMALL_OPTS = ["--devices", "cpu", "--topk", "4", "--max-len", "128", "--batch-tokens", "512",
              "--shard-tokens", "1024", "--no-progress"]
# Options of the resume tests: small shards (7 of them) and chunks, so kills land mid-cache.
RESUME_OPTS = ["--topk", "4", "--max-len", "120", "--batch-tokens", "360", "--shard-tokens", "450",
               "--chunk-tokens", "128", "--no-progress"]
# Small, fast options for the training tests (a step takes a few ms on the CPU).
TRAIN = ["--seq-len", "256", "--num-anchors", "16", "--block-size", "8", "--global-batch-tokens", "512",
         "--lr", "3e-3", "--mask-token-id", "1", "--drafter-layers", "2", "--loader-workers", "0", "--no-progress"]
# The uninterrupted runs resumed runs are compared with (straight_run).
STRAIGHT = ["--epochs", "2", "--max-steps", "12", "--checkpoint-every", "100"]
TINY_DATA_ROWS = 48
TINY_DATA_MAX_LEN = 120
# Artifacts the code at commit f7e7743 wrote (tests/data/made-by-f7e7743/README.md), and the options
# of its training run under their current names (the checkpoint saved num_layers and layers).
EARLIER = Path(__file__).parent / "data" / "made-by-f7e7743"
EARLIER_TRAIN = ["--seq-len", "128", "--num-anchors", "8", "--block-size", "8", "--global-batch-tokens", "256",
                 "--lr", "3e-3", "--mask-token-id", "1", "--drafter-layers", "1", "--target-layers", "1,3",
                 "--loader-workers", "0", "--no-progress", "--epochs", "2", "--checkpoint-every", "3",
                 "--kd-weight", "0.5"]

# Variables that would make the CLI believe it runs under torchrun; tests set them explicitly.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ----------------------------------------------------------------------------------------------
# Helpers


def _cli_cwd() -> Path:
    """The CLI's working folder when a test gives none: a scratch folder, so that a default that
    writes into the working folder (eval's ./dflash-logs) never lands in the repository."""
    global _CLI_CWD
    if _CLI_CWD is None:
        _CLI_CWD = Path(tempfile.mkdtemp(prefix="dflash-cli-cwd-"))
    return _CLI_CWD


_CLI_CWD: Path | None = None


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_cli(args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    """Run `python -m dflash_offline *args` in a new session (its own process group, so a fault
    point's SIGKILL of the group never reaches pytest), capturing stdout/stderr as text.

    The process is forked from a zygote that has imported torch and transformers (tests/_zygote.py:
    the same command, its own process, without 4-7 s of imports); an environment that changes how
    the interpreter or those libraries start takes a cold `python -m` instead, as does every call
    under DFLASH_TEST_COLD_CLI=1.

    `env`: variables layered over this process's environment (a value of None removes one).
    On timeout the whole process tree (the CLI and its workers) is killed and TimeoutExpired is
    raised with what it had printed.
    """
    cmd = [sys.executable, "-m", "dflash_offline", *[str(a) for a in args]]
    full_env = _base_env()
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = str(v)
    zygote = _zygote.get(_base_env())
    if zygote is not None and zygote.fits(full_env):
        done = zygote.run(cmd, [str(a) for a in args], cwd or _cli_cwd(), full_env, timeout)
        if done is not None:
            return done
    return run_tree(cmd, timeout=timeout, cwd=cwd or _cli_cwd(), env=full_env)


def _children() -> dict[int, list[int]]:
    """{parent pid: its child pids}, from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # the name in parentheses may hold spaces
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process descended from it (children, grandchildren...)."""
    kids, found, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(kids.get(p, ()))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`, its process group and every process descended from it. The group alone is
    not enough: torchrun starts each rank in a session of its own, so killing torchrun's group
    leaves its ranks running. The tree is frozen (SIGSTOP) until no new process appears, so that
    nothing forks a child past the walk or is re-parented away from it before the kill."""
    frozen: set[int] = set()
    while True:
        tree = [p for p in process_tree(pid) if p not in frozen]
        if not tree:
            break
        for p in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
            frozen.add(p)
    for p in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(p)
            if group != os.getpgrp():  # a tree not started in a session of its own: never pytest's group
                os.killpg(group, signal.SIGKILL)  # with the helpers it started in its group
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def communicate_tree(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """`proc.communicate(timeout=timeout)`; on timeout the whole process tree of `proc` is killed
    (kill_tree) and TimeoutExpired is raised with what it had printed."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process that left the tree before the kill holds the pipes
            proc.wait()
            out, err = e.output, e.stderr
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None


def run_tree(cmd, *, timeout: float, **popen_kw) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)` in a new session, for
    a command that starts processes of its own (torchrun and its ranks, a launcher and its workers,
    a script that runs the CLI): on timeout the whole tree is killed (kill_tree), where
    subprocess.run kills only `cmd` and leaves its children running."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen_kw)
    out, err = communicate_tree(proc, timeout)
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


def benchmark_module(name: str):
    """A script of benchmarks/ loaded as a module, for tests of its pure parts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def extract_args(target, data, cache, *extra) -> list[str]:
    """`extract` arguments for the tiny setup with the small, fast options."""
    datas = data if isinstance(data, (list, tuple)) else [data]
    args = ["extract", "--target", str(target)]
    for d in datas:
        args += ["--data", str(d)]
    return args + ["--cache", str(cache), *SMALL_OPTS, *extra]



def fit_drafter_to_samples(d, feats, input_ids, loss_masks, steps: int, anchors: int, seed: int = 0):
    """A few optimiser steps of `d` on whole samples, one per row (feats [R, S, n*H] by position):
    a drafter that accepts some blocks and not others (a random one accepts nothing, which would
    make acceptance comparisons trivial)."""
    import numpy as np
    import torch

    from dflash_offline.drafter import masks
    from dflash_offline.blocks.loss import block_loss
    from dflash_offline.blocks.packing import build_row, loss_weights

    S, B, off = feats.shape[1], d.cfg.block_size, d.cfg.label_offset
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(d.trainable_parameters(), lr=3e-3)
    d.train()
    for _ in range(steps):
        rows = [build_row([ids], [lm], S, anchors, B, 1, loss_weights(B, 4.0, off), rng, label_offset=off)
                for ids, lm in zip(input_ids, loss_masks)]
        st = lambda k: torch.from_numpy(np.stack([getattr(r, k) for r in rows]))  # noqa: E731
        mask = masks.dense_mask(st("doc_ids"), st("anchors"), st("anchor_valid"), B)
        h = d(feats, st("block_ids"), st("positions"), st("block_positions"), mask)
        if d.cfg.method == "dspark":  # the CE term alone: the data are the target's greedy completions
            from dflash_offline.drafter.dspark import previous_tokens
            from dflash_offline.blocks.dspark_loss import LossWeights, dspark_loss

            loss = dspark_loss(h, d.lm_head.weight, d.markov_head, d.confidence_head,
                               previous_tokens(st("block_ids"), st("labels"), B), st("labels"), st("weights"),
                               loss_weights=LossWeights(1.0, 0.0, 1.0)).total
        else:
            loss, _ = block_loss(h, d.lm_head.weight, st("labels"), st("weights"))
        opt.zero_grad()
        (loss / st("weights").sum()).backward()
        opt.step()
    return d.eval()


def fitted_drafter(target, session, prompts, completions, layers, block_size: int = 8, method: str = "dflash"):
    """A 2-layer drafter of `target` fitted for 40 steps to its own completions of `prompts`
    (session: a TargetSession over `layers` giving the features); method dspark: with a Markov
    head of rank 8 and a confidence head."""
    import dataclasses

    import numpy as np
    import torch

    from dflash_offline.drafter.config import DrafterConfig
    from dflash_offline.drafter.model import DFlashDrafter

    seqs = [np.asarray(p + c, np.int64) for p, c in zip(prompts, completions)]
    S = max(len(x) for x in seqs)
    feats = torch.zeros(len(seqs), S, len(layers) * session.model.config.hidden_size)
    for i, x in enumerate(seqs):
        feats[i, :len(x)] = session.start(x.tolist())[1]
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(str(target), layers, block_size=block_size, drafter_layers=2, mask_token_id=1)
    if method == "dspark":
        cfg = dataclasses.replace(cfg, method="dspark", markov_rank=8, confidence_head=True)
    d = DFlashDrafter(cfg)
    d.load_frozen_from_target(str(target))
    masks = [np.r_[np.zeros(len(p)), np.ones(len(x) - len(p))].astype(np.int8) for x, p in zip(seqs, prompts)]
    return fit_drafter_to_samples(d, feats, seqs, masks, steps=40, anchors=24)


# ----------------------------------------------------------------------------------------------
# The suite's temporary space


def pytest_configure(config):
    """Every temporary file of the suite (pytest's tmp_path folders, the CLI's working folder, early
    logs of launchers a test SIGKILLs, benchmarks' scratch folders, the zygote's socket) goes under
    one folder, made here and removed at the end: the suite leaves nothing in the system's temporary
    space. TMPDIR reaches every process the tests start; xdist's workers inherit the controller's."""
    if os.environ.get("DFLASH_TEST_TMP"):
        return  # a worker process: the controller made the folder and removes it
    root = tempfile.mkdtemp(prefix="dflash-tests-")
    os.environ["DFLASH_TEST_TMP"] = os.environ["TMPDIR"] = root
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    config.stash[_TMP_OWNER] = root


def pytest_unconfigure(config):
    root = config.stash.get(_TMP_OWNER, None)
    if root is not None:
        _zygote.close_all()
        shutil.rmtree(root, ignore_errors=True)


_TMP_OWNER = pytest.StashKey[str]()


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
    # Before any test runs a command against it (valid_cache_as_made).
    _AS_MADE["valid_cache"] = tmp_path_factory.mktemp("valid-as-made") / "cache"
    shutil.copytree(cache, _AS_MADE["valid_cache"])
    return cache


_AS_MADE: dict[str, Path] = {}


@pytest.fixture(scope="session")
def valid_cache_as_made(valid_cache) -> Path:
    """valid_cache as its extract left it, logs included (the shared one also logs the refused runs
    of other tests). Tests must not modify it: copy it first."""
    return _AS_MADE["valid_cache"]


def extract_arith_cache(target, root: Path, rows: int, topk: int) -> Path:
    """A complete cache of `rows` arithmetic rows (40-120 tokens, seed 3) of `target`, with its top-k."""
    from dflash_offline.tiny import make_tiny_data

    data = make_tiny_data(root / "arith.parquet", rows=rows, min_len=40, max_len=120, pattern="arith", seed=3)
    cache = root / "cache"
    r = run_cli(["extract", "--target", str(target), "--data", str(data), "--cache", str(cache),
                 "--topk", str(topk), "--max-len", "128", "--batch-tokens", "1024", "--shard-tokens", "2048",
                 "--no-progress"])
    assert r.returncode == 0, r.stderr
    return cache


@pytest.fixture(scope="session")
def arith_cache(tiny_dense, tmp_path_factory):
    """A complete cache of 160 arithmetic rows (topk 0) that the training tests learn from."""
    return extract_arith_cache(tiny_dense, tmp_path_factory.mktemp("train"), rows=160, topk=0)


@pytest.fixture(scope="session")
def extract_reference(tiny_dense, tiny_data, tmp_path_factory):
    """An uninterrupted extract of tiny_data with RESUME_OPTS (7 shards): what resumed runs must equal."""
    import json

    cache = tmp_path_factory.mktemp("ref") / "cache"
    r = run_cli(["extract", "--target", tiny_dense, "--data", tiny_data, "--cache", cache, "--devices", "cpu",
                 *RESUME_OPTS])
    assert r.returncode == 0, r.stderr
    m = json.loads((cache / "manifest.json").read_text())
    assert m["status"] == "complete" and m["plan"]["num_shards"] >= 6
    return cache


@pytest.fixture(scope="session")
def straight_run(arith_cache, tiny_dense, tmp_path_factory):
    """straight_run(devices) -> the run folder of an uninterrupted `train` on arith_cache with TRAIN
    and STRAIGHT options (12 steps over 2 epochs, step-12 saved), made once per device list."""
    runs: dict[str, Path] = {}

    def get(devices: str) -> Path:
        if devices not in runs:
            out = tmp_path_factory.mktemp("straight") / devices.replace(",", "-")
            r = run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN, *STRAIGHT,
                         "--devices", devices], timeout=600)
            assert r.returncode == 0, r.stderr
            runs[devices] = out
        return runs[devices]

    return get
