"""Worker count and crashes do not change the cache.

- Two CPU workers write the same shards, byte for byte, as one.
- SIGKILL of the whole extract (launcher and workers) at exact points (mid-shard, after a shard's
  rename but before its commit, after the manifest's temporary file but before its replace, right
  after a commit), then the same command again: the cache equals an uninterrupted run's, sample for
  sample (same shard checksums), with no duplicates, no missing rows and no debris; the killed run
  leaves no shared-memory segment behind.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import RESUME_OPTS, run_cli, run_tree
from dflash_offline.cache.reader import CacheReader

OPTS = RESUME_OPTS


def extract(target, data, cache, devices="cpu", env=None):
    return run_cli(["extract", "--target", str(target), "--data", str(data), "--cache", str(cache),
                    "--devices", devices, *OPTS], env=env)


def shard_table(cache) -> list[tuple]:
    m = json.loads((cache / "manifest.json").read_text())
    return [(s["name"], s["samples"], s["tokens"], s["checksum"], json.dumps(s["sample_ids"])) for s in m["shards"]]


def assert_no_debris(cache) -> None:
    m = json.loads((cache / "manifest.json").read_text())
    names = {f"{s['name']}.zarr" for s in m["shards"]}
    assert set(os.listdir(cache / "shards")) == names
    assert not [f for f in os.listdir(cache) if f.startswith("manifest.json.tmp")]


def test_two_workers_equal_one(extract_reference, tiny_dense, tiny_data, tmp_path):
    cache = tmp_path / "cache"
    r = extract(tiny_dense, tiny_data, cache, devices="cpu,cpu")
    assert r.returncode == 0, r.stderr
    assert shard_table(cache) == shard_table(extract_reference)
    assert (cache / "logs" / "extract-rank1.log").exists()
    a, b = CacheReader(str(extract_reference)), CacheReader(str(cache))
    for sa in a.samples():
        sb = b.sample(sa.sample_id)
        np.testing.assert_array_equal(sa.hidden_bits, sb.hidden_bits)
        np.testing.assert_array_equal(sa.topk_ids, sb.topk_ids)
    assert b.verify() == []


def _mapped(segment: str) -> bool:
    """Whether a live process maps /dev/shm/SEGMENT."""
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if f"/dev/shm/{segment}" in maps.read_text():
                return True
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    return False


def _survivors(mark: str) -> list[int]:
    """Live processes whose environment holds `mark`."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"DFLASH_TEST_RUN_MARK={mark}".encode() in env.read_bytes():
                found.append(int(env.parent.name))
        except OSError:
            continue
    return found


def _segments() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("psm_")}
    except FileNotFoundError:
        return set()


# Mid-shard kills of one worker (a half-written temporary shard on disk) are covered by the
# two-worker case below and by the random kills of tests/fault/campaign.py (test_crash_campaign.py).
@pytest.mark.parametrize("point, devices", [
    ("shard-renamed:2", "cpu"),          # shard complete and renamed, manifest not yet updated
    ("manifest-tmp-written:3", "cpu"),   # new manifest written under a temporary name, not replaced
    ("shard-committed:4", "cpu"),        # right after a commit
    ("batch-written:5", "cpu,cpu"),      # two workers, one kills the whole group mid-shard
])
def test_sigkill_then_resume_equals_uninterrupted(point, devices, extract_reference, tiny_dense, tiny_data, tmp_path):
    cache = tmp_path / "cache"
    mark = f"kill-{uuid.uuid4().hex}"  # in the environment of every process of this run
    env = {**os.environ, "DFLASH_OFFLINE_KILL_AT": point, "DFLASH_TEST_RUN_MARK": mark}
    segments = _segments()
    r = extract(tiny_dense, tiny_data, cache, devices=devices, env=env)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    # The killed processes (workers and their writers) leave no shared-memory segment behind,
    # whenever the kill comes (here: with two workers, one may still be starting its writers; named
    # segments would leak then, the anonymous ones extract uses cannot). Tests run side by side
    # (xdist): a segment another run holds is mapped by a live process; a leaked one by nobody.
    # (multiprocessing's own queue semaphores, /dev/shm/sem.mp-*, do stay after a SIGKILL of the
    # group, its resource tracker included: 32 bytes each.)
    assert {seg for seg in _segments() - segments if not _mapped(seg)} == set()
    # The slots are anonymous memory, freed with the last process that maps them: no process of
    # the killed run may survive it.
    assert _survivors(mark) == []
    m = json.loads((cache / "manifest.json").read_text())
    assert m["status"] == "extracting"
    before = len(m["shards"])
    assert before < m["plan"]["num_shards"]
    # Every committed shard is already whole and matches its checksum.
    assert CacheReader(str(cache)).verify() == []

    r = extract(tiny_dense, tiny_data, cache, devices="cpu")
    assert r.returncode == 0, r.stderr
    assert shard_table(cache) == shard_table(extract_reference)
    assert_no_debris(cache)
    ids = sorted(s.sample_id for s in CacheReader(str(cache)).samples())
    assert ids == list(range(48))  # no duplicates, none missing
    log = (cache / "logs" / "extract-rank0.log").read_text()
    assert f"({before} already committed in all)" in log


def test_rerun_of_complete_cache_does_nothing(extract_reference, tiny_dense, tiny_data):
    before = (extract_reference / "manifest.json").read_bytes()
    r = extract(tiny_dense, tiny_data, extract_reference)
    assert r.returncode == 0, r.stderr
    assert (extract_reference / "manifest.json").read_bytes() == before
    assert "complete" in r.stdout


def test_torchrun_ranks_equal_launcher(extract_reference, tiny_dense, tiny_data, tmp_path):
    """The same command under torchrun (one rank per process, no launcher) writes the same cache."""
    import sys

    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = run_tree(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "dflash_offline", "extract", "--target", str(tiny_dense), "--data", str(tiny_data),
         "--cache", str(cache), "--devices", "cpu", *OPTS],
        env=env, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert shard_table(cache) == shard_table(extract_reference)
    assert (cache / "logs" / "extract-rank0.log").exists() and (cache / "logs" / "extract-rank1.log").exists()
    assert "complete" in r.stdout


def test_config_recipe_and_cli_override(tiny_dense, tiny_data, tmp_path):
    """--config keys fill the options; a value typed on the command line wins over the recipe."""
    cache = tmp_path / "cache"
    recipe = tmp_path / "extract.toml"
    recipe.write_text(
        f'target = "{tiny_dense}"\ndata = ["{tiny_data}"]\ncache = "{cache}"\ndevices = "cpu"\n'
        'capture_layers = [1, 3]\ntopk = 4\nmax-len = 64\nbatch_tokens = 256\nshard_tokens = 4096\nprogress = false\n'
    )
    r = run_cli(["extract", "--config", str(recipe), "--topk", "2"])
    assert r.returncode == 0, r.stderr
    m = json.loads((cache / "manifest.json").read_text())
    assert m["capture"] == {"layer_ids": [1, 3], "topk": 2, "hidden_dtype": "bfloat16", "max_len": 64,
                            "compute_dtype": "float32"}
    assert m["plan"]["shard_tokens"] == 4096
    assert max(s.input_ids.shape[0] for s in CacheReader(str(cache)).samples()) == 64


def test_fsspec_url_cache_equals_path_cache(extract_reference, tiny_dense, tiny_data, tmp_path):
    """An fsspec URL goes through fsspec/zarr's FsspecStore (here the `local://` backend) and
    writes the same shards; a crash and resume work there too."""
    url = f"local://{tmp_path / 'cache'}"
    logs = ["--log-dir", str(tmp_path / "logs")]
    r = run_cli(["extract", "--target", str(tiny_dense), "--data", str(tiny_data), "--cache", url,
                 "--devices", "cpu", *OPTS, *logs], env={**os.environ, "DFLASH_OFFLINE_KILL_AT": "shard-renamed:2"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    r = run_cli(["extract", "--target", str(tiny_dense), "--data", str(tiny_data), "--cache", url,
                 "--devices", "cpu", *OPTS, *logs])
    assert r.returncode == 0, r.stderr
    assert shard_table(tmp_path / "cache") == shard_table(extract_reference)
    assert_no_debris(tmp_path / "cache")
    assert CacheReader(url).verify() == []


def test_second_run_refused_and_workers_die_with_launcher(tiny_dense, tiny_data, tmp_path):
    """While an extract runs on a cache, another is refused (one line, exit 2); SIGKILL of the
    launcher alone takes its worker down too (no orphan keeps writing), and a rerun completes."""
    import re
    import subprocess
    import sys
    import time

    cache = tmp_path / "cache"
    args = [sys.executable, "-m", "dflash_offline", "extract", "--target", str(tiny_dense), "--data", str(tiny_data),
            "--cache", str(cache), "--devices", "cpu", *OPTS]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = cache / "logs" / "extract-launcher.log"
    deadline = time.time() + 120
    pid = None
    while time.time() < deadline and pid is None:
        found = re.search(r"started 1 worker processes: (\d+) on cpu", log.read_text() if log.exists() else "")
        pid = int(found.group(1)) if found else None
        time.sleep(0.1)
    assert pid is not None, "the first run never started its worker"
    second = run_cli(["extract", "--target", str(tiny_dense), "--data", str(tiny_data), "--cache", str(cache),
                      "--devices", "cpu", *OPTS])
    assert second.returncode == 2 and "another extract is running" in second.stderr
    assert second.stderr.strip().count("\n") == 0
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"worker {pid} outlived its launcher")
    r = extract(tiny_dense, tiny_data, cache)
    assert r.returncode == 0, r.stderr
    assert_no_debris(cache)
