"""Weighted block cross-entropy through the frozen LM head, in chunks, and the batch's metrics.

The LM head over a 150K-250K vocabulary for every block token is the largest activation and the
largest matmul of the step. Two ways to keep at most one [chunk, vocab] block of logits alive:

- `fused` (default): the head is frozen, so the only gradient the loss sends back is the one
  into the drafter's output, `(softmax - onehot) x weight @ W`. The forward computes it chunk by
  chunk, right after the chunk's loss, while the logits are at hand, and keeps only that
  [tokens, hidden] gradient; the backward scales it by the incoming scalar. Two head matmuls per
  token (logits, input gradient) instead of three.
- `recompute`: each chunk runs inside `torch.utils.checkpoint`; the backward recomputes the
  chunk's logits (three head matmuls). Needed when the head itself trains, and kept as the
  reference the fused path is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_IMPLS = ("fused", "recompute")


def _matmul_dtype(h: torch.Tensor, head_weight: torch.Tensor) -> torch.dtype:
    # Under autocast F.linear would cast both operands to the autocast dtype; without it (the CPU
    # fp32 path) the frozen head, kept in the checkpoint's dtype, is cast to the input's.
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return h.dtype


def _chunk_loss(h: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    if h.dtype != head_weight.dtype and not torch.is_autocast_enabled(h.device.type):
        head_weight = head_weight.to(h.dtype)
    logits = F.linear(h, head_weight).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = logits.argmax(-1) == labels
    return (ce * weights).sum(), correct


class _FusedHeadCE(torch.autograd.Function):
    """sum(weights x CE(h @ W.T, labels)) for a frozen W; the input gradient is made in the forward."""

    @staticmethod
    def forward(ctx, h, head_weight, labels, weights, chunk_tokens: int, need_grad: bool):
        dt = _matmul_dtype(h, head_weight)
        w_mm = head_weight.to(dt)  # no copy when the head already has the matmul dtype (bf16 on GPU)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.empty(h.shape[0], dtype=torch.bool, device=h.device)
        grad_h = torch.empty_like(h) if need_grad else None
        with torch.autocast(h.device.type, enabled=False):
            for a in range(0, h.shape[0], chunk_tokens):
                sl = slice(a, a + chunk_tokens)
                y, w = labels[sl], weights[sl]
                logits = (h[sl].to(dt) @ w_mm.T).float()
                lse = torch.logsumexp(logits, dim=-1)
                total += ((lse - logits.gather(1, y[:, None]).squeeze(1)) * w).sum()
                correct[sl] = logits.argmax(-1) == y
                if need_grad:
                    # d(w x CE)/dlogits = w x (softmax - onehot), built in place of the logits.
                    p = logits.sub_(lse[:, None]).exp_()
                    p[torch.arange(p.shape[0], device=p.device), y] -= 1
                    p.mul_(w[:, None])
                    grad_h[sl] = p.to(dt) @ w_mm
                del logits
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, g_total, g_correct):
        (grad_h,) = ctx.saved_tensors
        return grad_h * g_total.to(grad_h.dtype), None, None, None, None, None


def block_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               chunk_tokens: int = 4096, impl: str = "fused") -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [R, Q, H], labels/weights [R, Q] -> (sum of weight x CE, correct [R, Q] bool, detached)."""
    if hidden.shape[:2] != labels.shape or labels.shape != weights.shape:
        raise ValueError(f"block_loss: hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)}, "
                         f"weights {tuple(weights.shape)} do not line up")
    if impl not in LOSS_IMPLS:
        raise ValueError(f"block_loss: impl {impl!r}: choose one of {', '.join(LOSS_IMPLS)}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y, w = labels.reshape(-1), weights.reshape(-1)
    grad = torch.is_grad_enabled() and h.requires_grad
    if impl == "fused" and not head_weight.requires_grad:
        total, correct = _FusedHeadCE.apply(h, head_weight, y, w, chunk_tokens, grad)
        return total, correct.view_as(labels)
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = []
    for a in range(0, h.shape[0], chunk_tokens):
        sl = slice(a, a + chunk_tokens)
        if grad:
            s, c = checkpoint(_chunk_loss, h[sl], head_weight, y[sl], w[sl], use_reentrant=False)
        else:
            s, c = _chunk_loss(h[sl], head_weight, y[sl], w[sl])
        total = total + s
        correct.append(c.detach())
    return total, torch.cat(correct).view_as(labels)


def block_metrics(correct: torch.Tensor, weights: torch.Tensor, anchor_valid: torch.Tensor,
                  block_size: int) -> dict[str, torch.Tensor]:
    """Sums (not means), so micro-batches and ranks can be added before dividing.

    - `slot_correct[j]`, `slot_count[j]`: top-1 hits and scored positions per block slot.
    - `tau_sum`, `blocks`: acceptance length the batch implies, 1 + the leading run of correct
      scored slots of each valid block (a slot that is not scored ends the run), summed over blocks.
    """
    B = block_size
    c = correct.reshape(-1, B)
    scored = weights.reshape(-1, B) > 0
    hit = (c & scored)[:, 1:]
    run = torch.cumprod(hit.to(torch.int32), dim=1).sum(dim=1)
    valid = anchor_valid.reshape(-1)
    return {
        "slot_correct": (c & scored).sum(0).to(torch.float64),
        "slot_count": scored.sum(0).to(torch.float64),
        "tau_sum": ((1 + run) * valid).sum().to(torch.float64),
        "blocks": valid.sum().to(torch.float64),
    }
