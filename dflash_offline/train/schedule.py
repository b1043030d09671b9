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


class TokenSchedule:
    """--follow's schedule, where the epochs' LambdaLR stands: the number of steps is known only at
    the data's end, so each step's rate comes from the share of the plan's tokens trained by the
    step's middle (`lr_at`), which the data source gives before the step (`at`). Its place is the
    checkpoint's follow position, so it keeps no state of its own."""

    def __init__(self, opt, base_lr: float, warmup_ratio: float):
        self.opt, self.base_lr, self.warmup_ratio = opt, base_lr, warmup_ratio
        self._lr = base_lr

    def at(self, progress: float) -> None:
        """The next optimizer step's rate, from its place in the plan's tokens (0..1)."""
        self._lr = self.base_lr * lr_at(min(1.0, progress), self.warmup_ratio)
        for group in self.opt.param_groups:
            group["lr"] = self._lr

    def step(self) -> None:
        """After the optimizer step, as LambdaLR's: the next rate comes with the next step's place."""

    def get_last_lr(self) -> list[float]:
        return [self._lr]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (a checkpoint of an earlier main holds a LambdaLR's state here, unused)."""


def lr_lambda(total: int, warmup: int):
    """LambdaLR's factor at each step of `total`, the first `warmup` of them warming up."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return _cosine((step - warmup) / max(1, total - warmup))
    return f
