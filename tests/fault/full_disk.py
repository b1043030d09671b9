"""A device that fills up during extraction: run by tests/test_storage_faults.py in a mount namespace
of its own (`unshare --mount`, plus `--user --map-root-user` when not root), where it can mount a
small tmpfs without touching the machine's mounts.

Scenario: extract onto a 16 MB tmpfs (the cache and its logs), slowed so the run is still going
when, after the first commit, a filler file takes every free byte. The run must end with exit code 1
and one line naming the full device and saying how to resume; the committed shards must verify.
Then the filler goes and the same command resumes to a complete cache. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def cli(args, env=None, **kw):
    full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "dflash_offline", *map(str, args)], env=full, text=True,
                          capture_output=True, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--size-mb", type=int, default=16)
    ap.add_argument("opts", nargs="*", help="extract options after --")
    a = ap.parse_args()
    mnt = Path(a.workdir) / "small-disk"
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={a.size_mb}m", "tmpfs", str(mnt)], check=True)
    cache = mnt / "cache"
    args = ["extract", "--target", a.target, "--data", a.data, "--cache", cache, "--devices", "cpu", *a.opts]
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "dflash_offline", *map(str, args)], text=True,
                            env={**full, "PYTHONUNBUFFERED": "1", "DFLASH_OFFLINE_DELAY_AT": "batch-done:0.3"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out: dict = {}
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads((cache / "manifest.json").read_text())["shards"]:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    # Fill the device: every free block goes to the filler (the write fails with ENOSPC at the end).
    fd = os.open(mnt / "filler", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        out["filler_error"] = e.errno
    finally:
        os.close(fd)
    stdout, stderr = proc.communicate(timeout=240)
    m = json.loads((cache / "manifest.json").read_text())
    out.update(rc=proc.returncode, stderr=stderr, committed_at_failure=len(m["shards"]),
               num_shards=m["plan"]["num_shards"], status_after_failure=m["status"])
    (mnt / "filler").unlink()
    v = cli(["verify", cache])
    out.update(verify_rc=v.returncode, verify=v.stdout.strip())
    st = cli(["status", cache, "--json"])
    out["status_last_error"] = (json.loads(st.stdout).get("last_error") or {}).get("error") if st.returncode == 0 else None
    r = cli(args)
    out.update(resume_rc=r.returncode, resume_stderr=r.stderr[-2000:])
    m = json.loads((cache / "manifest.json").read_text())
    out["shards"] = [[s["name"], s["samples"], s["tokens"], s["checksum"], json.dumps(s["sample_ids"])]
                     for s in m["shards"]]
    out["left_in_shards"] = sorted(os.listdir(cache / "shards"))
    out["status"] = m["status"]
    subprocess.run(["umount", str(mnt)], check=False)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
