"""The fused head loss against the checkpointed reference: same loss, same hits, same gradient."""

from __future__ import annotations

import pytest
import torch

from dflash_offline.loss import block_loss


def _case(dtype=torch.float32, seed=0, R=3, Q=40, H=32, V=301):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, Q, H, generator=g, dtype=dtype)
    head = torch.randn(V, H, generator=g, dtype=dtype) / H**0.5
    labels = torch.randint(0, V, (R, Q), generator=g)
    weights = torch.rand(R, Q, generator=g) * (torch.rand(R, Q, generator=g) > 0.3)  # some unscored
    labels[weights == 0] = 0
    return hidden, head, labels, weights


def _loss_and_grad(impl, hidden, head, labels, weights, chunk, scale=0.37, autocast=False):
    h = hidden.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        total, correct = block_loss(h * 1.0, head, labels, weights, chunk_tokens=chunk, impl=impl)
    (total * scale).backward()
    return total.detach(), correct, h.grad


@pytest.mark.parametrize("chunk", [7, 4096])
def test_fused_equals_recompute_fp32(chunk):
    case = _case()
    lf, cf, gf = _loss_and_grad("fused", *case, chunk)
    lr, cr, gr = _loss_and_grad("recompute", *case, chunk)
    torch.testing.assert_close(lf, lr, rtol=1e-6, atol=1e-5)
    assert torch.equal(cf, cr)
    torch.testing.assert_close(gf, gr, rtol=1e-5, atol=1e-6)
    # A brute-force reference: the mean of weight x CE over all tokens at once, by autograd.
    h, head, y, w = case
    h = h.clone().requires_grad_(True)
    ref = (torch.nn.functional.cross_entropy((h @ head.T).reshape(-1, head.shape[0]), y.reshape(-1),
                                             reduction="none") * w.reshape(-1)).sum()
    (ref * 0.37).backward()
    torch.testing.assert_close(lf, ref.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gf, h.grad, rtol=1e-5, atol=1e-6)


def test_fused_under_bf16_autocast_matches_recompute():
    hidden, head, labels, weights = _case(seed=1)
    head = head.to(torch.bfloat16)  # the frozen head keeps the checkpoint's dtype
    lf, cf, gf = _loss_and_grad("fused", hidden, head, labels, weights, 16, autocast=True)
    lr, cr, gr = _loss_and_grad("recompute", hidden, head, labels, weights, 16, autocast=True)
    assert gf.dtype == gr.dtype == torch.float32
    torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-4)
    assert torch.equal(cf, cr)
    # Both round the logits' gradient to bf16 for the matmul; they differ only in where the
    # incoming scale is applied (before or after that rounding).
    torch.testing.assert_close(gf, gr, rtol=2e-2, atol=2e-3)


def test_no_grad_and_trainable_head():
    hidden, head, labels, weights = _case(seed=2)
    with torch.no_grad():
        lf, cf = block_loss(hidden, head, labels, weights, 9, "fused")
        lr, cr = block_loss(hidden, head, labels, weights, 9, "recompute")
    torch.testing.assert_close(lf, lr, rtol=1e-6, atol=1e-5)
    assert torch.equal(cf, cr)
    # A head that trains needs the weight gradient: the fused path steps aside for the reference.
    head = head.clone().requires_grad_(True)
    total, _ = block_loss(hidden, head, labels, weights, 9, "fused")
    total.backward()
    assert head.grad is not None and head.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="impl"):
        block_loss(hidden, head, labels, weights, 9, "other")


@pytest.mark.gpu
def test_fused_equals_recompute_on_cuda_bf16_large_vocab():
    hidden, head, labels, weights = _case(seed=3, R=2, Q=2048, H=256, V=50_000)
    dev = "cuda"
    hidden, labels, weights = hidden.to(dev), labels.to(dev), weights.to(dev)
    head = head.to(dev, torch.bfloat16)

    def run(impl):
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total, correct = block_loss(h * 1.0, head, labels, weights, chunk_tokens=1024, impl=impl)
        (total * 0.37).backward()
        return total.detach(), correct, h.grad

    (lf, cf, gf), (lr, cr, gr) = run("fused"), run("recompute")
    torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-3)
    assert (cf == cr).float().mean() > 0.999
    torch.testing.assert_close(gf, gr, rtol=2e-2, atol=2e-3)
