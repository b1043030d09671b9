"""Batched speculative decoding with KV caches: `eval --batch-size N`.

Many prompts decode together, each at its own pace. The target keeps one transformers cache for
the batch, its keys/values laid out in *slots* shared by all rows (slot j of every row is written
by the same forward); each row has its own positions and a slot mask that says which slots hold
its committed tokens. A round:

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
precedes its anchor's, so each position sees exactly the tokens before it.

A hybrid target's Gated DeltaNet layers keep one recurrent state per row, which cannot hold holes:
it is copied before each verify, and every row that rejected drafts is restored and run again over
the tokens it kept (one forward per distinct kept length, over those rows alone). Prompts are left-
padded, so the state stays zero until a row's first token.

Sampling (a keyed draw per output index, dflash_offline.sampling) gives each prompt the same
tokens as the one-prompt decoder, whatever its batch. Outputs, rounds and accepted lengths equal the one-prompt decoder's (tests/test_batched_eval.py,
dense and hybrid), up to floating-point summation order. A sliding-window target, whose window
would count holes as positions, uses the re-run decoder (evaluate.batched). `block_size=1` with no
drafter (`NoDrafts`) is the target alone, batched with the same cache: the baseline the speed-up
is measured against.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Protocol

import torch

from dflash_offline.evaluate.speculative import (COUNTER_ATTRS, STATE_ATTRS, Decoded, as_logits, commit_round,
                                                 in_length_batches, output_done, snapshot_states)
from dflash_offline.sampling import Sampling, draft_tokens, prompt_keys, target_tokens, verify_block
from dflash_offline.targets import families
from dflash_offline.targets.model import LayerCapture

log = logging.getLogger("dflash.eval")


def unsupported_reason(model) -> str | None:
    """Why this target cannot use the KV-cache batched decoder (None: it can)."""
    other = families.windowed_or_unknown(model.config)
    if other:
        return f"its layers include {', '.join(other)} (a sliding window would count holes as positions)"
    return None


class KVBatchProposer(Protocol):
    block_size: int

    def start(self, feats: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """The prompts' features [R, P, n*H] at positions [R, P]; valid [R, P] marks real tokens."""

    def propose(self, anchors: torch.Tensor, positions: torch.Tensor, seqs: list[list[int]],
                block_len: torch.Tensor) -> torch.Tensor:
        """Logits [R, B-1, V] of the drafts after each row's anchor token (at `positions` [R]) from
        a block of block_len [R] tokens (fewer in an output's last round); seqs: committed tokens.
        (An oracle may return draft tokens [R, B-1] instead: read as one-hot logits.)"""

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

    def propose(self, anchors, positions, seqs, block_len):
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

    def propose(self, anchors, positions, seqs, block_len):
        R, B = anchors.shape[0], self.block_size
        block = torch.full((R, B), self.mask_id, dtype=torch.long, device=anchors.device)
        block[:, 0] = anchors
        pos = positions[:, None] + torch.arange(B, device=anchors.device)
        h = self.drafter.draft_hidden(self.kv, block, pos, ctx_mask=self.valid, block_len=block_len)
        return torch.nn.functional.linear(h[:, 1:], self.drafter.lm_head.weight.to(h.dtype)).float()

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


# Cache layer classes of transformers whose state the slot cache knows how to keep: keys/values
# by slot, and (hybrid targets) a recurrent state per row.
_KNOWN_LAYERS = {"DynamicLayer", "LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer"}


def _state_dicts(layer) -> list[dict]:
    """A cache layer's recurrent-state dicts ({index: tensor [R, ...]}), none for attention layers."""
    return [d for d in (getattr(layer, a, None) for a in STATE_ATTRS) if isinstance(d, dict)]


def _has_kv(layer) -> bool:
    return isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4


class SlotCache:
    """The target's cache for a batch: keys/values by slot with each row's slot mask (module
    docstring), and for a hybrid target each row's recurrent state, rolled back by `commit`."""

    def __init__(self, model, target_layers: list[int]):
        from transformers import DynamicCache

        from dflash_offline.targets.attention import cache_argument, use_grouped_attention

        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the KV-cache batched decoder cannot decode this target: {reason}")
        # Grouped-query attention without a copy of the cache per query head (generate's decoder
        # does the same; the scores are SDPA's).
        use_grouped_attention(model)
        self.model, self.target_layers = model, list(target_layers)
        self.cache = DynamicCache(config=model.config)
        self.cache_arg = cache_argument(model)
        self.recurrent = families.recurrent(model.config)
        self.valid: torch.Tensor | None = None  # [R, S] bool: slot holds a committed token
        self._snapshot: list[dict] | None = None  # speculative.snapshot_states before the last forward

    def _run(self, cache, ids, positions, mask, features: bool):
        with LayerCapture(self.model, self.target_layers if features else []) as raw:
            out = self.model.model(input_ids=ids, position_ids=positions, attention_mask=mask.long(), use_cache=True,
                                   **{self.cache_arg: cache})
        return out.last_hidden_state, (raw.features() if features else None)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, valid_new: torch.Tensor, features: bool):
        """Appends ids.shape[1] slots; -> (last hidden [R, T, H], features [R, T, n*H] or None).
        After the first forward (the prefill), a hybrid target's recurrent states are copied
        first, so that `commit` can roll them back."""
        # (A one-token forward is never rolled back: nothing to copy.)
        if self.valid is not None and self.recurrent and ids.shape[1] > 1:
            self._snapshot = snapshot_states(self.cache)
        mask = valid_new if self.valid is None else torch.cat([self.valid, valid_new], 1)
        out = self._run(self.cache, ids, positions, mask, features)
        if self.valid is None:
            kinds = {type(layer).__name__ for layer in self.cache.layers}
            if not kinds <= _KNOWN_LAYERS or (self.recurrent and not any(_state_dicts(x) for x in self.cache.layers)):
                # A cache holding other state (a sliding window, a recurrent state stored another
                # way by this transformers version) would be decoded wrongly: refuse, not guess.
                raise ValueError("the KV-cache batched decoder cannot decode this target: its cache holds "
                                 f"{', '.join(sorted(kinds))} layers")
        # Until commit() says otherwise, the new slots count as committed (the block attends to itself).
        self.valid = mask
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    def commit(self, keep: torch.Tensor, kept: list[int], ids: torch.Tensor, positions: torch.Tensor) -> None:
        """keep [R, T]: which of the last forward's T slots hold committed tokens (the first
        kept[r] of row r; ids/positions [R, T] that forward's input).

        Keys and values of rejected tokens just become holes. A recurrent state has absorbed every
        token of the forward, so each row that kept fewer is restored from the copy taken before it
        and run again over the tokens it kept: one forward per distinct kept length, over those
        rows alone, attending to their committed slots; its keys and values are dropped (the
        verify's are the same), only the recurrent states are kept."""
        T = keep.shape[1]
        pre = self.valid[:, :-T]
        self.valid[:, -T:] = keep
        if not self.recurrent:
            return
        groups: dict[int, list[int]] = {}
        for r, n in enumerate(kept):
            if n < T:
                groups.setdefault(n, []).append(r)
        dev = ids.device
        for n, rows in groups.items():
            idx = torch.tensor(rows, device=dev)
            sub = self._sub_cache(idx)
            mask = torch.cat([pre[idx], torch.zeros((len(rows), T), dtype=torch.bool, device=dev),
                              torch.ones((len(rows), n), dtype=torch.bool, device=dev)], 1)
            self._run(sub, ids[idx, :n], positions[idx, :n], mask, features=False)
            for layer, sub_layer in zip(self.cache.layers, sub.layers):
                for d, sd in zip(_state_dicts(layer), _state_dicts(sub_layer)):
                    for k, t in d.items():
                        if isinstance(t, torch.Tensor):
                            t.index_copy_(0, idx, sd[k].to(t.dtype))

    def _sub_cache(self, rows: torch.Tensor):
        """A cache of `rows` alone: their keys/values (copies) and their recurrent states from the
        copy taken before the last forward. Its layers are copies: nothing it appends reaches ours."""
        sub = copy.copy(self.cache)
        sub.layers = []
        for layer, snap in zip(self.cache.layers, self._snapshot):
            new = copy.copy(layer)
            for a in COUNTER_ATTRS:  # a length counter updated in place: the copy gets its own
                if isinstance(t := getattr(layer, a, None), torch.Tensor):
                    setattr(new, a, t.clone())
            if _has_kv(layer):
                new.keys, new.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
            for attr in STATE_ATTRS:
                if attr in snap:
                    setattr(new, attr, {k: (t.index_select(0, rows) if isinstance(t, torch.Tensor) else t)
                                        for k, t in snap[attr].items()})
            sub.layers.append(new)
        return sub

    def select(self, rows: torch.Tensor | None, slots: torch.Tensor | None) -> None:
        for layer in self.cache.layers:
            if _has_kv(layer):
                layer.keys = gather_slots(layer.keys, rows, slots)
                layer.values = gather_slots(layer.values, rows, slots)
            if rows is not None:
                for d in _state_dicts(layer):
                    for k, t in d.items():
                        if isinstance(t, torch.Tensor):
                            d[k] = t.index_select(0, rows)
        if rows is not None:
            self.valid = self.valid.index_select(0, rows)
        if slots is not None:
            self.valid = self.valid.gather(1, slots)
            # The cache's length (the next forward's slots) may be read from a linear layer's
            # token counter (transformers >= 5.25) rather than from the keys: keep them equal.
            for layer in self.cache.layers:
                for a in COUNTER_ATTRS:
                    if isinstance(t := getattr(layer, a, None), torch.Tensor):
                        t.fill_(slots.shape[1])

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
def decode_batch_kv(model, proposer: KVBatchProposer, target_layers: list[int], prompts: list[list[int]],
                    max_new: int, eos: set[int], pad_id: int = 0, sampling: Sampling = Sampling(),
                    keys: list[int] | None = None) -> list[Decoded]:
    """Speculative decoding of `prompts` together; per prompt as speculative_decode (greedy or
    sampled with the same keyed noise: keys[r] is prompt r's key)."""
    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    B, n = proposer.block_size, len(prompts)
    target = SlotCache(model, target_layers)
    P = max(len(p) for p in prompts)
    # Left padding: a Gated DeltaNet's state stays exactly zero over masked (zeroed) inputs until
    # a row's first token, and every row's last prompt token sits in the last slot.
    ids = torch.full((n, P), pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    valid = torch.arange(P, device=dev)[None, :] >= (P - lens)[:, None]
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    hidden, feats = target.forward(ids.to(dev), positions, valid, features=B > 1)
    seeded = prompt_keys(sampling.seed, torch.tensor(keys if keys is not None else list(range(n)), device=dev))
    anchors = target_tokens(target.logits(hidden[:, -1]), sampling, seeded, torch.zeros(n, dtype=torch.long, device=dev))
    proposer.start(feats, positions, valid)
    pos = lens.clone()  # each row's anchor position
    seqs = [list(p) + [t] for p, t in zip(prompts, anchors.tolist())]
    outs = [s[len(p):] for s, p in zip(seqs, prompts)]
    held = [len(p) for p in prompts]  # committed slots of each prompt (its anchor not yet among them)
    accepted: list[list[int]] = [[] for _ in prompts]
    committed_log: list[list[int]] = [[] for _ in prompts]
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
            anchors, pos, seeded = anchors[keep], pos[keep], seeded[keep]
            batch = [batch[i] for i in still]
        slots = target.packed_slots(max(held[r] for r in batch))
        if slots is not None:
            target.select(None, slots)
            proposer.select(None, slots)
        at = torch.tensor([len(outs[r]) for r in batch], device=dev)  # output index of each row's first draft
        # Drafts that can still be committed (an output's last round drafts fewer, the reference's rule).
        limit = (max_new - at).clamp(max=B - 1)
        draft_logits = as_logits(proposer.propose(anchors, pos, [seqs[r] for r in batch], limit + 1), model.config.vocab_size)
        draft, q = draft_tokens(draft_logits, sampling, seeded, at)
        block = torch.cat([anchors[:, None], draft], 1)
        bpos = pos[:, None] + steps
        hidden, feats = target.forward(block, bpos, torch.ones_like(block, dtype=torch.bool), features=B > 1)
        acc, nxt = verify_block(draft, q, target.logits(hidden), limit, sampling, seeded, at)
        # One copy to the host per round (the drafts, the next tokens, the accepted lengths).
        host = torch.cat([draft, nxt[:, None], acc[:, None]], 1).tolist()
        committed = steps[None, :] <= acc[:, None]  # the anchor and the accepted drafts
        target.commit(committed, [h[-1] + 1 for h in host], block, bpos)
        proposer.observe(feats, bpos, committed)
        anchors = nxt
        pos = pos + acc + 1
        for i, r in enumerate(batch):
            d_host, nxt_host, a = host[i][:B - 1], host[i][B - 1], host[i][-1]
            accepted[r].append(a)
            forwards[r] += 1
            held[r] += a + 1
            new = commit_round(outs[r], d_host, a, nxt_host, max_new, eos)
            committed_log[r].append(len(new))
            seqs[r] += new
    seconds = (time.perf_counter() - t0) / n  # the batch's wall time, shared by its prompts
    return [Decoded(outs[r], accepted[r], seconds, forwards[r], committed_log[r]) for r in range(n)]


def kv_batched_decode(model, proposer: KVBatchProposer, target_layers: list[int], prompts: list[list[int]],
                      max_new: int, eos: set[int], batch_size: int, on_batch=None, sampling: Sampling = Sampling(),
                      keys: list[int] | None = None) -> list[Decoded]:
    """All prompts in batches of `batch_size`, grouped by length (less padding); results in input
    order; keys: each prompt's sampling key (default its index)."""
    keys = list(range(len(prompts))) if keys is None else list(keys)
    return in_length_batches(prompts, batch_size, lambda part: decode_batch_kv(
        model, proposer, target_layers, [prompts[i] for i in part], max_new, eos, sampling=sampling,
        keys=[keys[i] for i in part]), on_batch)
