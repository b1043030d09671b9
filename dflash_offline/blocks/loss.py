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

Optional distillation: with the target's top-k next-token ids and log-probabilities the per-token
target is t = (1 - alpha) x onehot(label) + alpha x p, p the softmax of the k log-probabilities
(the top-k renormalised), and the loss is weight x (logsumexp(logits) - sum_i t_i x logits_i),
cross-entropy with a soft target (KL(t || softmax(logits)) plus the target's entropy). alpha = 0,
or no soft arrays, runs the hard-label code unchanged, so its results are bit for bit today's.

Optional D-PACE weights (`dpace_alpha`, arXiv 2605.18810): instead of the data's fixed decay over
the slots, each scored slot k of a block weighs w_k = sum over scored m >= k of C_m, with
C_m = prod over scored i <= m of ((1 - a) q_i + a), q_i = exp(-CE_i) the drafter's (detached)
probability of slot i's token. w_k is the gradient of the expected accepted length
sum_m prod_{i<=m} q_i with respect to log q_k: a slot counts by how much acceptance it can still
unlock, per block and per step, where the decay guesses that once for all blocks. The weights are
rescaled so that a micro-batch's total equals its data weights' total (the step's normalisation
and the logged loss keep their meaning).
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


def head_logits(h: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """float32 logits through the frozen head (autograd-visible: the checkpointed paths' forward).
    Without autocast (the CPU fp32 path) the head, kept in the checkpoint's dtype, is cast to h's."""
    if h.dtype != head_weight.dtype and not torch.is_autocast_enabled(h.device.type):
        head_weight = head_weight.to(h.dtype)
    return F.linear(h, head_weight).float()


def _chunk_loss(h: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    logits = head_logits(h, head_weight)
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = logits.argmax(-1) == labels
    return (ce * weights).sum(), correct


def _soft_probs(logprobs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """[n, k] top-k log-probabilities and ids -> (int64 ids, renormalised probabilities), safe to use.

    Unscored tokens (weight 0) may carry anything in the cache (zeros, -inf, padding ids): their
    probabilities are zeroed and their ids set to 0 so that neither a NaN (0 x NaN is NaN) nor an
    out-of-range index can reach the sum or the gather. A row of all -inf gets p = 0, not NaN.
    """
    lp = logprobs.float()
    m = lp.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf: exp(-inf - 0) = 0, not NaN
    e = (lp - m).exp()
    p = e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)
    scored = (weights != 0)[:, None]
    return torch.where(scored, ids.long(), 0), torch.where(scored, p, 0.0)


def dpace_weights(q: torch.Tensor, scored: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights [blocks, B] from the drafter's probabilities q of the slots' tokens and the
    scored slots (bool), both [blocks, B]: unscored slots are no-ops in the products (factor 1) and
    are left out of the sums, and get weight 0."""
    smooth = torch.where(scored, (1 - alpha) * q.float() + alpha, torch.ones_like(q, dtype=torch.float32))
    prefix = torch.cumprod(smooth, dim=-1) * scored
    suffix = prefix.flip(-1).cumsum(-1).flip(-1)
    return suffix * scored


def _chunk_soft_loss(h: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor, p: torch.Tensor, alpha: float):
    # The reference for the soft target: F.cross_entropy for the hard share, the top-k dot product
    # for the soft share; autograd makes (1 - alpha)(softmax - onehot) + alpha(softmax - p).
    logits = head_logits(h, head_weight)
    ce = F.cross_entropy(logits, labels, reduction="none")
    soft = torch.logsumexp(logits, dim=-1) - (p * logits.gather(1, ids)).sum(-1)
    correct = logits.argmax(-1) == labels
    return (((1 - alpha) * ce + alpha * soft) * weights).sum(), correct


def _head_stats(logits: torch.Tensor, y: torch.Tensor):
    """[n, V] logits -> (logsumexp, the label's logit, argmax == label), read in float32."""
    lf = logits.float()
    return torch.logsumexp(lf, dim=-1), lf.gather(1, y[:, None]).squeeze(1), lf.argmax(-1) == y


def _head_grad(logits, lse, y, w, dtype: torch.dtype, ids=None, ps=None, alpha: float = 0.0):
    """w x (softmax - t) in `dtype`, the gradient with respect to the logits, with t = onehot(y), or
    with `ids`/`ps` the soft target (1 - alpha) onehot(y) + alpha ps scattered on ids: the values
    the eager path builds in place (same operations, same order)."""
    p = (logits.float() - lse[:, None]).exp()
    label = torch.arange(p.shape[1], device=p.device)[None, :] == y[:, None]
    p = torch.where(label, p - (1 - alpha), p)
    if ids is not None:
        p = p.scatter_add(1, ids, ps * -alpha)
    return (p * w[:, None]).to(dtype)


# Compiled once (static shapes: a chunk's tokens and the vocabulary), used with train --compile-loss
# (for GPUs): Inductor makes each one or two passes over the [chunk, vocab] logits, reading them in the
# matmul's dtype, where the eager path makes about nine over a float32 copy (26 of a step's 108 ms
# of device time for the pycode drafter, the head's matmuls 3 of them).
_compiled: dict = {}


def compiled_once(fn):
    """`fn` compiled once per process (static shapes), shared by the losses' chunk passes."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


class _FusedHeadCE(torch.autograd.Function):
    """sum(weights x CE(h @ W.T, t)) for a frozen W; the input gradient is made in the forward.

    t is onehot(labels), or with `soft_ids`/`soft_logprobs` [N, k] and alpha > 0 the mixture
    (1 - alpha) x onehot(labels) + alpha x softmax(soft_logprobs) scattered onto `soft_ids`.
    """

    @staticmethod
    def forward(ctx, h, head_weight, labels, weights, chunk_tokens: int, need_grad: bool,
                soft_ids=None, soft_logprobs=None, alpha: float = 0.0, dpace: float | None = None,
                block_size: int = 1, compiled: bool = False):
        soft = soft_ids is not None and alpha > 0
        dt = _matmul_dtype(h, head_weight)
        w_mm = head_weight.to(dt)  # no copy when the head already has the matmul dtype (bf16 on GPU)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.empty(h.shape[0], dtype=torch.bool, device=h.device)
        grad_h = torch.empty_like(h) if need_grad else None
        w_sum = torch.zeros((), dtype=torch.float32, device=h.device)  # D-PACE: the weights' total
        with torch.autocast(h.device.type, enabled=False):
            for a in range(0, h.shape[0], chunk_tokens):  # with D-PACE, chunks hold whole blocks
                sl = slice(a, a + chunk_tokens)
                y, w = labels[sl], weights[sl]
                logits = h[sl].to(dt) @ w_mm.T
                # A short last chunk runs eagerly: a second shape would be a recompile every run.
                fast = compiled and logits.shape[0] == min(chunk_tokens, h.shape[0])
                if not fast:
                    logits = logits.float()  # the eager passes below work on (and in place of) this copy
                lse, hard_t, correct[sl] = (compiled_once(_head_stats) if fast else _head_stats)(logits, y)
                if dpace is not None:
                    q = (hard_t - lse).exp()  # the drafter's probability of the slot's token
                    w = dpace_weights(q.view(-1, block_size), (w != 0).view(-1, block_size), dpace).view(-1)
                    w_sum += w.sum()
                if soft:
                    # Both target terms are read before the logits are overwritten by the gradient.
                    ids, ps = _soft_probs(soft_logprobs[sl], soft_ids[sl], w)
                    soft_t = (ps * logits.gather(1, ids).float()).sum(-1)
                    total += ((lse - (1 - alpha) * hard_t - alpha * soft_t) * w).sum()
                else:
                    total += ((lse - hard_t) * w).sum()
                if need_grad and fast:
                    p = (compiled_once(_head_grad)(logits, lse, y, w, dt, ids, ps, alpha) if soft
                         else compiled_once(_head_grad)(logits, lse, y, w, dt))
                    grad_h[sl] = p @ w_mm
                elif need_grad:
                    # d(w x CE)/dlogits = w x (softmax - onehot), built in place of the logits.
                    p = logits.sub_(lse[:, None]).exp_()
                    if soft:
                        # ... and with the soft target w x (softmax - t): t's two shares subtracted.
                        p[torch.arange(p.shape[0], device=p.device), y] -= 1 - alpha
                        p.scatter_add_(1, ids, ps.mul_(-alpha))
                    else:
                        p[torch.arange(p.shape[0], device=p.device), y] -= 1
                    p.mul_(w[:, None])
                    grad_h[sl] = p.to(dt) @ w_mm
                del logits
        if dpace is not None:
            # The weights are constants (detached): rescaling the sum rescales its gradient alike.
            f = weights.float().sum() / w_sum.clamp_min(torch.finfo(torch.float32).tiny)
            total = total * f
            if need_grad:
                grad_h.mul_(f.to(grad_h.dtype))
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, g_total, g_correct):
        (grad_h,) = ctx.saved_tensors
        return grad_h * g_total.to(grad_h.dtype), None, None, None, None, None, None, None, None, None, None, None


def _check_soft(labels: torch.Tensor, soft_ids, soft_logprobs, soft_weight) -> float:
    """Validates the soft-target arguments; returns alpha as a float. One ValueError names every
    problem, so a bad cache or config is fixed in one go."""
    problems = []
    if (soft_ids is None) != (soft_logprobs is None):
        problems.append("soft_ids and soft_logprobs must be given together (or neither)")
    for name, arr in (("soft_ids", soft_ids), ("soft_logprobs", soft_logprobs)):
        if arr is not None and (arr.dim() != 3 or tuple(arr.shape[:2]) != tuple(labels.shape) or arr.shape[2] < 1):
            problems.append(f"{name} {tuple(arr.shape)} is not [R, Q, k] with [R, Q] = {tuple(labels.shape)}, k >= 1")
    if soft_ids is not None and soft_logprobs is not None and soft_ids.shape != soft_logprobs.shape:
        problems.append(f"soft_ids {tuple(soft_ids.shape)} and soft_logprobs {tuple(soft_logprobs.shape)} differ")
    if soft_ids is not None and (soft_ids.dtype.is_floating_point or soft_ids.dtype.is_complex
                                 or soft_ids.dtype == torch.bool):
        problems.append(f"soft_ids has dtype {soft_ids.dtype}, want an integer dtype (int32 or int64)")
    if soft_logprobs is not None and not soft_logprobs.dtype.is_floating_point:
        problems.append(f"soft_logprobs has dtype {soft_logprobs.dtype}, want a floating dtype")
    try:
        alpha = float(soft_weight)
    except (TypeError, ValueError):
        alpha = float("nan")
    if not 0.0 <= alpha <= 1.0:  # NaN fails too
        problems.append(f"soft_weight {soft_weight!r} is not in [0, 1]")
    if problems:
        raise ValueError("block_loss: " + "; ".join(problems))
    return alpha


def block_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               chunk_tokens: int = 4096, impl: str = "fused", soft_ids: torch.Tensor | None = None,
               soft_logprobs: torch.Tensor | None = None, soft_weight: float = 0.0,
               dpace_alpha: float | None = None, block_size: int | None = None,
               compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [R, Q, H], labels/weights [R, Q] -> (sum of weight x CE, correct [R, Q] bool, detached).

    With `soft_ids` (int [R, Q, k]) and `soft_logprobs` (float [R, Q, k]), the target's top-k for
    each block token, and `soft_weight` alpha in (0, 1], the CE is against the soft target
    (1 - alpha) x onehot(label) + alpha x softmax(soft_logprobs) (see the module docstring).
    `correct` stays argmax == label. alpha = 0, or no soft arrays, is the hard-label loss exactly.

    With `dpace_alpha` (in [0, 1]) and `block_size` B (Q a multiple of B: blocks of B slots in a
    row), `weights` say only which tokens are scored and their total: each scored token weighs its
    D-PACE weight (see the module docstring), rescaled to that total.

    `compiled` (the fused path; train --compile-loss): the element-wise passes over each
    chunk's logits run as compiled kernels (static shapes: compiled once for the chunk length; a
    shorter last chunk runs the eager passes).
    """
    if hidden.shape[:2] != labels.shape or labels.shape != weights.shape:
        raise ValueError(f"block_loss: hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)}, "
                         f"weights {tuple(weights.shape)} do not line up")
    if impl not in LOSS_IMPLS:
        raise ValueError(f"block_loss: impl {impl!r}: choose one of {', '.join(LOSS_IMPLS)}")
    alpha = _check_soft(labels, soft_ids, soft_logprobs, soft_weight)
    if dpace_alpha is not None:
        if not 0.0 <= float(dpace_alpha) <= 1.0:
            raise ValueError(f"block_loss: dpace_alpha {dpace_alpha!r} is not in [0, 1]")
        if not block_size or labels.shape[1] % block_size:
            raise ValueError(f"block_loss: D-PACE needs block_size dividing the {labels.shape[1]} block tokens of a "
                             f"row, got {block_size!r}")
        chunk_tokens = max(block_size, chunk_tokens // block_size * block_size)  # chunks of whole blocks
    h = hidden.reshape(-1, hidden.shape[-1])
    y, w = labels.reshape(-1), weights.reshape(-1)
    soft = soft_ids is not None and alpha > 0  # otherwise the hard path below, untouched
    sid = slp = None
    if soft:
        k = soft_ids.shape[-1]
        sid, slp = soft_ids.reshape(-1, k), soft_logprobs.reshape(-1, k)
    grad = torch.is_grad_enabled() and h.requires_grad
    if impl == "fused" and not head_weight.requires_grad:
        total, correct = _FusedHeadCE.apply(h, head_weight, y, w, chunk_tokens, grad, sid, slp, alpha if soft else 0.0,
                                            dpace_alpha, block_size or 1, compiled)
        return total, correct.view_as(labels)
    if dpace_alpha is not None:
        # The reference path: the weights from a no-grad pass over the logits, then the plain loss.
        w = dpace_slot_weights(lambda sl: head_logits(h[sl], head_weight), y, w, chunk_tokens, dpace_alpha,
                               block_size)
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = []
    for a in range(0, h.shape[0], chunk_tokens):
        sl = slice(a, a + chunk_tokens)
        if soft:
            # The target is data, not a parameter: its probabilities are made outside the checkpoint.
            ids, ps = _soft_probs(slp[sl], sid[sl], w[sl])
            args = (h[sl], head_weight, y[sl], w[sl], ids, ps, alpha)
            fn = _chunk_soft_loss
        else:
            args, fn = (h[sl], head_weight, y[sl], w[sl]), _chunk_loss
        if grad:
            s, c = checkpoint(fn, *args, use_reentrant=False)
        else:
            s, c = fn(*args)
        total = total + s
        correct.append(c.detach())
    return total, torch.cat(correct).view_as(labels)


def dpace_slot_weights(logits_of, y, w, chunk_tokens: int, alpha: float, block_size: int) -> torch.Tensor:
    """D-PACE weights of every slot from a no-grad pass over the chunks' logits (`logits_of(slice)`:
    q = the drafter's probability of the slot's label), rescaled to the data weights' total: the
    reference path here, and DSpark's three-term loss with its Markov-biased logits."""
    with torch.no_grad():
        q = []
        for a in range(0, y.shape[0], chunk_tokens):
            sl = slice(a, a + chunk_tokens)
            q.append((-F.cross_entropy(logits_of(sl), y[sl], reduction="none")).exp())
        d = dpace_weights(torch.cat(q).view(-1, block_size), (w != 0).view(-1, block_size), alpha).view(-1)
        return d * (w.float().sum() / d.sum().clamp_min(torch.finfo(torch.float32).tiny))


def block_metrics(correct: torch.Tensor, weights: torch.Tensor, anchor_valid: torch.Tensor,
                  block_size: int, first_slot: int = 1) -> dict[str, torch.Tensor]:
    """Sums (not means), so micro-batches and ranks can be added before dividing.

    - `slot_correct[j]`, `slot_count[j]`: top-1 hits and scored positions per block slot.
    - `tau_sum`, `blocks`: acceptance length the batch implies, 1 + the leading run of correct
      scored slots of each valid block (a slot that is not scored ends the run), summed over blocks.
    """
    B = block_size
    c = correct.reshape(-1, B)
    scored = weights.reshape(-1, B) > 0
    hit = (c & scored)[:, first_slot:]  # DFlash's first drafted slot is 1, DSpark's 0
    run = torch.cumprod(hit.to(torch.int32), dim=1).sum(dim=1)
    valid = anchor_valid.reshape(-1)
    return {
        "slot_correct": (c & scored).sum(0).to(torch.float64),
        "slot_count": scored.sum(0).to(torch.float64),
        "tau_sum": ((1 + run) * valid).sum().to(torch.float64),
        "blocks": valid.sum().to(torch.float64),
    }
