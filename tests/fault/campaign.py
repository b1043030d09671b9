"""Crash campaign: SIGKILL each stage's process tree at random moments, resume, compare.

For each stage, one uninterrupted reference run, then one run killed with SIGKILL (the whole
process group: launcher, workers, writer and loader processes) at `--kills` random moments, each
followed by the same command again:

  extract  after every kill, every committed shard equals the reference's shard of that name
           (samples, ids, checksum); at the end the whole cache equals the reference.
  train    after every kill, every step in metrics.jsonl has the reference's loss, bit for bit;
           at the end all losses and the final weights equal the reference's.

The moments are uniform over the reference run's wall time (start-up included), from a seeded
generator, so they land in imports, model loads, forwards, writes, commits, checkpoints. A resumed
run that finishes before its moment is checked against the reference and the campaign starts that
stage over, so every kill counted hits a run with work left.

    python tests/fault/campaign.py --kills 20          # the full campaign (a few minutes on 2 cores)
    python tests/fault/campaign.py --kills 2 --seed 1  # what CI runs (tests/test_crash_campaign.py)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRACT = ["--devices", "cpu", "--topk", "4", "--max-len", "128", "--batch-tokens", "512", "--shard-tokens", "1024",
           "--no-progress"]
TRAIN = ["--seq-len", "256", "--num-anchors", "16", "--block-size", "8", "--global-batch-tokens", "512",
         "--lr", "3e-3", "--mask-token-id", "1", "--num-layers", "2", "--loader-workers", "0", "--epochs", "2",
         "--max-steps", "16", "--checkpoint-every", "3", "--no-progress"]


def _env() -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DFLASH_OFFLINE_KILL_AT")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(args: list[str], log: Path, kill_after: float | None) -> tuple[int, float]:
    """Run the CLI in its own process group; SIGKILL the group after `kill_after` seconds.
    Returns (exit code, seconds)."""
    t0 = time.time()
    with open(log, "a") as f:
        p = subprocess.Popen([sys.executable, "-m", "dflash_offline", *args], stdout=f, stderr=subprocess.STDOUT,
                             cwd=ROOT, env=_env(), start_new_session=True)
        try:
            p.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        try:
            os.killpg(p.pid, signal.SIGKILL)  # nothing of the tree may outlive the run
        except ProcessLookupError:
            pass
    return p.returncode, time.time() - t0


def _shards(cache: Path) -> dict[str, tuple]:
    try:
        m = json.loads((cache / "manifest.json").read_text())
    except FileNotFoundError:
        return {}
    return {s["name"]: (s["samples"], s["tokens"], s["checksum"], json.dumps(s["sample_ids"])) for s in m["shards"]}


def _losses(out: Path) -> dict[int, float]:
    got = {}
    path = out / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                continue
            got[r["step"]] = r["loss"]
    return got


def _weights(out: Path) -> dict:
    from safetensors.numpy import load_file

    steps = sorted(int(p.name[5:]) for p in out.glob("step-*") if p.name[5:].isdigit())
    return load_file(str(out / f"step-{steps[-1]}" / "drafter.safetensors")) if steps else {}


def campaign(stage: str, args_for, check, final, kills: int, rng: random.Random, work: Path) -> tuple[int, int, bool]:
    """Reference run, then a run killed `kills` times and resumed after each.
    Returns (kills after which all was identical so far, kills, the resumed end identical)."""
    ref_dir, dut = work / f"{stage}-ref", work / f"{stage}-killed"
    rc, ref_s = _run(args_for(ref_dir), work / f"{stage}-ref.log", None)
    if rc != 0:
        raise SystemExit(f"{stage}: the reference run failed ({rc}); see {work / f'{stage}-ref.log'}")
    ok = done = 0
    end = True
    log = work / f"{stage}-killed.log"
    while done < kills:
        at = rng.uniform(0.3, ref_s)
        rc, _ = _run(args_for(dut), log, at)
        if rc == 0:
            # The resumed run finished before this moment came: check it, and start the next
            # kills from scratch, so that every kill counted hits a run with work left.
            same = final(ref_dir, dut)
            end &= same
            print(f"  {stage}: finished before {at:.1f}s, {'identical' if same else 'DIFFERS'}; starting over",
                  flush=True)
            shutil.rmtree(dut)
            continue
        done += 1
        same = check(ref_dir, dut)
        ok += same
        print(f"  {stage} kill {done}/{kills} at {at:5.1f}s: {'identical so far' if same else 'DIFFERS'}", flush=True)
    rc, _ = _run(args_for(dut), log, None)
    same = rc == 0 and final(ref_dir, dut)
    end &= same
    print(f"  {stage} resumed to the end: {'identical' if same else 'DIFFERS (exit %d)' % rc}", flush=True)
    return ok, kills, end


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs per stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="folder for targets, caches, runs and logs (default: a temp folder)")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="dflash-campaign-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from dflash_offline.tiny import make_tiny_data, make_tiny_target

    target = make_tiny_target(work / "target", kind="qwen3")
    data = make_tiny_data(work / "data.parquet", rows=64, min_len=40, max_len=120, pattern="arith", seed=3)
    rng = random.Random(args.seed)
    t0 = time.time()
    print(f"crash campaign: {args.kills} kills per stage, seed {args.seed}, in {work}", flush=True)

    def extract_args(cache: Path) -> list[str]:
        return ["extract", "--target", str(target), "--data", str(data), "--cache", str(cache), *EXTRACT]

    def shards_match(ref: Path, dut: Path) -> bool:
        a, b = _shards(ref), _shards(dut)
        return all(a.get(k) == v for k, v in b.items())

    ex = campaign("extract", extract_args, shards_match, lambda r, d: _shards(r) == _shards(d), args.kills, rng, work)

    cache = work / "extract-ref"

    def train_args(out: Path) -> list[str]:
        return ["train", "--target", str(target), "--cache", str(cache), "--out", str(out), *TRAIN]

    def losses_match(ref: Path, dut: Path) -> bool:
        a, b = _losses(ref), _losses(dut)
        return all(a.get(k) == v for k, v in b.items())

    def run_matches(ref: Path, dut: Path) -> bool:
        import numpy as np

        a, b = _losses(ref), _losses(dut)
        wa, wb = _weights(ref), _weights(dut)
        return (a == b and wa.keys() == wb.keys() and len(wa) > 0
                and all(np.array_equal(wa[k], wb[k]) for k in wa))

    tr = campaign("train", train_args, losses_match, run_matches, args.kills, rng, work)
    ok, total = ex[0] + tr[0], ex[1] + tr[1]
    ends = ("both resumed runs identical to the reference" if ex[2] and tr[2] else
            f"resumed run DIFFERS: extract {'ok' if ex[2] else 'differs'}, train {'ok' if tr[2] else 'differs'}")
    print(f"{ok}/{total} identical (extract {ex[0]}/{ex[1]}, train {tr[0]}/{tr[1]}); {ends}; "
          f"{time.time() - t0:.0f}s", flush=True)
    return 0 if ok == total and ex[2] and tr[2] else 1


if __name__ == "__main__":
    sys.exit(main())
