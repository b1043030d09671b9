"""Storage faults: a device that fills up during extraction, and shards cut short or missing chunks.

- Full device: the run ends with one line that names the device and says how to resume, the
  committed shards verify, and once space is freed the same command completes the cache, equal to
  an uninterrupted run (tests/fault/full_disk.py, on a 16 MB tmpfs in a mount namespace of its own).
- Truncated or missing chunk files are found by `verify`, which names the shard, and by a reader.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import RESUME_OPTS, ROOT, run_cli, run_tree
from test_extract_resume import shard_table


def namespace_prefix() -> list[str] | None:
    """The command prefix that runs a process in a mount namespace where it may mount a tmpfs."""
    if shutil.which("unshare") is None:
        return None
    prefix = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    probe = subprocess.run([*prefix, "sh", "-c", "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d"],
                           capture_output=True, text=True)
    return prefix if probe.returncode == 0 else None


def test_full_device_during_extraction_then_resume(extract_reference, tiny_dense, tiny_data, tmp_path):
    prefix = namespace_prefix()
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (no unshare, or user namespaces are disabled)")
    r = run_tree([*prefix, sys.executable, str(ROOT / "tests" / "fault" / "full_disk.py"), "--target", tiny_dense,
                  "--data", tiny_data, "--workdir", tmp_path, "--", *RESUME_OPTS], timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["filler_error"] == 28  # ENOSPC: the device really was full
    assert out["rc"] == 1, out
    lines = out["stderr"].strip().splitlines()
    assert len(lines) == 1, out["stderr"]  # one line, no traceback or "Exception ignored" noise
    assert lines[0].startswith("failed: no space left on the device of ") and "No space left on device" in lines[0]
    assert f"{out['committed_at_failure']}/{out['num_shards']} shards committed, none half-written" in lines[0]
    assert "free space" in lines[0] and "run the same command again to resume" in lines[0]
    assert 1 <= out["committed_at_failure"] < out["num_shards"] and out["status_after_failure"] == "extracting"
    assert out["verify_rc"] == 0 and out["verify"].startswith(f"{out['committed_at_failure']}/"), out["verify"]
    assert "No space left on device" in (out["status_last_error"] or ""), out
    assert out["resume_rc"] == 0, out["resume_stderr"]
    assert out["status"] == "complete"
    assert [tuple(s) for s in out["shards"]] == shard_table(extract_reference)
    assert out["left_in_shards"] == [f"{s[0]}.zarr" for s in out["shards"]]  # the failed shard's debris is gone


def _chunks(shard: Path) -> list[Path]:
    return sorted(p for p in (shard / "hidden").rglob("*") if p.is_file() and p.name != "zarr.json")


@pytest.mark.parametrize("damage", ["truncated-chunk", "missing-chunk", "emptied-chunk"])
def test_verify_and_reader_name_a_shard_cut_short(damage, extract_reference, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(extract_reference, cache)
    shard = cache / "shards" / "shard-000003.zarr"
    chunk = _chunks(shard)[-1]
    if damage == "truncated-chunk":
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    elif damage == "missing-chunk":
        chunk.unlink()
    else:
        chunk.write_bytes(b"")
    r = run_cli(["verify", cache])
    assert r.returncode == 1 and "damaged: shard-000003" in r.stderr, (r.stdout, r.stderr)
    assert r.stdout.startswith("6/7 shards match their checksums"), r.stdout

    from dflash_offline.cache.reader import CacheReader

    reader = CacheReader(str(cache))
    assert reader.verify() == ["shard-000003"]
    with pytest.raises(Exception, match="shard-000003"):
        for s in reader.samples():
            pass
