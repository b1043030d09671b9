"""What `verify --content` costs against the extraction it checks, side by side in one run.

Extracts a training cache of the pycode fixture's completions as its scoreboard does (layers 1-6,
fp8 hidden states, top-32, an fp32 forward), then checks P% of its samples against a fresh forward
of the target (`verify CACHE --content P% --target T`), on the same device, each as a user runs
it (its own process, wall time from start to exit, model load included):

    python benchmarks/content_check.py --fixture ../shared/fixtures/pycode --work /tmp/cc --device cpu
    python benchmarks/content_check.py --fixture ../shared/fixtures/pycode --work /dev/shm/cc --device 0

Prints both times and their ratio; --json writes them with the hardware and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dflash_offline", *cmd], capture_output=True, text=True,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return dt, r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default="../shared/fixtures/pycode")
    ap.add_argument("--data", default=None, help="rows to extract (default: the fixture's completions-train.parquet)")
    ap.add_argument("--work", required=True, help="a folder for the cache (made anew)")
    ap.add_argument("--device", default="cpu", help="cpu, or a GPU index")
    ap.add_argument("--share", default="1%", help="the share of the cache's samples checked")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    fx, work = Path(args.fixture).absolute(), Path(args.work).absolute()
    data = Path(args.data).absolute() if args.data else fx / "completions-train.parquet"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cache = work / "cache"
    devices = "cpu" if args.device == "cpu" else args.device
    t_extract, _ = timed(["extract", "--target", str(fx / "target"), "--data", str(data), "--cache", str(cache),
                          "--devices", devices, "--capture-layers", "1,2,3,4,5,6", "--hidden-dtype", "fp8", "--topk", "32",
                          "--max-len", "512", "--compute-dtype", "float32", "--no-progress"])
    t_verify, out = timed(["verify", str(cache), "--content", args.share, "--target", str(fx / "target"), "--devices",
                           args.device])
    m = json.loads((cache / "manifest.json").read_text())
    res = {"extract_s": t_extract, "verify_content_s": t_verify, "ratio": t_verify / t_extract, "share": args.share,
           "samples": m["totals"]["samples"], "tokens": m["totals"]["tokens"], "verify_line": out.strip().splitlines()[-1],
           "device": args.device, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "python": platform.python_version()}
    import torch

    res["torch"] = torch.__version__
    if args.device != "cpu":
        res["gpu"] = torch.cuda.get_device_name(int(args.device))
    print(f"extract {m['totals']['samples']} samples ({m['totals']['tokens']} tokens): {t_extract:.1f} s")
    print(f"verify --content {args.share}: {t_verify:.1f} s = {100 * res['ratio']:.1f}% of the extraction")
    print(res["verify_line"])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
