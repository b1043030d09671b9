"""Batched lossless speculative decoding for `eval --batch-size N`: many prompts per target forward.

The one-prompt decoder (evaluate.speculative) keeps a KV cache and runs one small forward
per round: on a GPU it is launch-bound (about 13 ms a round for the 17M pycode target, whatever
the block size), so 200 prompts take many minutes. Here up to N prompts decode together and every
round re-runs the target over each active prompt's whole sequence, without a cache:

  round: the drafter drafts a block for every active row (its context: the target features of
         the row's committed positions before the anchor, from the last forward), then one target
         forward over [committed | draft] of every row (right-padded) verifies all blocks.

Why this is exact: right padding comes after a row's real tokens, so causal attention (and a
Gated DeltaNet's left-to-right recurrence) never lets it reach a real position; the features of
a position depend only on the tokens up to it, all committed, so the recomputed context is the one
a cached decoder holds. Output, rounds and accepted lengths equal the one-prompt decoder's
(tests/test_batched_eval.py, dense and hybrid targets, in fp32); only floating-point summation
order differs, which can flip a near-tie of two logits (the check against the target's greedy
decode reports it).

Cost: each round costs a forward over the whole sequences (quadratic in length over a decode):
right for small targets and evaluation sets, where the launch overhead of one-prompt decoding
dominates; not a serving decoder. Rows are grouped by prompt length so that padding stays small.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np
import torch

from dflash_offline.evaluate.speculative import Decoded, commit_round, in_length_batches, output_done
from dflash_offline.sampling import verify_greedy
from dflash_offline.targets.model import LayerCapture

log = logging.getLogger("dflash.eval")


class BatchProposer(Protocol):
    block_size: int

    def propose(self, feats: torch.Tensor, ctx_len: torch.Tensor, anchors: torch.Tensor,
                seqs: list[list[int]], block_len: torch.Tensor) -> torch.Tensor:
        """[A, B-1] draft tokens for A rows: feats [A, S, n*H] holds each row's target features by
        position (valid below ctx_len [A], the anchor's position), anchors [A] the last committed
        tokens, seqs the committed tokens of each row, block_len [A] the tokens of each row's block
        (fewer in an output's last round; drafts beyond are not used)."""


class BatchDFlashProposer:
    """The drafter's training forward over each row's context with a mask per row: block queries
    see the row's first ctx_len positions and the whole block (the inference rule)."""

    def __init__(self, drafter, device: str, dtype: str = "float32"):
        self.drafter = drafter.to(device=device, dtype=getattr(torch, dtype)).eval()
        self.device = device
        self.block_size = drafter.cfg.block_size
        self.mask_id = drafter.cfg.mask_token_id

    @torch.no_grad()
    def propose(self, feats, ctx_len, anchors, seqs, block_len):
        A, S, _ = feats.shape
        B, dev = self.block_size, feats.device
        block = torch.full((A, B), self.mask_id, dtype=torch.long, device=dev)
        block[:, 0] = anchors
        ctx_pos = torch.arange(S, device=dev).expand(A, S)
        block_pos = ctx_len[:, None] + torch.arange(B, device=dev)
        mask = torch.ones((A, 1, B, S + B), dtype=torch.bool, device=dev)
        mask[:, 0, :, :S] = (torch.arange(S, device=dev)[None, :] < ctx_len[:, None])[:, None, :]
        mask[:, 0, :, S:] = (torch.arange(B, device=dev)[None, :] < block_len[:, None])[:, None, :]
        h = self.drafter(feats.to(self.drafter.fc.weight.dtype), block, ctx_pos, block_pos, mask)
        logits = torch.nn.functional.linear(h[:, 1:], self.drafter.lm_head.weight.to(h.dtype))
        return logits.argmax(-1)


def _target_forward(model, ids: torch.Tensor, target_layers: list[int], starts: torch.Tensor, width: int):
    """One forward of right-padded rows: (features [R, T, n*H] by position, logits [R, width, V]
    of the `width` positions from each row's start)."""
    with LayerCapture(model, target_layers) as raw:  # raw layer outputs, as extraction stores them
        out = model.model(input_ids=ids, use_cache=False)
    feats = raw.features()
    idx = starts[:, None] + torch.arange(width, device=ids.device)
    last = out.last_hidden_state.gather(1, idx[:, :, None].expand(-1, -1, out.last_hidden_state.shape[-1]))
    return feats, model.lm_head(last).float()


@torch.inference_mode()
def decode_batch(model, proposer: BatchProposer, target_layers: list[int], prompts: list[list[int]], max_new: int,
                 eos: set[int], pad_id: int = 0) -> list[Decoded]:
    """Greedy speculative decoding of `prompts` together; per prompt as speculative_decode."""
    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    B = proposer.block_size
    n = len(prompts)
    P = max(len(p) for p in prompts)
    ids = torch.full((n, P), pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    feats, logits = _target_forward(model, ids.to(dev), target_layers, lens - 1, 1)
    first = logits[:, 0].argmax(-1).tolist()
    seqs = [list(p) + [t] for p, t in zip(prompts, first)]
    # Committed tokens by position (pad beyond each row's length), copied to the device per round.
    tok = np.full((n, P + 1 + max_new + B), pad_id, np.int64)
    for r, s in enumerate(seqs):
        tok[r, :len(s)] = s
    outs = [[t] for t in first]
    accepted: list[list[int]] = [[] for _ in prompts]
    committed: list[list[int]] = [[] for _ in prompts]
    forwards = [1] * n
    active = [r for r in range(n) if not output_done(outs[r], max_new, eos)]
    rows = torch.arange(n, device=dev)  # row of `feats` for each prompt still in it
    while active:
        sel = rows[torch.tensor(active, device=dev)]
        ctx_len = torch.tensor([len(seqs[r]) - 1 for r in active], device=dev)
        S = int(ctx_len.max())
        anchors = torch.tensor([seqs[r][-1] for r in active], device=dev)
        limit = torch.tensor([min(B - 1, max_new - len(outs[r])) for r in active], device=dev)
        draft = proposer.propose(feats[sel, :S], ctx_len, anchors, [seqs[r] for r in active], limit + 1)
        T = S + B  # the longest row: its committed tokens (S + 1) and B - 1 drafts
        ids = torch.from_numpy(tok[active, :T]).to(dev)
        # The drafts follow each row's anchor (position ctx_len): scatter them there.
        dpos = ctx_len[:, None] + 1 + torch.arange(B - 1, device=dev)
        ids.scatter_(1, dpos, draft)
        feats, logits = _target_forward(model, ids, target_layers, ctx_len, B)
        acc, nxt = verify_greedy(draft, logits, limit)
        d_host, n_host, a_host = draft.tolist(), nxt.tolist(), acc.tolist()
        still = []
        for i, r in enumerate(active):
            a = a_host[i]
            accepted[r].append(a)
            forwards[r] += 1
            new = commit_round(outs[r], d_host[i], a, n_host[i], max_new, eos)
            committed[r].append(len(new))
            tok[r, len(seqs[r]):len(seqs[r]) + len(new)] = new
            seqs[r] += new
            if not output_done(outs[r], max_new, eos):
                still.append(r)
        rows = torch.full((n,), -1, dtype=torch.long, device=dev)
        rows[torch.tensor(active, device=dev)] = torch.arange(len(active), device=dev)
        active = still
    seconds = (time.perf_counter() - t0) / n  # the batch's wall time, shared by its prompts
    return [Decoded(outs[r], accepted[r], seconds, forwards[r], committed[r]) for r in range(n)]


def batched_speculative_decode(model, proposer: BatchProposer, target_layers: list[int], prompts: list[list[int]],
                               max_new: int, eos: set[int], batch_size: int, on_batch=None) -> list[Decoded]:
    """All prompts in batches of `batch_size`, grouped by length (less padding); results in input order."""
    return in_length_batches(prompts, batch_size,
                             lambda part: decode_batch(model, proposer, target_layers, [prompts[i] for i in part], max_new, eos),
                             on_batch)
