"""DSpark's three-term loss over a batch of block slots (drafter/dspark.py has the heads).

For each scored slot, with z = LMhead(h) + W2 code(h, x_{k-1}) the Markov-biased logits and
p = softmax(z) the drafter's distribution:
    ce_weight x CE(z, label) + tv_weight x L1(p, p_target) + bce_weight x BCE(sigmoid(c), 1 - TV)
c the confidence head's logit, TV = L1 / 2 (detached: the confidence learns the survival
probability, it does not pull the distribution), each slot weighted by the row's slot weight
(exp(-k / gamma) from packing.loss_weights(label_offset=1)). DeepSpec's weights: 0.1, 0.9, 1.0.

p_target comes from the cache's top-k (log-probabilities over the full vocabulary): on the k ids it
is known exactly, and the remaining mass r = 1 - sum of the k is one bucket, so the L1 is
    sum over the k ids of |p_i - t_i| + |(1 - sum over the k of p_i) - r|,
the L1 between the two distributions with the other tokens merged into one: never above the full
L1, equal to it when the drafter puts no mass outside the k the target does not also put there.
DeepSpec computes the full L1 from the target's last hidden state through the LM head (its cache
holds that state); a cache without top-k (--topk 0) gives a one-hot p_target (the data token), so
TV = 1 - p(label).

Chunks of `chunk_tokens` slots run under activation checkpointing: one [chunk, vocab] block of
logits is alive at a time, recomputed in the backward. With `compiled` (train --compile-loss) each
full chunk runs as one compiled graph (Inductor fuses the passes over its logits: the softmax, the
gathers, the L1), compiled once for the chunk length; a short last chunk runs eagerly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_offline.blocks.loss import compiled_once, dpace_slot_weights, head_logits
from dflash_offline.drafter.dspark import ConfidenceHead, MarkovHead


class LossWeights(NamedTuple):
    ce: float = 0.1
    tv: float = 0.9  # on the L1 distance (2 x TV), as DeepSpec's
    bce: float = 1.0


class DSparkLoss(NamedTuple):
    total: torch.Tensor  # sum over slots of weight x (the three terms), float32, differentiable
    correct: torch.Tensor  # [R, Q] bool: argmax of the biased logits == label (detached)
    survival: torch.Tensor  # sum of weight x (1 - TV): the weighted expected acceptance per slot (detached)
    confidence: torch.Tensor  # sum of weight x sigmoid(c) (detached): beside `survival`, the calibration


def target_probs(soft_ids: torch.Tensor, soft_logprobs: torch.Tensor, scored: torch.Tensor):
    """(ids int64 [n, k], probabilities [n, k], remaining mass [n]) of the cache's top-k; unscored
    slots (which may hold padding: -inf, any id) get ids 0, probabilities 0 and no remaining mass."""
    lp = soft_logprobs.float()
    t = torch.where(torch.isfinite(lp), lp.exp(), torch.zeros_like(lp))
    t = torch.where(scored[:, None], t, 0.0)
    rest = (1.0 - t.sum(-1)).clamp_min(0.0) * scored
    return torch.where(scored[:, None], soft_ids.long(), 0), t, rest


def _biased_logits(h, head_weight, markov: MarkovHead | None, prev):
    """(float32 logits with the Markov bias, W1[prev] for the confidence head); without a Markov head
    (DFlash with the L1 term: nor a confidence head) the head's logits and None."""
    z = head_logits(h, head_weight)
    if markov is None:
        return z, None
    e, code = markov.code(h, prev)
    return z + markov.bias(code), e


def _chunk(h, head_weight, markov: MarkovHead, conf: ConfidenceHead | None, prev, y, w, ids, t, rest,
           lw: LossWeights):
    z, e = _biased_logits(h, head_weight, markov, prev)
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    ce = -logp.gather(-1, y[:, None]).squeeze(-1)
    if ids is None:  # one-hot p_target: L1 = 2 (1 - p(label))
        l1 = 2.0 * (1.0 - p.gather(-1, y[:, None]).squeeze(-1))
    else:
        pk = p.gather(-1, ids)
        l1 = (pk - t).abs().sum(-1) + ((1.0 - pk.sum(-1)) - rest).abs()
    survive = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    per = lw.ce * ce + lw.tv * l1
    c = None
    if conf is not None:
        c = conf(h, e)
        per = per + lw.bce * F.binary_cross_entropy_with_logits(c, survive, reduction="none")
    total = (per * w).sum()
    stats = torch.stack([(survive * w).sum(), (torch.sigmoid(c.detach()) * w).sum() if c is not None
                         else torch.zeros((), device=w.device)])
    return total, z.argmax(-1) == y, stats


def dspark_loss(hidden: torch.Tensor, head_weight: torch.Tensor, markov: MarkovHead | None,
                confidence: ConfidenceHead | None,
                prev: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, soft_ids: torch.Tensor | None = None,
                soft_logprobs: torch.Tensor | None = None, loss_weights: LossWeights = LossWeights(),
                chunk_tokens: int = 4096, compiled: bool = False, dpace_alpha: float | None = None,
                block_size: int | None = None) -> DSparkLoss:
    """hidden [R, Q, H]; prev (x_{k-1}), labels, weights [R, Q]; soft_ids / soft_logprobs [R, Q, k]
    the target's top-k for each slot (None: one-hot p_target). markov None: no Markov bias (DFlash's
    slots with the L1 term; `prev` is then not read, and there is no confidence head).

    With `dpace_alpha` and `block_size` B (Q a multiple of B), `weights` say only which slots are
    scored and their total, and each scored slot weighs its D-PACE weight (blocks/loss.py), from the
    drafter's detached probability of the slot's label under the biased logits, rescaled to that
    total: the slot weighting DFlash's default uses, for the three-term loss."""
    if markov is None and confidence is not None:
        raise ValueError("dspark_loss: the confidence head reads the Markov head's embedding")
    if not (hidden.shape[:2] == labels.shape == weights.shape == prev.shape):
        raise ValueError(f"dspark_loss: hidden {tuple(hidden.shape)}, prev {tuple(prev.shape)}, labels "
                         f"{tuple(labels.shape)}, weights {tuple(weights.shape)} do not line up")
    if (soft_ids is None) != (soft_logprobs is None):
        raise ValueError("dspark_loss: soft_ids and soft_logprobs come together")
    h = hidden.reshape(-1, hidden.shape[-1])
    x, y, w = prev.reshape(-1), labels.reshape(-1), weights.reshape(-1).float()
    if dpace_alpha is not None:
        if not block_size or labels.shape[1] % block_size:
            raise ValueError(f"dspark_loss: D-PACE needs block_size dividing the {labels.shape[1]} slots of a row, "
                             f"got {block_size!r}")
        w = dpace_slot_weights(lambda sl: _biased_logits(h[sl], head_weight, markov, x[sl])[0], y, w, chunk_tokens,
                               dpace_alpha, block_size)
    ids = t = rest = None
    if soft_ids is not None:
        k = soft_ids.shape[-1]
        ids, t, rest = target_probs(soft_ids.reshape(-1, k), soft_logprobs.reshape(-1, k), w != 0)
    grad = torch.is_grad_enabled()
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(2, device=hidden.device)
    correct = []
    for a in range(0, h.shape[0], chunk_tokens):
        sl = slice(a, a + chunk_tokens)
        args = (h[sl], head_weight, markov, confidence, x[sl], y[sl], w[sl],
                *((None, None, None) if ids is None else (ids[sl], t[sl], rest[sl])), loss_weights)
        # A short last chunk runs eagerly: a second shape would be a recompile every run.
        fn = compiled_once(_chunk) if compiled and args[0].shape[0] == min(chunk_tokens, h.shape[0]) else _chunk
        s, c, st = checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)
        total = total + s
        stats = stats + st.detach()
        correct.append(c.detach())
    return DSparkLoss(total, torch.cat(correct).view_as(labels), stats[0], stats[1])

