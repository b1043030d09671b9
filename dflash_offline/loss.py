"""Weighted block cross-entropy in chunks, and the metrics a batch implies.

The LM head over a 150K-250K vocabulary for every block token is the largest activation of the
step. Each chunk's logits are computed inside `torch.utils.checkpoint`, so the forward keeps only
the chunk's loss and the backward recomputes that chunk's logits: at most one [chunk, vocab] block
of logits is alive at any time, forward or backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss(h: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    if h.dtype != head_weight.dtype and not torch.is_autocast_enabled(h.device.type):
        # The frozen head keeps the checkpoint's dtype; without autocast (the CPU fp32 path) the
        # matmul needs one dtype. Under autocast F.linear casts both to bf16 by itself.
        head_weight = head_weight.to(h.dtype)
    logits = F.linear(h, head_weight).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = logits.argmax(-1) == labels
    return (ce * weights).sum(), correct


def block_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [R, Q, H], labels/weights [R, Q] -> (sum of weight x CE, correct [R, Q] bool, detached)."""
    if hidden.shape[:2] != labels.shape or labels.shape != weights.shape:
        raise ValueError(f"block_loss: hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)}, "
                         f"weights {tuple(weights.shape)} do not line up")
    h = hidden.reshape(-1, hidden.shape[-1])
    y, w = labels.reshape(-1), weights.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = []
    for a in range(0, h.shape[0], chunk_tokens):
        sl = slice(a, a + chunk_tokens)
        if torch.is_grad_enabled() and h.requires_grad:
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
