"""The crash campaign of tests/fault/campaign.py in its reduced form: two SIGKILLs of each stage's
process tree at random (seeded) moments, each followed by a resume; the cache and the training
run must equal uninterrupted runs (shards by checksum; losses and final weights bit for bit).
The full campaign is `python tests/fault/campaign.py --kills 20` (docs/reliability.md)."""

from __future__ import annotations

import sys

from conftest import ROOT, run_tree


def test_reduced_crash_campaign(tmp_path):
    r = run_tree([sys.executable, str(ROOT / "tests" / "fault" / "campaign.py"), "--kills", "2", "--seed", "1",
                  "--rows", "96", "--steps", "16",
                  "--work", str(tmp_path)], timeout=600, cwd=ROOT)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "4/4 identical" in r.stdout and "both resumed runs identical" in r.stdout
