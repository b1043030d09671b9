"""A drafter's acceptance on a cache of the target's completions, without running the target (`eval --cache`).

Both estimates score a block by the leading run of draft slots whose argmax equals the data token
(the training metrics' rule); with the target's own greedy completions the data tokens are its
greedy tokens. Training runs the walk on a held-out cache as it goes.

- The *walk* (`walk_acceptance`): every candidate anchor of every sample is scored, then the
  blocks decoding would draft are picked out: the first at the first completion token, each next
  one where the last one's committed tokens end. This is the decoding tau without the target
  (exactly, for greedy self-generated completions; `walk_acceptance` says where not).
- *Random anchors* (`cache_acceptance`): rows packed as in training, random blocks per row. It
  runs above the decoding tau (pycode: 2.27 against 1.69): random anchors weigh every position
  alike, while decoding starts each block where the last one ended, so it spends few blocks on
  easy stretches and many on hard ones. It ranks checkpoints like the walk.

tau = new tokens committed by verify rounds / verify rounds (the reference's rule; evaluate.speculative.summarize).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dflash_offline.cache.view import ManifestView
from dflash_offline.runtime.errors import UserError


def cache_layer_columns(manifest: dict, drafter_cfg, cache: str, option: str = "--cache") -> list[int] | None:
    """Where the drafter's layers sit on the cache's layer axis (hidden is [tokens, n, H]), in the
    drafter's order (its fc reads them concatenated in that order); None when the drafter reads
    every captured layer in the cache's order. A drafter trained on a subset of the captured
    layers (`train --target-layers`) is scored on those columns; a layer the cache lacks is refused
    (`option`: how the message names the cache, the flag or the recipe key and file)."""
    v = ManifestView.of(manifest)
    want = [int(i) for i in drafter_cfg.target_layer_ids]
    missing = v.missing_layers(want)
    if missing:
        raise UserError(f"{option} {cache} holds layers {list(v.layer_ids)} but the drafter reads {want} (no "
                        f"{missing}); extract the held-out cache with the drafter's layers")
    if (v.hidden_size, v.vocab_size) != (drafter_cfg.hidden_size, drafter_cfg.vocab_size):
        raise UserError(f"{option} {cache} was made from a target of hidden {v.hidden_size} and vocabulary "
                        f"{v.vocab_size}; the drafter has {drafter_cfg.hidden_size} and {drafter_cfg.vocab_size}")
    return v.layer_columns(want)


def _select_layers(target_hidden, layer_columns: list[int] | None, cache_layers: int):
    """[R, S, n*H] with all captured layers -> [R, S, len(layer_columns)*H] with the drafter's."""
    if layer_columns is None:
        return target_hidden
    R, S, width = target_hidden.shape
    return target_hidden.view(R, S, cache_layers, width // cache_layers)[:, :, layer_columns].reshape(R, S, -1)


# ----------------------------------------------------------------------------------------------
# Random anchors, packed as in training


def cache_acceptance(cache: str, drafter, device: str, seq_len: int, num_anchors: int,
                     max_rows: int | None = None, seed: int = 0, loss_chunk_tokens: int = 4096,
                     option: str = "--cache") -> dict:
    """tau and per-slot top-1 accuracy of `drafter` on a cache's samples, packed as in training
    (rows of seq_len, num_anchors random blocks per row, fixed seed), scored against the data.
    `option`: how messages name the cache (the flag, or the recipe key and file)."""
    import torch

    from dflash_offline.drafter import masks
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.blocks.loss import block_metrics
    from dflash_offline.blocks.packing import epoch_order
    from dflash_offline.blocks.pieces import pack_pieces, scan_samples
    from dflash_offline.blocks.stream import RowSpec, RowStream, Span, make_loader

    reader = CacheReader(cache)
    m = reader.manifest
    cfg = drafter.cfg
    layer_columns = cache_layer_columns(m, cfg, cache, option)
    view = ManifestView.of(m)
    n_cached = len(view.layer_ids)
    # Samples longer than a row are split as training's default splits them (blocks/pieces.py).
    table = scan_samples([(name, reader.shard(name)) for name in reader.shard_names], seq_len)
    rows = len(pack_pieces(table.pieces, epoch_order(len(table.refs), seed, 0), seq_len))
    steps = rows if max_rows is None else min(rows, max_rows)
    B = cfg.block_size
    # The stream reads every captured layer (its rows are [S, n*H] of the cache's n); the
    # drafter's columns are picked on the device.
    spec = RowSpec(seed=seed, seq_len=seq_len, num_anchors=num_anchors, block_size=B,
                   mask_token_id=cfg.mask_token_id, gamma=1.0, hidden_size=cfg.hidden_size,
                   row_layers=n_cached, hidden_dtype=view.hidden_dtype, label_offset=cfg.label_offset)
    stream = RowStream(cache, table.refs, table.lengths, spec, Span(0, 0, steps), 0, 1, 1, pieces=table.pieces)
    drafter = drafter.to(device)
    cuda = str(device).startswith("cuda")
    total: dict | None = None
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.no_grad():
            build = masks.flex_block_mask if cuda else masks.dense_mask
            for mb in make_loader(stream, 0, 1, pin=False):
                mb = mb.on(device)
                hidden = _select_layers(mb.target_hidden, layer_columns, n_cached)
                mask = build(mb.doc_ids, mb.anchors, mb.anchor_valid, B)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                    h = drafter(hidden, mb.block_ids, mb.ctx_positions, mb.block_positions, mask)
                    correct = slot_hits(drafter, h, mb, loss_chunk_tokens)
                got = block_metrics(correct, mb.weights, mb.anchor_valid, B, first_slot=1 - cfg.label_offset)
                total = got if total is None else {k: total[k] + got[k] for k in got}
    finally:
        drafter.train(was_training)
    if total is None or float(total["blocks"]) == 0:
        raise UserError(f"{option} {cache}: no valid draft block (no two consecutive loss-mask tokens)")
    cnt = total["slot_count"].cpu().numpy()
    acc = np.where(cnt > 0, total["slot_correct"].cpu().numpy() / np.maximum(cnt, 1), 0.0)
    return {"rows": steps, "blocks": int(total["blocks"]), "tau": float(total["tau_sum"] / total["blocks"]),
            "slot_accuracy": [float(a) for a in acc[1 - cfg.label_offset:]]}


# ----------------------------------------------------------------------------------------------
# The walk: decoding's blocks, picked out of every anchor's score


def slot_hits(drafter, h, mb, chunk_tokens: int):
    """[R, Q] whether each slot's argmax is its label: the LM head's (DFlash), or the Markov-biased
    logits given the data token before the slot (DSpark: teacher forcing, which is the draft chain
    itself up to its first miss, all that a leading run of hits counts)."""
    from dflash_offline.blocks.loss import block_loss

    if drafter.cfg.method == "dspark":
        from dflash_offline.drafter.dspark import previous_tokens
        from dflash_offline.blocks.dspark_loss import dspark_loss

        prev = previous_tokens(mb.block_ids, mb.labels, drafter.cfg.block_size)
        return dspark_loss(h, drafter.lm_head.weight, drafter.markov_head, None, prev, mb.labels, mb.weights,
                           chunk_tokens=chunk_tokens).correct
    return block_loss(h, drafter.lm_head.weight, mb.labels, mb.weights, chunk_tokens)[1]


def walk_rounds(accepted, length: int, max_new: int | None = None) -> list[int]:
    """The accepted drafts of each round greedy speculative decoding makes over one completion.

    accepted[i]: how many drafts the block anchored at completion token i gets accepted (i = 0 is
    the first completion token, which the prompt's forward produces and the first block drafts
    from); needed for i < length - 1. length: the output length at which decoding stops
    (max_new_tokens, or 1 + the index of the first end-of-sequence token if that is smaller).
    Mirrors `speculative_decode` and `output_done`: the output starts with one token; each round drafts
    from the last committed token at most the max_new - n drafts that can still be committed (n
    tokens out; max_new defaults to `length`), records its a and commits a + 1 tokens, and
    decoding stops as soon as the output holds `length` tokens, mid-round if need be."""
    if length > 1 and len(accepted) < length - 1:
        raise ValueError(f"walk_rounds: {len(accepted)} anchors for an output of {length} tokens "
                         f"(need {length - 1})")
    cap = length if max_new is None else max_new
    rounds, n = [], 1
    while n < length:
        a = min(int(accepted[n - 1]), cap - n)
        rounds.append(a)
        n += a + 1
    return rounds


class _Sample(NamedTuple):
    """Where one cached sample lies: its shard, its first token there, its length, its id."""

    shard: str
    start: int
    length: int
    id: int


@dataclass
class _ContextRow:
    """One packed row of whole samples and the acceptance of every candidate anchor in it."""

    spans: list[tuple[int, int, int]]  # (sample index, first row position, kept length)
    loss_mask: np.ndarray  # uint8 [S]
    accepted: np.ndarray  # int64 [S]: accepted drafts of the block anchored there (candidates only)


def walk_acceptance(cache: str, drafter, device, max_samples: int | None = None, max_new: int | None = None,
                    seq_len: int | None = None, anchors_per_row: int = 512, batch_rows: int = 4,
                    per_sample: bool = False, loss_chunk_tokens: int = 4096, option: str = "--cache") -> dict:
    """Acceptance of `drafter` on a cache's samples as greedy speculative decoding would see it.

    For each sample (the first `max_samples` in manifest order): every candidate anchor p
    (loss_mask[p] and loss_mask[p + 1] set) is scored, accepted(p) = the leading run of slots
    j = 1..B-1 whose argmax equals the data token at p + j (a slot past the sample's end or on an
    unscored token is a miss; a DSpark drafter: slots j = 0..B-1 against the token at p + 1 + j,
    through its Markov head given the data token before, `slot_hits`). Then the walk (`walk_rounds`) from the first completion token p0:
    a = accepted(p), one round, p += a + 1, until the output reaches the completion length (the
    loss_mask-1 tokens from p0 on; capped at `max_new`).

    For the target's own greedy completions (fp32) this is the decoding tau of the same prompts
    with max_new_tokens = the completion length, without running the target, except in each
    sample's last round, where decoding drafts a shorter block (only what it can still commit),
    which the drafter sees differently from the full block scored here. The drafter sees the
    cache's stored (bf16 or fp8) features where decoding gives it the target's own.

    -> {tau_pooled: committed tokens / rounds by the reference's rule (summarize's tau: a sample of
    n tokens commits n - 1 in its rounds, the first token being the prompt's), tau_per_prompt_mean:
    the mean over samples of each one's own tau, rounds, samples (walked: at least one round),
    samples_skipped (completion of at most one token: no round), accept_rate[j-1] (share of
    rounds accepting slot j), anchors and tau_all_anchors (mean of 1 + accepted over every
    candidate anchor: the random-anchor estimate without sampling noise), slot_accuracy[j-1] over
    every anchor, seq_len, truncated_samples, seconds; with per_sample, per_sample: [{id,
    accepted}] in cache order}.

    Samples are packed into rows of `seq_len` (default: the longest sample; a longer one is cut,
    and counted in truncated_samples); a row's anchors go `anchors_per_row` at a time, `batch_rows`
    such blocks of anchors (each with its row's context) per forward. Shapes are the same for every
    forward of a call (flex compiles once). Runs in-process without grad; a drafter in train mode
    is switched to eval and back (the trainer can call this on a held-out cache; `option` names
    the cache in messages: --cache, --eval-cache, or the recipe key and file)."""
    import torch

    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.blocks.packing import loss_weights, pack_rows

    t0 = time.time()
    if anchors_per_row < 1 or batch_rows < 1:
        raise ValueError(f"walk_acceptance: anchors_per_row {anchors_per_row} and batch_rows {batch_rows} must be positive")
    reader = CacheReader(cache)
    refs = [_Sample(name, int(sh.offsets[k]), int(sh.offsets[k + 1] - sh.offsets[k]), int(sh.ids[k]))
            for name in reader.shard_names for sh in [reader.shard(name)] for k in range(len(sh))][:max_samples]
    if not refs:
        raise UserError(f"{option} {cache}: no samples to walk")
    lengths = np.asarray([r.length for r in refs], np.int64)
    S = int(seq_len) if seq_len else int(lengths.max())
    # A row has at most S - 1 candidates: build_row takes all of them, sorted, when asked for at
    # least as many blocks as the row has positions.
    w = _Walker(reader, cache, option, drafter, str(device), A=max(1, min(anchors_per_row, S - 1)),
                batch_rows=batch_rows, loss_chunk_tokens=loss_chunk_tokens)
    was_training = drafter.training
    drafter.to(w.device).eval()  # in place (a Module): the walker holds the same module
    weights = loss_weights(w.B, 1.0, w.off)  # DSpark: every slot drafts, slot j the token at p + 1 + j
    rng = np.random.default_rng(0)
    pending: list[tuple[int, dict]] = []  # (context row, arrays of one block of anchors)
    try:
        with torch.no_grad():
            for packed in pack_rows(lengths, np.arange(len(refs)), S):
                for block in w.anchor_blocks(refs, packed, S, weights, rng):
                    pending.append(block)
                    if len(pending) == batch_rows:
                        w.forward(pending)
                        pending = []
            if pending:
                w.forward(pending)
    finally:
        drafter.train(was_training)
    return {**w.summary(refs, lengths, S, max_new, option, per_sample), "seconds": time.time() - t0}


class _Walker:
    """walk_acceptance's state: the cache it reads, the drafter it scores, and what the forwards
    accumulate (each context row's accepted run per anchor, per-slot hits)."""

    def __init__(self, reader, cache: str, option: str, drafter, device: str, A: int, batch_rows: int,
                 loss_chunk_tokens: int):
        from dflash_offline.drafter import masks
        from dflash_offline.cache.fp8 import DTYPE_NAME as FP8

        self.reader, self.cache, self.drafter, self.device = reader, cache, drafter, device
        self.cuda = device.startswith("cuda")
        self.cfg = drafter.cfg
        self.B, self.off = self.cfg.block_size, self.cfg.label_offset
        self.A, self.batch_rows, self.loss_chunk_tokens = A, batch_rows, loss_chunk_tokens
        self.layer_columns = cache_layer_columns(reader.manifest, self.cfg, cache, option)
        self.fp8 = ManifestView.of(reader.manifest).hidden_dtype == FP8
        self.build = masks.flex_block_mask if self.cuda else masks.dense_mask
        self.ctx_rows: list[_ContextRow] = []
        self.slot_hit = np.zeros(self.B - 1 + self.off, np.float64)
        self.slot_count = np.zeros(self.B - 1 + self.off, np.float64)
        self.anchor_acc: list[np.ndarray] = []

    def read(self, ref: _Sample, keep: int):
        """A sample's first `keep` tokens, loss mask and (the drafter's layers of) hidden states."""
        shard, a, sid = ref.shard, ref.start, ref.id
        try:
            g = self.reader.shard(shard).group
            ids, lm, bits = g["input_ids"][a:a + keep], g["loss_mask"][a:a + keep], g["hidden"][a:a + keep]
            scale = g["hidden_scale"][a:a + keep] if self.fp8 else None
        except Exception as e:  # never score (or skip) unreadable data silently
            raise RuntimeError(f"cache {self.cache}: shard {shard}, sample id {sid} is unreadable "
                               f"({type(e).__name__}: {e}); check the cache with `dflash-offline verify`") from None
        if self.layer_columns is not None:
            bits = bits[:, self.layer_columns]
            scale = scale[:, self.layer_columns] if self.fp8 else None
        return ids.astype(np.int64), lm, bits, scale

    def read_row(self, refs: list[_Sample], packed, S: int):
        """One context row of S tokens: the packed samples' hidden bits (and fp8 scales) side by
        side -> (bits, scale, token ids, loss masks, spans (sample, start, kept))."""
        n = len(self.cfg.target_layer_ids)
        bits = np.zeros((S, n, self.cfg.hidden_size), np.uint8 if self.fp8 else np.uint16)
        scale = np.zeros((S, n), np.float32) if self.fp8 else None
        ids, lms, spans, at = [], [], [], 0
        for s, keep in packed:
            i, lm, hb, sc = self.read(refs[s], keep)
            bits[at:at + keep] = hb
            if self.fp8:
                scale[at:at + keep] = sc
            ids.append(i)
            lms.append(lm)
            spans.append((s, at, keep))
            at += keep
        return bits, scale, ids, lms, spans

    def anchor_blocks(self, refs: list[_Sample], packed, S: int, weights, rng):
        """One context row of packed samples: its candidate anchors, `A` at a time, each group with
        the row's context -> (context row index, the arrays of one forward row)."""
        from dflash_offline.blocks.packing import build_row

        cfg, B, off = self.cfg, self.B, self.off
        bits, scale, ids, lms, spans = self.read_row(refs, packed, S)
        row = build_row(ids, lms, S, S, B, cfg.mask_token_id, weights, rng, label_offset=off)
        r = len(self.ctx_rows)
        self.ctx_rows.append(_ContextRow(spans, row.loss_mask, np.zeros(S, np.int64)))
        n_cand = int(row.anchor_valid.sum())
        per_block = {k: getattr(row, k).reshape(S, B) for k in ("block_ids", "block_positions", "labels", "weights")}
        for lo in range(0, n_cand, self.A):
            hi = min(lo + self.A, n_cand)
            part = {"bits": bits.reshape(S, -1), "doc_ids": row.doc_ids, "positions": row.positions,
                    "anchors": _pad(row.anchors[lo:hi], self.A, 0),
                    "anchor_valid": _pad(row.anchor_valid[lo:hi], self.A, False)}
            if self.fp8:
                part["scale"] = scale
            for k, v in per_block.items():
                part[k] = _pad(v[lo:hi], self.A, cfg.mask_token_id if k == "block_ids" else 0).reshape(-1)
            yield r, part

    def forward(self, batch: list[tuple[int, dict]]) -> None:
        """Score one batch of anchor blocks: each anchor's accepted run, and the per-slot counts."""
        import torch

        from dflash_offline.blocks.stream import MicroBatch

        A, B, off = self.A, self.B, self.off
        # On CUDA the batch is padded with anchorless rows: one shape for every forward.
        R = self.batch_rows if self.cuda else len(batch)
        arr = {k: np.stack([b[k] for _, b in batch] + [np.zeros_like(batch[0][1][k])] * (R - len(batch)))
               for k in batch[0][1]}
        t = {k: torch.from_numpy(v) for k, v in arr.items()}
        # The same typed row as training's; fp8 bits are dequantised on the device, as there.
        hidden = ({"target_hidden_bits": t["bits"], "target_hidden_scale": t["scale"]} if self.fp8 else
                  {"target_hidden": t["bits"].view(torch.bfloat16)})
        mb = MicroBatch(row=torch.arange(R), doc_ids=t["doc_ids"], ctx_positions=t["positions"], anchors=t["anchors"],
                        anchor_valid=t["anchor_valid"], block_ids=t["block_ids"],
                        block_positions=t["block_positions"], labels=t["labels"], weights=t["weights"],
                        **hidden).on(self.device)
        mask = self.build(mb.doc_ids, mb.anchors, mb.anchor_valid, B)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            h = self.drafter(mb.target_hidden, mb.block_ids, mb.ctx_positions, mb.block_positions, mask)
            correct = slot_hits(self.drafter, h, mb, self.loss_chunk_tokens)
        # block_metrics' rule: a slot counts when its argmax is the label and it is scored
        # (inside the sample, on a loss-mask token); an unscored slot ends the run.
        scored = (mb.weights > 0).view(R, A, B)[:, :, 1 - off:]
        hit = correct.view(R, A, B)[:, :, 1 - off:] & scored
        acc = torch.cumprod(hit.to(torch.int32), dim=2).sum(dim=2).cpu().numpy()
        valid = mb.anchor_valid
        self.slot_hit[:] += hit[valid].sum(0).double().cpu().numpy()
        self.slot_count[:] += scored[valid].sum(0).double().cpu().numpy()
        for i, (r, b) in enumerate(batch):
            v = b["anchor_valid"]
            self.ctx_rows[r].accepted[b["anchors"][v]] = acc[i][v]
            self.anchor_acc.append(acc[i][v])

    def summary(self, refs: list[_Sample], lengths: np.ndarray, S: int, max_new: int | None, option: str,
                per_sample: bool) -> dict:
        """Walk every sample from its first completion token (walk_rounds) -> walk_acceptance's figures."""
        rounds_of: list[tuple[int, list[int], int]] = []  # (sample, accepted per round, committed tokens)
        skipped = 0
        for row in self.ctx_rows:
            for s, at, keep in row.spans:
                lm = row.loss_mask[at:at + keep]
                ones = np.flatnonzero(lm)
                if not ones.size:
                    skipped += 1
                    continue
                p0 = at + int(ones[0])
                length = int(lm[ones[0]:].sum())
                if max_new is not None:
                    length = min(length, max_new)
                got = walk_rounds(row.accepted[p0:at + keep], length)
                if got:
                    rounds_of.append((s, got, length - 1))
                else:
                    skipped += 1
        if not rounds_of:
            raise UserError(f"{option} {self.cache}: no sample with a completion of two tokens or more to walk")
        rounds_of.sort()
        B, off = self.B, self.off
        flat = np.asarray([a for _, r, _ in rounds_of for a in r], np.int64)
        every = np.concatenate(self.anchor_acc) if self.anchor_acc else np.zeros(0, np.int64)
        out = {
            "samples": len(rounds_of), "samples_skipped": skipped, "rounds": int(flat.size),
            "tau_pooled": sum(c for _, _, c in rounds_of) / flat.size,
            "tau_per_prompt_mean": float(np.mean([c / len(r) for _, r, c in rounds_of])),
            "accept_rate": [float((flat >= j).mean()) for j in range(1, B + off)],
            "anchors": int(every.size),
            "tau_all_anchors": float((every + 1).mean()) if every.size else float("nan"),
            "slot_accuracy": [float(h / c) if c else 0.0 for h, c in zip(self.slot_hit, self.slot_count)],
            "seq_len": S, "truncated_samples": int((lengths > S).sum()), "max_new": max_new,
        }
        if per_sample:
            out["per_sample"] = [{"id": refs[s].id, "accepted": r} for s, r, _ in rounds_of]
        return out


def _pad(x: np.ndarray, n: int, value) -> np.ndarray:
    """x padded along its first axis to n entries of `value`."""
    if x.shape[0] == n:
        return x
    pad = np.full((n - x.shape[0],) + x.shape[1:], value, x.dtype)
    return np.concatenate([x, pad])
