"""How the next token is chosen, for `generate` and `eval`: greedy, or sampled from the target's
temperature / top-k / top-p distribution with counter-based noise; and speculative sampling's
verification rule, which keeps a speculative decode's output distributed exactly as the target's
own sampling.

Noise is a pure function of a key (seed, prompt key, output index, purpose), never a generator's
state: a prompt decodes to the same tokens whatever batch it lands in, whichever decoder runs it
(one prompt at a time, batched, CUDA graphs), and nothing here synchronises with the host.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), as the reference implementation
(`dflash.model._rejection_sample`) applies it to a block: draft token d_j, drawn from the drafter's
distribution q_j, is accepted with probability min(1, p_j(d_j) / q_j(d_j)) (p_j: the target's
distribution at that slot), in order, until the first rejection; at the rejected slot a token is
drawn from the residual max(0, p_j - q_j) (normalised; p_j itself where the residual is empty);
when every draft is accepted, the bonus token is drawn from p at the slot after the last draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_offline.options import Configured, check_at_least, check_number, opt, where
from dflash_offline.runtime.errors import UserError

if TYPE_CHECKING:
    import torch



@dataclass
class SamplingOptions(Configured):
    """The sampling options `generate` and `eval` share, declared once (their command-line options
    are built from these fields, listed after each command's own)."""

    # Greedy is argmax. eval draws drafts from the drafter's distribution and verifies them by speculative
    # sampling's rule (this module's docstring).
    temperature: float = opt(0.0, "0 = greedy (eval: outputs checked equal to the target's); above 0 (finite), "
                             "sampling at this temperature (eval: speculative sampling, output distributed as the "
                             "target's own sampling).")
    # The nucleus: the smallest set of most likely tokens whose probability reaches top_p.
    top_p: float = opt(1.0, "Sampling: nucleus mass kept, in (0, 1].")
    seed: int = opt(0, "Sampling: the noise of each prompt depends only on (seed, prompt id, output position).")

    def check_sampling(self) -> None:
        """The shared options' ranges, each named as it was given (flag or recipe key): NaN and
        infinite temperatures are refused, and seeds are >= 0 (the noise keys on 63 bits of it,
        so a negative seed would repeat another's noise)."""
        check_number(self, "temperature", 0, open_high=True, must=">= 0 and finite", why="0 = greedy")
        check_number(self, "top_p", 0, 1, open_low=True, must="in (0, 1]",
                     why="the probability mass of the tokens sampling keeps")
        check_at_least(self, "seed", 0, "it keys the sampling noise")
        if self.temperature == 0:  # greedy: a filter of the sampled distribution would be ignored
            for name, off in (("top_p", 1.0), ("top_k", 0)):
                value = getattr(self, name, off)
                if value != off:
                    raise UserError(f"{where(self, name)} {value} applies to sampling, but --temperature is 0 "
                                    f"(greedy); give --temperature > 0 to sample, or leave {where(self, name)} out")


@dataclass(frozen=True)
class Sampling:
    """Greedy (temperature 0) or sampled with temperature, top-p (nucleus) and top-k."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # 0: the whole vocabulary

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


# ----------------------------------------------------------------------------------------------
# Counter-based noise: splitmix64 in int64 arithmetic (multiplication wraps modulo 2^64 on CPU and
# CUDA alike; right shifts are made logical with a mask).

GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ shift_right(x, 30)) * _MIX1
    x = (x ^ shift_right(x, 27)) * _MIX2
    return x ^ shift_right(x, 31)


def _to_unit(bits: torch.Tensor) -> torch.Tensor:
    """int64 hash -> float64 strictly inside (0, 1): its top 52 bits + 0.5, over 2^52 (with 53
    bits, all ones + 0.5 rounds up to exactly 1.0, which `draw` and a Gumbel log cannot take)."""
    import torch

    return (shift_right(bits, 12).to(torch.float64) + 0.5) * (1.0 / (1 << 52))


def seed_key(seed: int, like: torch.Tensor) -> torch.Tensor:
    """The seed's part of every key, shaped like `like` (Python ints would overflow int64 before
    wrapping: every product is taken between tensors)."""
    import torch
    return mix(torch.full_like(like, int(seed) & ((1 << 63) - 1), dtype=torch.int64) * GOLDEN + 1)


def uniform_noise(seed: int, row_ids: torch.Tensor, step, vocab: int) -> torch.Tensor:
    """[rows, vocab] float64 in (0, 1): a pure function of (seed, row id, step, vocabulary index)
    (generate's Gumbel noise). step: one for all rows, or a tensor [rows] (each row's own)."""
    import torch
    key = mix(seed_key(seed, row_ids) + row_ids * GOLDEN)
    steps = step + 1 if isinstance(step, torch.Tensor) else torch.full_like(row_ids, int(step) + 1)
    key = mix(key + steps * GOLDEN)
    v = torch.arange(1, vocab + 1, device=row_ids.device, dtype=torch.int64)
    return _to_unit(mix(key[:, None] + v[None, :] * GOLDEN))


# What a uniform is drawn for, part of its key: a draft token, its acceptance, a target token.
DRAFT, ACCEPT, TARGET = 1, 2, 3


def keyed_uniform(seeded: torch.Tensor, index: torch.Tensor, purpose: int) -> torch.Tensor:
    """float64 in (0, 1) shaped like `index` [R, ...]: a pure function of (seed, prompt key, output
    index, purpose). `seeded` [R] = mix(seed_key(seed) + prompt_key * GOLDEN), made once per batch."""
    seeded = seeded.reshape(seeded.shape + (1,) * (index.dim() - 1))
    return _to_unit(mix(seeded + (index * 4 + purpose) * GOLDEN))


def prompt_keys(seed: int, keys: torch.Tensor) -> torch.Tensor:
    """[R] int64 prompt keys -> the per-row part of keyed_uniform's key."""
    return mix(seed_key(seed, keys) + keys * GOLDEN)


# ----------------------------------------------------------------------------------------------
# Distributions and draws


def sampling_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[..., V] logits -> float32 probabilities of the temperature-scaled distribution, restricted
    to the top_k most likely tokens, then to the smallest prefix (by probability) whose mass reaches
    top_p (its first token always), renormalised: the reference implementation's order."""
    scores = logits.float() / s.temperature
    V = scores.shape[-1]
    if 0 < s.top_k < V:
        kth = scores.topk(s.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(-1)
    if s.top_p < 1.0:
        probs = probs * top_p_keep(probs, s.top_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] probabilities -> bool mask of the nucleus: the smallest prefix, by probability,
    whose mass reaches top_p (its first token always). eval's distributions and generate's Gumbel
    draw both filter through it."""
    import torch
    sorted_p, order = probs.sort(-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [..., V] (need not sum to 1), u [...] in (0, 1) -> token ids [...].
    A token of probability 0 is never drawn (its cumulative mass equals its predecessor's)."""
    import torch
    cdf = probs.double().cumsum(-1)
    t = (u * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, t, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a draft drawn from q was rejected against p: max(0, p - q), renormalised by `draw`;
    p itself where nothing is left (p <= q everywhere, up to rounding)."""
    import torch
    resid = (p - q).clamp_min(0)
    empty = resid.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p, resid)


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor, limit: torch.Tensor):
    """Greedy verification of a block. draft [R, K]; target_logits [R, K+1, V] (slot j: the
    target's next token after block position j); limit [R]: drafts that may count (a block cut
    short at the end of the output). -> (accepted drafts [R], the target's token after them [R])."""
    import torch
    best = target_logits.argmax(-1)
    K = draft.shape[1]
    ok = (draft == best[:, :K]) & (torch.arange(K, device=draft.device)[None, :] < limit[:, None])
    accepted = ok.long().cumprod(-1).sum(-1)
    return accepted, best.gather(1, accepted[:, None])[:, 0]


def verify_sampled(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, limit: torch.Tensor,
                   u_accept: torch.Tensor, u_next: torch.Tensor):
    """Speculative sampling's verification (module docstring). draft [R, K] drawn from q [R, K, V];
    p [R, K+1, V] the target's distributions; limit [R] as verify_greedy's; uniforms u_accept
    [R, K] (slot j's acceptance) and u_next [R, K+1] (slot j's residual or bonus draw).
    -> (accepted drafts [R], the next token [R]: residual draw at the first rejection, or the bonus)."""
    import torch
    K = draft.shape[1]
    if K == 0:  # no drafts (the target alone): a draw from p
        return draft.new_zeros(draft.shape[0]), draw(p[:, 0], u_next[:, 0])
    p_d = p[:, :K].gather(-1, draft[..., None])[..., 0]
    q_d = q.gather(-1, draft[..., None])[..., 0]
    # u * q < p  <=>  u < p / q: accepted with probability min(1, p / q).
    ok = (u_accept * q_d < p_d) & (torch.arange(K, device=draft.device)[None, :] < limit[:, None])
    accepted = ok.long().cumprod(-1).sum(-1)
    p_a = p.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]
    q_a = q.gather(1, accepted.clamp_max(K - 1)[:, None, None].expand(-1, 1, q.shape[-1]))[:, 0]
    rejected = (accepted < limit)[:, None]
    u = u_next.gather(1, accepted[:, None])[:, 0]
    return accepted, draw(torch.where(rejected, residual_distribution(p_a, q_a), p_a), u)


# ----------------------------------------------------------------------------------------------
# The decoders' three choices, row by row: one rule for the one-prompt, batched and static decoders.
# `seeded` [R] (prompt_keys), `at` [R]: the output index of the token being chosen (a block's
# first draft / the token after its anchor).


def target_tokens(logits: torch.Tensor, s: Sampling, seeded: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The target's own next token from logits [R, V]: argmax, or a keyed draw."""
    if s.greedy:
        return logits.argmax(-1)
    return draw(sampling_probs(logits, s), keyed_uniform(seeded, at, TARGET))


def draft_tokens(draft_logits: torch.Tensor, s: Sampling, seeded: torch.Tensor, at: torch.Tensor):
    """Drafts [R, K] from the drafter's logits [R, K, V] (draft j at output index at + j), and the
    drafter's distribution q (None when greedy: verification then needs none)."""
    import torch

    if s.greedy:
        return draft_logits.argmax(-1), None
    q = sampling_probs(draft_logits, s)
    index = at[:, None] + torch.arange(q.shape[1], device=at.device)
    return draw(q, keyed_uniform(seeded, index, DRAFT)), q


def verify_block(drafts: torch.Tensor, q: torch.Tensor | None, target_logits: torch.Tensor, limit: torch.Tensor,
                 s: Sampling, seeded: torch.Tensor, at: torch.Tensor):
    """(accepted drafts [R], the next token [R]) for drafts [R, K] against the target's logits
    [R, K+1, V]: verify_greedy, or verify_sampled with the keyed uniforms of these output indices."""
    import torch

    if s.greedy:
        return verify_greedy(drafts, target_logits, limit)
    K = drafts.shape[1]
    index = at[:, None] + torch.arange(K + 1, device=at.device)
    return verify_sampled(drafts, q, sampling_probs(target_logits, s), limit,
                          keyed_uniform(seeded, index[:, :K], ACCEPT), keyed_uniform(seeded, index, TARGET))
