"""The learning-rate schedule: linear warm-up, then cosine decay to zero.

Over a count of steps known in advance (epochs of a complete cache: `lr_lambda`, a LambdaLR factor),
or over the fraction of the plan's tokens trained (--follow, where the number of steps is only
known at the end: `lr_at`)."""

from __future__ import annotations

import math


def _cosine(progress: float) -> float:
    """The decay after the warm-up: 1 at its start, 0 from progress 1 on."""
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def lr_at(progress: float, warmup_ratio: float) -> float:
    """Warm-up then cosine over the fraction of the plan's tokens trained (train --follow)."""
    if progress < warmup_ratio:
        return progress / warmup_ratio
    return _cosine((progress - warmup_ratio) / max(1e-12, 1.0 - warmup_ratio))


def lr_lambda(total: int, warmup: int):
    """LambdaLR's factor at each step of `total`, the first `warmup` of them warming up."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return _cosine((step - warmup) / max(1, total - warmup))
    return f
