"""A training step's sums travel as one all-reduced vector; StepSums.pack and unpack are its one
layout: every field comes back where it went, for any block size and rank count, and the
finiteness flags say which rank diverged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_offline.train.step import StepSums


@pytest.mark.parametrize("B, world", [(2, 1), (8, 3), (16, 2)])
def test_pack_then_unpack_is_identity(B, world):
    g = torch.Generator().manual_seed(B * 10 + world)
    r = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    m = {"slot_correct": r(B), "slot_count": r(B), "tau_sum": r(()), "blocks": r(())}
    loss, bad_loss, bad_grad = r(()), torch.zeros(world, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    vec = StepSums.pack(loss, m, bad_loss, bad_grad)
    assert vec.shape == (2 * B + 4 + world,)
    s = StepSums.unpack(vec.numpy(), B, world)
    assert s.loss_sum == loss.item() and s.tau_sum == m["tau_sum"].item() and s.blocks == m["blocks"].item()
    assert np.array_equal(s.slot_correct, m["slot_correct"].numpy()) and np.array_equal(s.slot_count, m["slot_count"].numpy())
    assert not s.diverged and s.nonfinite_loss.shape == (world,)
    bad_loss[world - 1] = 1
    s = StepSums.unpack(StepSums.pack(loss, m, bad_loss, bad_grad).numpy(), B, world)
    assert s.diverged and list(np.flatnonzero(s.nonfinite_loss)) == [world - 1] and s.nonfinite_grad == 0
    s = StepSums.unpack(StepSums.pack(loss, m, torch.zeros(world, dtype=torch.float64),
                                      torch.ones((), dtype=torch.float64)).numpy(), B, world)
    assert s.diverged and not s.nonfinite_loss.any()
