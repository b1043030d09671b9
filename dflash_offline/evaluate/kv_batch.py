"""Batched speculative decoding with KV caches: `eval --batch-size N` on attention-only targets.

Many prompts decode together, each at its own pace. The target keeps one transformers KV cache for
the batch, laid out in *slots* shared by all rows (slot j of every row is written by the same
forward); each row has its own positions and a slot mask that says which slots hold its committed
tokens. A round:

  draft   the drafter drafts a block [anchor, MASK x (B-1)] for every row over its cached context
          keys/values (the same slot layout and mask as the target's);
  verify  one target forward of the B block tokens of every row, at the row's own positions
          (`position_ids`), attending to the row's committed slots (`attention_mask`), appends B
          slots to both caches;
  commit  row r accepts a_r drafts: the anchor and those drafts keep their slots, the other
          B - 1 - a_r slots become holes (masked from then on); the target's token after them is
          the next anchor.

Nothing is cropped or copied per row; rows that finish leave the batch (their cache rows are
dropped), and when holes make up most of the cache it is compacted (each row's committed slots
gathered to the front, order kept). Attention is causal by slot and every committed slot of a row
precedes its anchor's, so each position sees exactly the tokens before it: outputs, rounds and
accepted lengths equal the one-prompt decoder's (tests/test_batched_eval.py), up to floating-point
summation order.

A Gated DeltaNet (or any recurrent) layer keeps one state per row that cannot hold holes: hybrid
targets use the re-run decoder (evaluate.batched) instead. `block_size=1` with no drafter
(`NoDrafts`) is the target alone, batched with the same cache: the baseline the speed-up is
measured against.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from dflash_offline.evaluate.speculative import Decoded, output_done

log = logging.getLogger("dflash.eval")


def unsupported_reason(model) -> str | None:
    """Why this target cannot use the KV-cache batched decoder (None: it can)."""
    types = getattr(model.config, "layer_types", None) or []
    other = sorted({t for t in types if t not in ("full_attention",)})
    if other:
        return (f"its layers include {', '.join(other)} (a recurrent state per row cannot skip rejected drafts, "
                "and a sliding window would count holes)")
    return None


class KVBatchProposer(Protocol):
    block_size: int

    def start(self, feats: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """The prompts' features [R, P, n*H] at positions [R, P]; valid [R, P] marks real tokens."""

    def propose(self, anchors: torch.Tensor, positions: torch.Tensor, seqs: list[list[int]]) -> torch.Tensor:
        """[R, B-1] drafts after each row's anchor token (at `positions` [R]); seqs: committed tokens."""

    def observe(self, feats: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """A verified block's features [R, B, n*H]; valid [R, B] marks the committed positions."""

    def select(self, rows: torch.Tensor | None, slots: torch.Tensor | None) -> None:
        """Keep only `rows` of the batch; then, if `slots` [R', S'] is given, gather those slots."""


def gather_slots(t: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor | None) -> torch.Tensor:
    """t [R, H, S, D] (a cache tensor) -> the kept rows, then per row the slots `slots` [R', S']."""
    if rows is not None:
        t = t.index_select(0, rows)
    if slots is not None:
        t = t.gather(2, slots[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
    return t


class NoDrafts:
    """Block size 1: every round verifies the anchor alone, i.e. the target decodes by itself."""

    block_size = 1

    def start(self, feats, positions, valid) -> None:
        pass

    def propose(self, anchors, positions, seqs):
        return anchors.new_empty((anchors.shape[0], 0))

    def observe(self, feats, positions, valid) -> None:
        pass

    def select(self, rows, slots) -> None:
        pass


class KVBatchDFlashProposer:
    """The trained drafter with its context keys/values cached per slot (mask as the target's)."""

    def __init__(self, drafter, device: str, dtype: str = "float32"):
        self.drafter = drafter.to(device=device, dtype=getattr(torch, dtype)).eval()
        self.block_size = drafter.cfg.block_size
        self.mask_id = drafter.cfg.mask_token_id
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.valid: torch.Tensor | None = None

    def start(self, feats, positions, valid) -> None:
        self.kv = self.drafter.context_kv(feats, positions)
        self.valid = valid

    def propose(self, anchors, positions, seqs):
        R, B = anchors.shape[0], self.block_size
        block = torch.full((R, B), self.mask_id, dtype=torch.long, device=anchors.device)
        block[:, 0] = anchors
        pos = positions[:, None] + torch.arange(B, device=anchors.device)
        h = self.drafter.draft_hidden(self.kv, block, pos, ctx_mask=self.valid)
        logits = torch.nn.functional.linear(h[:, 1:], self.drafter.lm_head.weight.to(h.dtype))
        return logits.argmax(-1)

    def observe(self, feats, positions, valid) -> None:
        new = self.drafter.context_kv(feats, positions)
        self.kv = [(torch.cat([k0, k1.to(k0.dtype)], 2), torch.cat([v0, v1.to(v0.dtype)], 2))
                   for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.valid = torch.cat([self.valid, valid], 1)

    def select(self, rows, slots) -> None:
        self.kv = [(gather_slots(k, rows, slots), gather_slots(v, rows, slots)) for k, v in self.kv]
        if rows is not None:
            self.valid = self.valid.index_select(0, rows)
        if slots is not None:
            self.valid = self.valid.gather(1, slots)


class SlotCache:
    """The target's KV cache for a batch, by slot, with each row's slot mask (module docstring)."""

    def __init__(self, model, layer_ids: list[int]):
        from transformers import DynamicCache

        from dflash_offline.generate.decoding import cache_argument, use_grouped_attention

        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the KV-cache batched decoder cannot decode this target: {reason}")
        # Grouped-query attention without a copy of the cache per query head (generate's decoder
        # does the same; the scores are SDPA's).
        use_grouped_attention(model)
        self.model, self.layer_ids = model, list(layer_ids)
        self.cache = DynamicCache(config=model.config)
        self.cache_arg = cache_argument(model)
        self.valid: torch.Tensor | None = None  # [R, S] bool: slot holds a committed token

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, valid_new: torch.Tensor, features: bool):
        """Appends ids.shape[1] slots; -> (last hidden [R, T, H], features [R, T, n*H] or None)."""
        from dflash_offline.target.model import RawLayerOutputs

        mask = valid_new if self.valid is None else torch.cat([self.valid, valid_new], 1)
        with RawLayerOutputs(self.model, self.layer_ids if features else []) as raw:
            out = self.model.model(input_ids=ids, position_ids=positions, attention_mask=mask.long(), use_cache=True,
                                   **{self.cache_arg: self.cache})
        if self.valid is None and any(type(layer).__name__ != "DynamicLayer" for layer in self.cache.layers):
            # A model whose config names no layer types but whose cache holds other state
            # (recurrent, sliding window) would be decoded wrongly: refuse rather than guess.
            kinds = sorted({type(layer).__name__ for layer in self.cache.layers})
            raise ValueError(f"the KV-cache batched decoder cannot decode this target: its cache holds {', '.join(kinds)} "
                             "layers, not only plain key/value layers")
        # Until commit() says otherwise, the new slots count as committed (the block attends to itself).
        self.valid = mask
        return out.last_hidden_state, (raw.features() if features else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    def commit(self, keep: torch.Tensor) -> None:
        """keep [R, T]: which of the last forward's T slots hold committed tokens."""
        self.valid[:, -keep.shape[1]:] = keep

    def select(self, rows: torch.Tensor | None, slots: torch.Tensor | None) -> None:
        for layer in self.cache.layers:
            layer.keys = gather_slots(layer.keys, rows, slots)
            layer.values = gather_slots(layer.values, rows, slots)
        if rows is not None:
            self.valid = self.valid.index_select(0, rows)
        if slots is not None:
            self.valid = self.valid.gather(1, slots)

    def packed_slots(self, width: int) -> torch.Tensor | None:
        """Slot indices [R, width] that move every row's committed slots to the front (in order),
        `width` = the most committed slots any row holds (known on the host: no device sync);
        None while holes are under half of the cache."""
        if 2 * width > self.valid.shape[1]:
            return None
        # A stable sort of "is a hole" puts the committed slots first, in their order.
        order = torch.sort((~self.valid).to(torch.uint8), dim=1, stable=True).indices
        return order[:, :width]


@torch.inference_mode()
def decode_batch_kv(model, proposer: KVBatchProposer, layer_ids: list[int], prompts: list[list[int]],
                    max_new: int, eos: set[int], pad_id: int = 0) -> list[Decoded]:
    """Greedy speculative decoding of `prompts` together; per prompt as speculative_decode."""
    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    B, n = proposer.block_size, len(prompts)
    target = SlotCache(model, layer_ids)
    P = max(len(p) for p in prompts)
    ids = torch.full((n, P), pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    positions = torch.arange(P, device=dev).expand(n, P)
    valid = positions < lens[:, None]
    hidden, feats = target.forward(ids.to(dev), positions, valid, features=B > 1)
    last = hidden.gather(1, (lens - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))
    anchors = target.logits(last)[:, 0].argmax(-1)
    proposer.start(feats, positions, valid)
    pos = lens.clone()  # each row's anchor position
    seqs = [list(p) + [t] for p, t in zip(prompts, anchors.tolist())]
    outs = [s[len(p):] for s, p in zip(seqs, prompts)]
    held = [len(p) for p in prompts]  # committed slots of each prompt (its anchor not yet among them)
    accepted: list[list[int]] = [[] for _ in prompts]
    forwards = [1] * n
    batch = list(range(n))  # prompt index of each row of the batch
    steps = torch.arange(B, device=dev)
    while True:
        still = [i for i, r in enumerate(batch) if not output_done(outs[r], max_new, eos)]
        if len(still) < len(batch):  # finished rows leave the batch
            if not still:
                break
            keep = torch.tensor(still, device=dev)
            target.select(keep, None)
            proposer.select(keep, None)
            anchors, pos = anchors[keep], pos[keep]
            batch = [batch[i] for i in still]
        slots = target.packed_slots(max(held[r] for r in batch))
        if slots is not None:
            target.select(None, slots)
            proposer.select(None, slots)
        draft = proposer.propose(anchors, pos, [seqs[r] for r in batch])
        block = torch.cat([anchors[:, None], draft], 1)
        bpos = pos[:, None] + steps
        hidden, feats = target.forward(block, bpos, torch.ones_like(block, dtype=torch.bool), features=B > 1)
        best = target.logits(hidden).argmax(-1)  # best[:, j]: the target's token after block position j
        acc = (draft == best[:, :B - 1]).long().cumprod(-1).sum(-1)
        committed = steps[None, :] <= acc[:, None]  # the anchor and the accepted drafts
        target.commit(committed)
        proposer.observe(feats, bpos, committed)
        anchors = best.gather(1, acc[:, None])[:, 0]
        pos = pos + acc + 1
        # One copy to the host per round (the drafts, the target's tokens, the accepted lengths).
        host = torch.cat([draft, best, acc[:, None]], 1).tolist()
        for i, r in enumerate(batch):
            d_host, b_host, a = host[i][:B - 1], host[i][B - 1:2 * B - 1], host[i][-1]
            accepted[r].append(a)
            forwards[r] += 1
            held[r] += a + 1
            for t in d_host[:a] + [b_host[a]]:
                seqs[r].append(t)
                outs[r].append(t)
                if output_done(outs[r], max_new, eos):
                    break
    seconds = (time.perf_counter() - t0) / n  # the batch's wall time, shared by its prompts
    return [Decoded(outs[r], accepted[r], seconds, forwards[r]) for r in range(n)]


def kv_batched_decode(model, proposer: KVBatchProposer, layer_ids: list[int], prompts: list[list[int]],
                      max_new: int, eos: set[int], batch_size: int, on_batch=None) -> list[Decoded]:
    """All prompts in batches of `batch_size`, grouped by length (less padding); results in input order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[Decoded | None] = [None] * len(prompts)
    for k in range(0, len(order), batch_size):
        part = order[k:k + batch_size]
        for i, d in zip(part, decode_batch_kv(model, proposer, layer_ids, [prompts[i] for i in part], max_new, eos)):
            results[i] = d
        if on_batch is not None:
            on_batch([results[i] for i in part])
    return results  # type: ignore[return-value]
