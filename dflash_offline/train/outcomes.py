"""How a training run ends before its last step, the same on every rank: a non-finite loss or
gradient (TrainingDiverged), or a stop request that the ranks agree on; the lines that say so."""

from __future__ import annotations

from pathlib import Path

from dflash_offline.runtime.signals import signal_name, stop_requested
from dflash_offline.runs.checkpoint import CHECKPOINT_PREFIX, list_checkpoints


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm: the run stops before that step's update, exports nothing."""


def diverged_message(loss_flags, gnorm: float, step: int, out: Path, last_ckpt: int) -> str:
    """One line: what was not finite, at which step and on which rank(s), and where to go on from."""
    ranks = [r for r, f in enumerate(loss_flags) if f]
    if ranks:
        what = f"the loss is not finite on rank {', '.join(map(str, ranks))}"
    else:  # DDP averages the gradients: every rank holds the same norm
        what = f"the gradient norm is {gnorm} on every rank ({len(loss_flags)} rank(s)), with a finite loss"
    last = (f"the last good checkpoint is {out / f'{CHECKPOINT_PREFIX}{last_ckpt}'}" if last_ckpt
            else "there is no checkpoint yet")
    return (f"training stopped at step {step}: {what}; the step was not applied and no export was written; {last}; "
            "train into a new --out with a lower --lr or --clip (a resume must keep them), or check the cache with "
            "dflash-offline verify")


def stopped_message(signum: int, out: Path) -> str:
    """The line a run stopped on request ends with: the checkpoint it resumes from, if any."""
    steps = list_checkpoints(out)
    if not steps:
        return (f"stopped on {signal_name(signum)} before the first checkpoint: nothing to resume from; "
                "run the same command again to start over")
    return (f"stopped on {signal_name(signum)}: checkpoint step-{steps[-1]} saved in {out}; "
            "run the same command again to resume")


def agreed_stop(group, world: int) -> int | None:
    """The stop signal if any rank has one (every rank calls this at the same point), else None.
    One tiny all-reduce on a gloo group: a host-side collective, no GPU sync."""
    sig = stop_requested() or 0
    if world > 1:
        import torch
        import torch.distributed as dist

        t = torch.tensor([sig], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        sig = int(t.item())
    return sig or None

