"""`train --profile-steps N`: torch.profiler over N optimizer steps, to say where a step's time goes.

The training loop names its phases with `phase("...")` (torch.profiler.record_function: a few
microseconds when no profiler listens). The profiled window starts `skip` steps after the run's
first step, so the flex kernels' compilation and the loaders' warm-up are not in it. Written per
rank under OUT/profile/:
  rank{R}-steps{A}-{B}.json   a Chrome / Perfetto trace (open in ui.perfetto.dev);
  rank{R}-steps{A}-{B}.txt    the phases' and the top operators' times, CPU and device.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("dflash_offline.train.launcher")

PHASES = ("data", "to-device", "mask", "forward", "loss", "backward", "optimizer", "metrics", "held-out", "checkpoint")


def phase(name: str):
    """A named range of the step (shows in traces and in the profile's phase table)."""
    return torch.profiler.record_function(f"phase/{name}")


class StepProfiler:
    def __init__(self, out: Path, rank: int, cuda: bool, steps: int, first_step: int, skip: int = 5):
        self.dir = Path(out) / "profile"
        self.rank, self.cuda, self.steps = rank, cuda, steps
        self.begin = first_step + skip + 1  # the step number (1-based) the window starts at
        self.prof = None
        self.t0 = 0.0

    def before(self, step: int) -> None:
        """Called before the step that will be number `step` (1-based)."""
        if self.prof is None and step == self.begin:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def after(self, step: int) -> None:
        """Called after step `step` finished (its metrics synced with the device)."""
        if self.prof is None or step != self.begin + self.steps - 1:
            return
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        prof, self.prof = self.prof, None
        self.begin = -1  # once per run
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = self.dir / f"rank{self.rank}-steps{step - self.steps + 1}-{step}"
        prof.export_chrome_trace(str(stem) + ".json")
        events = prof.key_averages()
        dev = "device_time_total" if self.cuda else "cpu_time_total"
        rows = []
        for e in events:
            if e.key.startswith("phase/"):
                rows.append((e.key[6:], e.cpu_time_total / 1e3 / self.steps,
                             getattr(e, "device_time_total", 0.0) / 1e3 / self.steps, e.count // self.steps))
        order = {p: i for i, p in enumerate(PHASES)}
        rows.sort(key=lambda r: order.get(r[0], len(order)))
        lines = [f"{self.steps} steps, {wall / self.steps * 1e3:.1f} ms per step (wall, profiler on)", "",
                 f"{'phase':<12} {'cpu ms/step':>12} {'device ms/step':>15} {'calls/step':>11}"]
        lines += [f"{n:<12} {c:>12.2f} {d:>15.2f} {k:>11}" for n, c, d, k in rows]
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        lines += ["", events.table(sort_by=sort, row_limit=40)]
        Path(str(stem) + ".txt").write_text("\n".join(lines) + "\n")
        log.info("profile of steps %d-%d: %.1f ms per step; %s",
                 step - self.steps + 1, step, wall / self.steps * 1e3,
                 ", ".join(f"{n} {c:.1f}/{d:.1f} ms" for n, c, d, _ in rows) + " (cpu/device per step)")
        log.info("profile written to %s.txt and .json (%s)", stem, dev)
