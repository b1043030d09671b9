"""DSpark's heads, training blocks and three-term loss against brute force, slot by slot.

- the loss (vanilla and gated Markov heads, with and without the confidence head, p_target from a
  top-k with its remaining mass or one-hot, several chunks) equals a float64 loop over the slots
  that writes each term from its definition; so do its gradients (hidden states, both heads);
- the top-k L1 is the L1 with the tokens outside the top-k merged: never above the full L1, equal
  to it when the top-k is the whole vocabulary;
- x_{k-1}: the anchor for slot 0, the data token before for the others;
- DSpark rows (label_offset 1): slot j predicts the token at anchor + 1 + j, every slot scored,
  weights exp(-j / gamma); DFlash rows unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash_offline.drafter.dspark import ConfidenceHead, MarkovHead, previous_tokens
from dflash_offline.train.dspark_loss import LossWeights, dspark_loss
from dflash_offline.train.packing import build_row, loss_weights

V, H, RANK, B = 41, 12, 5, 4


def make(kind: str, with_conf: bool, seed: int = 0):
    torch.manual_seed(seed)
    markov = MarkovHead(V, H, RANK, kind).double()
    markov.reset_parameters(0.3)
    conf = ConfidenceHead(H, RANK).double() if with_conf else None
    if conf is not None:
        conf.reset_parameters(0.3)
    head = torch.randn(V, H, dtype=torch.float64)
    return markov, conf, head


def batch(R=2, Q=3 * B, k=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, Q, H, dtype=torch.float64, generator=g)
    labels = torch.randint(0, V, (R, Q), generator=g)
    prev = torch.randint(0, V, (R, Q), generator=g)
    weights = torch.rand(R, Q, dtype=torch.float64, generator=g) * (torch.rand(R, Q, generator=g) > 0.2)
    # a top-k of a random full distribution: log-probabilities over the whole vocabulary
    full = torch.randn(R, Q, V, dtype=torch.float64, generator=g).mul(2).log_softmax(-1)
    lp, ids = full.topk(k, -1)
    lp = torch.where(weights[..., None] == 0, torch.full_like(lp, -math.inf), lp)  # padding in unscored slots
    return hidden, labels, prev, weights, ids.int(), lp.float(), full


def brute(markov, conf, head, hidden, labels, prev, weights, ids, lp, lw: LossWeights):
    """Each slot on its own, each term from its definition."""
    total = torch.zeros((), dtype=torch.float64)
    R, Q = labels.shape
    for r in range(R):
        for q in range(Q):
            w = float(weights[r, q])
            if w == 0:
                continue
            h, x, y = hidden[r, q], prev[r, q], labels[r, q]
            e = markov.markov_w1.weight[x]
            code = e
            if markov.kind == "gated":
                code = torch.sigmoid(markov.gate_proj.weight @ torch.cat([h, e]) + markov.gate_proj.bias) * e
            z = head @ h + markov.markov_w2.weight @ code
            p = torch.softmax(z, -1)
            ce = -torch.log(p[y])
            if ids is None:
                target = torch.zeros(V, dtype=torch.float64)
                target[y] = 1.0
                l1 = (p - target).abs().sum()
            else:
                known = [int(i) for i in ids[r, q]]
                t = [math.exp(float(v)) for v in lp[r, q]]
                l1 = sum((p[i] - ti).abs() for i, ti in zip(known, t))
                others = sum(p[i] for i in range(V) if i not in known)
                l1 = l1 + (others - (1.0 - sum(t))).abs()
            term = lw.ce * ce + lw.tv * l1
            if conf is not None:
                s = float(min(1.0, max(0.0, 1.0 - 0.5 * l1.item())))  # a number: no gradient through it
                c = torch.sigmoid(conf.proj.weight[0] @ torch.cat([h, e]) + conf.proj.bias[0])
                term = term + lw.bce * -(s * torch.log(c) + (1 - s) * torch.log(1 - c))
            total = total + w * term
    return total


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
@pytest.mark.parametrize("with_conf", [True, False], ids=["confidence", "no-confidence"])
@pytest.mark.parametrize("topk", [True, False], ids=["topk", "onehot"])
def test_loss_equals_brute_force_slot_by_slot(kind, with_conf, topk):
    markov, conf, head = make(kind, with_conf)
    hidden, labels, prev, weights, ids, lp, _ = batch()
    lw = LossWeights(0.3, 0.5, 0.7)
    hidden.requires_grad_()
    got = dspark_loss(hidden, head, markov, conf, prev, labels, weights, ids if topk else None, lp if topk else None,
                      lw, chunk_tokens=5)
    params = [hidden, *markov.parameters(), *(conf.parameters() if conf is not None else [])]
    g_got = torch.autograd.grad(got.total, params)
    want = brute(markov, conf, head, hidden, labels, prev, weights, ids if topk else None, lp, lw)
    g_want = torch.autograd.grad(want, params)
    # the loss's logits are float32 (as in training): agreement to float32's precision
    torch.testing.assert_close(got.total.double(), want, rtol=2e-5, atol=1e-5)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    z = hidden.detach() @ head.T + markov.markov_w2(markov.code(hidden.detach(), prev)[1])
    assert torch.equal(got.correct, z.argmax(-1) == labels)
    assert 0 < float(got.survival) <= float(weights.sum())


def test_topk_l1_is_the_l1_with_the_other_tokens_merged():
    markov, _, head = make("vanilla", False)
    hidden, labels, prev, weights, _, _, full = batch(k=6)
    weights = torch.ones_like(weights)
    lw = LossWeights(0.0, 1.0, 0.0)
    with torch.no_grad():
        z = hidden @ head.T + markov.markov_w2(markov.markov_w1(prev))
        exact = (torch.softmax(z, -1) - full.exp()).abs().sum(-1)  # the full L1 of every slot
        for k in (1, 6, V):
            lp, ids = full.topk(k, -1)
            per = [float(dspark_loss(hidden[r:r + 1, q:q + 1], head, markov, None, prev[r:r + 1, q:q + 1],
                                     labels[r:r + 1, q:q + 1], weights[r:r + 1, q:q + 1], ids[r:r + 1, q:q + 1],
                                     lp[r:r + 1, q:q + 1].float(), lw).total)
                   for r in range(2) for q in range(3 * B)]
            per = torch.tensor(per, dtype=torch.float64)
            assert (per <= exact.flatten() + 1e-5).all()
            if k == V:
                torch.testing.assert_close(per, exact.flatten(), rtol=1e-4, atol=1e-5)


def test_previous_tokens_are_the_anchor_then_the_data():
    block_ids = torch.tensor([[7, 1, 1, 1, 9, 1, 1, 1]])
    labels = torch.tensor([[10, 11, 12, 13, 20, 21, 22, 23]])
    assert previous_tokens(block_ids, labels, 4).tolist() == [[7, 10, 11, 12, 9, 20, 21, 22]]


def test_dspark_rows_predict_the_next_token_from_every_slot():
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 90, size=30)
    lm = np.r_[np.zeros(5, np.uint8), np.ones(25, np.uint8)]
    gamma = 4.0
    args = ([ids], [lm], 40, 6, B, 1)
    dspark = build_row(*args, loss_weights(B, gamma, 1), np.random.default_rng(1), label_offset=1)
    dflash = build_row(*args, loss_weights(B, gamma), np.random.default_rng(1))
    assert np.array_equal(dspark.anchors, dflash.anchors)
    w = np.exp(-np.arange(B) / gamma)
    for n, (a, ok) in enumerate(zip(dspark.anchors, dspark.anchor_valid)):
        if not ok:
            continue
        blk = slice(n * B, (n + 1) * B)
        inside = a + 1 + np.arange(B) < 30
        assert dspark.block_ids[blk][0] == ids[a] and (dspark.block_ids[blk][1:] == 1).all()
        assert np.array_equal(dspark.labels[blk][inside], ids[a + 1:a + 1 + B][: inside.sum()])
        np.testing.assert_allclose(dspark.weights[blk], w * inside, rtol=1e-6)
        # DFlash: slot j predicts anchor + j, slot 0 unscored
        assert dflash.labels[blk][0] == 0 and dflash.weights[blk][0] == 0
        assert np.array_equal(dflash.labels[blk][1:][inside[:-1]], ids[a + 1:a + B][: inside[:-1].sum()])
