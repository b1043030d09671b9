"""Held-out evaluation during training (--eval-cache): the walk estimate of decoding tau, measured
every --eval-every steps; the best drafter so far is kept in OUT/best/."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from dflash_offline.options import where
from dflash_offline.train.config import TrainConfig
from dflash_offline.runtime.logs import heartbeat
from dflash_offline.runs.folder import BEST, HELD_OUT_LOG

log = logging.getLogger("dflash.train")


class HeldOut:
    """The walk estimate of decoding tau on a held-out cache (blocks.walk.walk_acceptance), measured
    by rank 0 while the other ranks wait; the best drafter so far is exported to OUT/best/ and
    described in OUT/best.json (written after the export: a best.json always names a complete
    best/). Every measurement is a line of OUT/heldout.jsonl."""

    def __init__(self, cfg: TrainConfig, out: Path, drafter, device: str, rank: int, world: int):
        self.cfg, self.out, self.drafter, self.device, self.rank, self.world = cfg, out, drafter, device, rank, world
        self.best = None
        self.t0 = time.perf_counter()  # the curve of tau against training time
        f = out / "best.json"
        if rank == 0 and f.is_file() and (out / BEST).is_dir():
            try:
                self.best = json.loads(f.read_text())
            except json.JSONDecodeError:  # cut by a kill: the next measurement rewrites it
                self.best = None

    def measure(self, step: int) -> None:
        import torch.distributed as dist

        if self.world > 1:
            dist.barrier()
        if self.rank == 0:
            from dflash_offline.drafter.export import export_drafter
            from dflash_offline.blocks.walk import walk_acceptance

            heartbeat(phase="held-out evaluation", step=step)
            t0 = time.perf_counter()
            est = walk_acceptance(self.cfg.eval_cache, self.drafter, self.device, max_samples=self.cfg.eval_samples,
                                  option=where(self.cfg, "eval_cache"))
            rec = {"step": step, "tau_pooled": est["tau_pooled"], "tau_per_prompt_mean": est["tau_per_prompt_mean"],
                   "tau_all_anchors": est["tau_all_anchors"], "rounds": est["rounds"], "samples": est["samples"],
                   "seconds": time.perf_counter() - t0, "train_s": t0 - self.t0}
            better = self.best is None or rec["tau_pooled"] > self.best["tau_pooled"]
            if better:
                export_drafter(self.drafter, str(self.out / BEST), notes=False)  # the final export says them
                tmp = self.out / "best.json.tmp"
                tmp.write_text(json.dumps(rec, indent=1) + "\n")
                os.replace(tmp, self.out / "best.json")
                self.best = rec
            with open(self.out / HELD_OUT_LOG, "a") as f:
                f.write(json.dumps({**rec, "best": better}) + "\n")
            log.info("held-out walk estimate at step %d: tau %.3f pooled, %.3f per-prompt mean (random anchors %.3f), "
                     "%d samples in %.1fs%s", step, rec["tau_pooled"], rec["tau_per_prompt_mean"],
                     rec["tau_all_anchors"], rec["samples"], rec["seconds"], "; best so far -> best/" if better else "")
        if self.world > 1:
            dist.barrier()
