"""benchmarks/sampled_ceiling.py's best blind draft (the distribution with the most expected
acceptance against a set of conditionals) against a brute-force search over a grid of the simplex."""

from __future__ import annotations

import itertools

import torch

from conftest import benchmark_module


def _module():
    return benchmark_module("sampled_ceiling")


def test_l1_draft_is_the_best_draft_on_a_grid():
    mod = _module()
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 7):
        p = torch.softmax(torch.randn(n, 3, generator=gen, dtype=torch.float64) * 2, -1)
        q = mod.l1_draft(p)
        assert torch.all(q >= 0) and abs(float(q.sum()) - 1) < 1e-12
        best = max(float(mod.acceptance(p, torch.tensor([a, b, 1 - a - b], dtype=torch.float64)).mean())
                   for a, b in ((i / 200, j / 200) for i, j in itertools.product(range(201), repeat=2) if i + j <= 200))
        got = float(mod.acceptance(p, q).mean())
        # the grid's best is within its step of the optimum and never above it
        assert best - 1e-12 <= got <= best + 2 * 3 / 200
        mean = float(mod.acceptance(p, p.mean(0)).mean())
        assert got >= mean - 1e-12  # the mean of the conditionals is one candidate
    one = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)
    assert torch.allclose(mod.l1_draft(one), one)  # one conditional: the draft is that distribution


def test_a_sharpened_draft_keeps_its_mode_and_the_slots_before_its_first():
    mod = _module()
    gen = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.randn(4, 9, generator=gen, dtype=torch.float64), -1)
    assert torch.allclose(mod.sharpened(q, 1.0), q)  # t = 1: the draft itself
    s = mod.sharpened(q, 0.5, first_slot=2)
    assert torch.allclose(s.sum(-1), torch.ones(4, dtype=torch.float64)) and torch.equal(s[0], q[0])
    assert torch.allclose(s[1:], (q[1:] ** 2) / (q[1:] ** 2).sum(-1, keepdim=True))
    assert torch.equal(s.argmax(-1), q.argmax(-1)) and torch.all(s.max(-1).values[1:] >= q.max(-1).values[1:])


def test_a_markov_draft_follows_the_samples_that_drew_the_previous_token():
    """Slot 2's draft is fitted on the samples whose slot-1 token is the one just drafted, and on all
    of them when none drew it; each draft's q is the probability its own distribution gave it."""
    mod = _module()
    eye = torch.eye(3, dtype=torch.float64)
    first = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    # sample 0 drew token 0 at slot 1 and then sees token 2 for sure; sample 1 drew 1 and sees 0
    p = torch.stack([torch.stack([first, eye[2]]), torch.stack([first, eye[0]])])
    tokens = torch.tensor([[0, 2], [1, 0]])
    drafts, qk = mod.markov_draw(p, tokens, 4000, torch.Generator().manual_seed(0), lambda c: c.mean(0))
    x1, x2 = drafts[:, 0], drafts[:, 1]
    assert torch.all(x2[x1 == 0] == 2) and torch.all(x2[x1 == 1] == 0)
    assert torch.all(qk[x1 < 2, 1] == 1.0)
    none = x1 == 2  # no sample drew it: the mean of both conditionals, tokens 0 and 2 at 0.5 each
    assert none.any() and set(x2[none].tolist()) == {0, 2} and torch.all(qk[none, 1] == 0.5)
    assert torch.allclose(qk[:, 0], first[x1])
    share = torch.bincount(x1, minlength=3).double() / len(x1)
    assert torch.allclose(share, first, atol=0.03)
