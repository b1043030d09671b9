"""Crash campaign: SIGKILL each stage's process tree at random moments, resume, compare.

For each stage, one uninterrupted reference run, then one run killed with SIGKILL (the whole
process group: launcher, workers, writer and loader processes) at `--kills` random moments, each
followed by the same command again:

  extract  after every kill, every committed shard equals the reference's shard of that name
           (samples, ids, checksum); at the end the whole cache equals the reference.
  train    after every kill, every step in metrics.jsonl has the reference's loss, bit for bit;
           at the end all losses and the final weights equal the reference's.

A quarter of the moments fall in start-up (imports, model load), the rest in the work: after a
random number of the units left (shards committed, steps logged) plus a random part of one unit's
time, so inside a shard or a step, from a seeded generator. A run that finishes before its moment
is checked against the reference and the stage starts over, so every kill counted hits a run with
work left; only an exit by SIGKILL counts as a kill (any other failure stops the campaign).

    python tests/fault/campaign.py --kills 20          # the full campaign (a few minutes on 2 cores)
    python tests/fault/campaign.py --kills 2 --seed 1 --rows 96 --steps 16  # CI (tests/test_crash_campaign.py)
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
         "--lr", "3e-3", "--mask-token-id", "1", "--drafter-layers", "2", "--loader-workers", "0", "--epochs", "2",
         "--checkpoint-every", "3", "--no-progress"]


def _env() -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DFLASH_OFFLINE_KILL_AT")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(args: list[str], log: Path, kill_when=None, progress=None) -> tuple[int, float, float | None]:
    """Run the CLI in its own process group. `kill_when(seconds)` is polled every 10 ms; when it
    says so, the whole group gets SIGKILL. With `progress`, also returns the time its first unit
    of work appeared. Returns (exit code, seconds, time of first progress or None)."""
    t0 = time.time()
    first = None
    with open(log, "a") as f:
        p = subprocess.Popen([sys.executable, "-m", "dflash_offline", *args], stdout=f, stderr=subprocess.STDOUT,
                             cwd=ROOT, env=_env(), start_new_session=True)
        while p.poll() is None:
            if progress is not None and first is None and progress() > 0:
                first = time.time() - t0
            if kill_when is not None and kill_when(time.time() - t0):
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                break
            time.sleep(0.01)
        try:
            os.killpg(p.pid, signal.SIGKILL)  # nothing of the tree may outlive the run
        except ProcessLookupError:
            pass
    return p.returncode, time.time() - t0, first


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


def campaign(stage: str, args_for, progress_of, total_units: int, check, final, kills: int, rng: random.Random,
             work: Path) -> tuple[int, int, bool]:
    """Reference run, then a run killed `kills` times and resumed after each.

    A kill lands either in start-up (a quarter of them: a moment before the reference's first unit
    of work) or in the work: once the run has done a random number of the units left (shards
    committed, steps logged), plus a random part of one unit's time, so it falls inside a shard or
    a step. Returns (kills after which all was identical so far, kills, the resumed end identical).
    """
    ref_dir, dut = work / f"{stage}-ref", work / f"{stage}-killed"
    rc, ref_s, ref_first = _run(args_for(ref_dir), work / f"{stage}-ref.log", progress=lambda: progress_of(ref_dir))
    if rc != 0 or ref_first is None:
        raise SystemExit(f"{stage}: the reference run failed ({rc}); see {work / f'{stage}-ref.log'}")
    unit_s = (ref_s - ref_first) / max(1, total_units)
    ok = done = 0
    end = True
    log = work / f"{stage}-killed.log"
    while done < kills:
        before = progress_of(dut)
        if before >= total_units:
            # Nothing left to kill: finish the run, check it, and start the stage over.
            rc, _, _ = _run(args_for(dut), log)
            same = rc == 0 and final(ref_dir, dut)
            end &= same
            print(f"  {stage}: all done, resumed to the end: {'identical' if same else 'DIFFERS'}; starting over",
                  flush=True)
            shutil.rmtree(dut)
            continue
        if rng.random() < 0.25:
            at = rng.uniform(0.3, ref_first)
            where = f"start-up, {at:.1f}s"
            kill_when = lambda t, at=at: t >= at  # noqa: E731
        else:
            target = before + rng.randint(1, total_units - before)  # reached only by this run's own work
            extra = rng.uniform(0.0, unit_s)
            where = f"{stage} unit {target} + {extra * 1e3:.0f} ms"
            reached = [None]

            def kill_when(t, target=target, extra=extra, reached=reached):
                if reached[0] is None and progress_of(dut) >= target:
                    reached[0] = t
                return reached[0] is not None and t >= reached[0] + extra
        rc, _, _ = _run(args_for(dut), log, kill_when)
        if rc == 0:
            # The run finished before its moment came: check it, and start the next kills from
            # scratch, so that every kill counted hits a run with work left.
            same = final(ref_dir, dut)
            end &= same
            print(f"  {stage}: finished before the kill ({where}), {'identical' if same else 'DIFFERS'}; "
                  "starting over", flush=True)
            shutil.rmtree(dut)
            continue
        if rc != -signal.SIGKILL:
            raise SystemExit(f"{stage}: a run failed by itself with exit code {rc}; see {log}")
        done += 1
        same = check(ref_dir, dut)
        ok += same
        print(f"  {stage} kill {done}/{kills} ({where}; done before/after: {before}/{progress_of(dut)} of "
              f"{total_units}): {'identical so far' if same else 'DIFFERS'}", flush=True)
    rc, _, _ = _run(args_for(dut), log)
    same = rc == 0 and final(ref_dir, dut)
    end &= same
    print(f"  {stage} resumed to the end: {'identical' if same else 'DIFFERS (exit %d)' % rc}", flush=True)
    return ok, kills, end


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs per stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=192, help="input rows (192: 16 shards)")
    ap.add_argument("--steps", type=int, default=40, help="training steps")
    ap.add_argument("--work", default=None, help="folder for targets, caches, runs and logs (default: a temp folder)")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="dflash-campaign-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from dflash_offline.tiny import make_tiny_data, make_tiny_target

    target = make_tiny_target(work / "target", kind="qwen3")
    data = make_tiny_data(work / "data.parquet", rows=args.rows, min_len=40, max_len=120, pattern="arith", seed=3)
    rng = random.Random(args.seed)
    t0 = time.time()
    print(f"crash campaign: {args.kills} kills per stage, seed {args.seed}, in {work}", flush=True)

    def extract_args(cache: Path) -> list[str]:
        return ["extract", "--target", str(target), "--data", str(data), "--cache", str(cache), *EXTRACT]

    def shards_match(ref: Path, dut: Path) -> bool:
        a, b = _shards(ref), _shards(dut)
        return all(a.get(k) == v for k, v in b.items())

    from dflash_offline.extract.plan import make_plan

    import pyarrow.parquet as pq

    lengths = pq.read_table(data).column("input_ids").combine_chunks()
    num_shards = len(make_plan(lengths.value_lengths().to_numpy(), 128, 1024, 8192))
    ex = campaign("extract", extract_args, lambda c: len(_shards(c)), num_shards, shards_match,
                  lambda r, d: _shards(r) == _shards(d), args.kills, rng, work)

    cache = work / "extract-ref"

    def train_args(out: Path) -> list[str]:
        return ["train", "--target", str(target), "--cache", str(cache), "--out", str(out), *TRAIN,
                "--max-steps", str(args.steps)]

    def losses_match(ref: Path, dut: Path) -> bool:
        a, b = _losses(ref), _losses(dut)
        return all(a.get(k) == v for k, v in b.items())

    def run_matches(ref: Path, dut: Path) -> bool:
        import numpy as np

        a, b = _losses(ref), _losses(dut)
        wa, wb = _weights(ref), _weights(dut)
        return (a == b and wa.keys() == wb.keys() and len(wa) > 0
                and all(np.array_equal(wa[k], wb[k]) for k in wa))

    tr = campaign("train", train_args, lambda o: max(_losses(o), default=0), args.steps, losses_match, run_matches,
                  args.kills, rng, work)
    ok, total = ex[0] + tr[0], ex[1] + tr[1]
    ends = ("both resumed runs identical to the reference" if ex[2] and tr[2] else
            f"resumed run DIFFERS: extract {'ok' if ex[2] else 'differs'}, train {'ok' if tr[2] else 'differs'}")
    print(f"{ok}/{total} identical (extract {ex[0]}/{ex[1]}, train {tr[0]}/{tr[1]}); {ends}; "
          f"{time.time() - t0:.0f}s", flush=True)
    return 0 if ok == total and ex[2] and tr[2] else 1


if __name__ == "__main__":
    sys.exit(main())
