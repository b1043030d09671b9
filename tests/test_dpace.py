"""D-PACE slot weights (train --loss-weights dpace): the weights against a literal reading of their
definition, and the fused loss against the checkpointed path and a dense brute force (loss and
gradient, hard and soft targets, chunks that do not hold whole blocks)."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_offline.blocks.loss import block_loss, dpace_weights


def _literal(q, scored, alpha):
    """w_k = sum over scored m >= k of prod over scored i <= m of ((1 - alpha) q_i + alpha)."""
    out = []
    for qs, ss in zip(q.tolist(), scored.tolist()):
        row = []
        for k in range(len(qs)):
            if not ss[k]:
                row.append(0.0)
                continue
            total = 0.0
            for m in range(k, len(qs)):
                if ss[m]:
                    total += math.prod((1 - alpha) * qs[i] + alpha for i in range(m + 1) if ss[i])
            row.append(total)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_weights_equal_their_definition(alpha):
    g = torch.Generator().manual_seed(3)
    q = torch.rand(9, 6, generator=g, dtype=torch.float64)
    scored = torch.rand(9, 6, generator=g) > 0.3
    scored[:, 0] = False  # slot 0 (the anchor) is never scored
    scored[2] = False  # a block with nothing scored weighs nothing
    got = dpace_weights(q, scored, alpha)
    torch.testing.assert_close(got.double(), _literal(q, scored, alpha), rtol=1e-6, atol=1e-7)
    assert (got[~scored] == 0).all()
    if alpha == 1.0:  # every factor 1: a slot weighs the number of scored slots from it on
        assert torch.equal(got, torch.flip(torch.cumsum(torch.flip(scored.float(), [-1]), -1), [-1]) * scored)


def _case(seed=0, R=3, N=10, B=4, H=16, V=97, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, N * B, H, generator=g, dtype=dtype)
    head = torch.randn(V, H, generator=g, dtype=dtype) / H**0.5
    labels = torch.randint(0, V, (R, N * B), generator=g)
    decay = torch.exp(-torch.arange(B, dtype=torch.float32) / 3).repeat(N)
    weights = (decay * (torch.rand(R, N * B, generator=g) > 0.2)).float()
    weights.view(R, N, B)[:, :, 0] = 0  # the anchor slot
    ids = torch.rand(R, N * B, V, generator=g).argsort(-1)[..., :5].to(torch.int32)
    logp = torch.log_softmax(torch.randn(R, N * B, 5, generator=g, dtype=torch.float64), -1).to(torch.float16)
    return hidden, head, labels, weights, ids, logp


def _brute(hidden, head, labels, weights, ids, logp, alpha_kd, alpha, B):
    """All logits at once; the weights from the detached probabilities by the literal definition,
    rescaled to the data weights' total; the loss sum(w' x soft CE) differentiated by autograd."""
    h = hidden.clone().requires_grad_(True)
    V = head.shape[0]
    logits = (h @ head.T).reshape(-1, V)
    y, w = labels.reshape(-1), weights.reshape(-1).double()
    q = torch.softmax(logits.detach(), -1).gather(1, y[:, None]).squeeze(1)
    d = _literal(q.view(-1, B), (w != 0).view(-1, B), alpha).view(-1)
    d = d * (w.sum() / d.sum())
    k = ids.shape[-1]
    p = torch.softmax(logp.reshape(-1, k).double(), -1)
    t = torch.zeros(y.shape[0], V, dtype=torch.float64)
    t.scatter_(1, y[:, None], 1 - alpha_kd)
    t.scatter_add_(1, ids.reshape(-1, k).long(), alpha_kd * p)
    loss = (d * (torch.logsumexp(logits, -1) - (t * logits).sum(-1))).sum()
    (loss * 0.37).backward()
    return loss.detach(), h.grad


def _ours(impl, hidden, head, labels, weights, ids, logp, alpha_kd, alpha, B, chunk):
    h = hidden.clone().requires_grad_(True)
    soft = dict(soft_ids=ids, soft_logprobs=logp, soft_weight=alpha_kd) if alpha_kd > 0 else {}
    total, _ = block_loss(h * 1.0, head, labels, weights, chunk_tokens=chunk, impl=impl, dpace_alpha=alpha,
                          block_size=B, **soft)
    (total * 0.37).backward()
    return total.detach(), h.grad


@pytest.mark.parametrize("alpha_kd", [0.0, 0.5])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
@pytest.mark.parametrize("chunk", [7, 4096])  # 7: rounded down to whole blocks (4 tokens)
def test_fused_and_recompute_equal_the_brute_force(alpha_kd, alpha, chunk):
    case = _case()
    ref_loss, ref_grad = _brute(*case, alpha_kd, alpha, 4)
    for impl in ("fused", "recompute"):
        loss, grad = _ours(impl, *case, alpha_kd, alpha, 4, chunk)
        # The loss paths make their logits in float32 (as the hard path always has).
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_rescaled_weights_keep_the_data_weights_total():
    """The rescaling keeps a micro-batch's total weight: with the same CE c on every token (uniform
    logits) the loss is c x the data weights' total, whatever D-PACE makes of the slots."""
    hidden, head, labels, weights, ids, logp = _case(seed=1, dtype=torch.float32)
    hidden = torch.zeros_like(hidden)  # uniform logits: CE = log V for every token
    total, _ = block_loss(hidden, head.float(), labels, weights, chunk_tokens=64, dpace_alpha=0.5, block_size=4)
    torch.testing.assert_close(total, weights.sum() * math.log(head.shape[0]), rtol=1e-5, atol=1e-4)


def test_bad_arguments():
    hidden, head, labels, weights, _, _ = _case()
    with pytest.raises(ValueError, match="dpace_alpha"):
        block_loss(hidden, head, labels, weights, dpace_alpha=1.5, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        block_loss(hidden, head, labels, weights, dpace_alpha=0.5, block_size=3)
    with pytest.raises(ValueError, match="block_size"):
        block_loss(hidden, head, labels, weights, dpace_alpha=0.5)
