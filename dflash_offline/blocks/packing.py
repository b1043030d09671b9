"""Training rows of static shape from cache samples: packing, anchors, draft blocks, labels.

Everything here is a pure function of (seed, epoch, manifest, options), so the sample order, the
rows and the anchors of any step can be recomputed after a crash, by any rank, in any loader
process. Shapes never depend on the data: a row is `seq_len` context tokens and `num_anchors`
blocks of `block_size` tokens, always, so the compiled step compiles once.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of all cache samples for one epoch."""
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(num_samples)


def pack_rows(lengths: np.ndarray, order: np.ndarray, seq_len: int) -> list[list[tuple[int, int]]]:
    """Greedy packing in `order` of every sample's first min(length, seq_len) tokens: each row is
    [(sample, kept_length), ...] with sum <= seq_len (the held-out estimates' rows; training packs
    `pieces.pack_pieces`, which splits samples longer than seq_len)."""
    from dflash_offline.blocks.pieces import Pieces, pack_pieces

    return [[(p.sample, p.length) for p in row] for row in pack_pieces(Pieces.make(lengths, seq_len), order, seq_len)]


def loss_weights(block_size: int, gamma: float, label_offset: int = 0) -> np.ndarray:
    """DFlash (label_offset 0): w[j] = exp(-(j - 1) / gamma) for slots j = 1..B-1; slot 0 (the
    anchor) is not scored. DSpark (1): every slot predicts, w[j] = exp(-j / gamma), j = 0..B-1."""
    w = np.zeros(block_size, np.float32)
    j = np.arange(1 - label_offset, block_size)
    w[j] = np.exp(-(j - 1 + label_offset) / gamma)
    return w


@dataclass
class Row:
    """One training row, numpy, ready to become tensors. S = seq_len, N = num_anchors, B = block."""

    input_ids: np.ndarray  # int64 [S] (0 on padding)
    doc_ids: np.ndarray  # int32 [S] (-1 on padding)
    positions: np.ndarray  # int64 [S] position inside its document
    loss_mask: np.ndarray  # uint8 [S]
    anchors: np.ndarray  # int64 [N]
    anchor_valid: np.ndarray  # bool [N]
    block_ids: np.ndarray  # int64 [N*B]
    block_positions: np.ndarray  # int64 [N*B]
    labels: np.ndarray  # int64 [N*B] (0 where unscored)
    weights: np.ndarray  # float32 [N*B] slot weight x label mask x in-document x valid


def anchor_rng(seed: int, epoch: int, row: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, row, 0xA4C4])


def choose_anchors(cand: np.ndarray, cand_doc: np.ndarray, num_anchors: int, anchors_per_sample: int | None,
                   rng: np.random.Generator) -> np.ndarray:
    """Sorted anchor positions drawn from the candidates `cand` (row positions; `cand_doc` their
    documents), at most `num_anchors` (the row's static capacity).

    anchors_per_sample None: a uniform draw of the row's capacity over all candidates (a row that
    packs 8 short samples then trains as many blocks as a row holding one long one).
    anchors_per_sample K: the method's budget, per sequence: every sample draws min(K, its
    candidates); when the row's draws exceed its capacity, a uniform draw of the capacity from their
    union keeps each sample's share proportional to its budget."""
    if anchors_per_sample is None:
        take = min(num_anchors, cand.shape[0])
        return np.sort(rng.choice(cand, size=take, replace=False)) if take else cand[:0]
    picked = []
    for d in np.unique(cand_doc):
        c = cand[cand_doc == d]
        k = min(anchors_per_sample, c.shape[0])
        picked.append(c if k == c.shape[0] else rng.choice(c, size=k, replace=False))
    union = np.concatenate(picked) if picked else cand[:0]
    if union.shape[0] > num_anchors:
        union = rng.choice(union, size=num_anchors, replace=False)
    return np.sort(union)


def build_row(input_ids: list[np.ndarray], loss_masks: list[np.ndarray], seq_len: int, num_anchors: int,
              block_size: int, mask_token_id: int, slot_weights: np.ndarray, rng: np.random.Generator,
              anchors_per_sample: int | None = None, starts: list[int] | None = None, label_offset: int = 0) -> Row:
    """The row of the documents `input_ids` (with their `loss_masks`), packed from position 0;
    `starts`: where each begins inside its sample (a piece of a longer one), its first position.
    `label_offset`: slot j of a block at anchor p predicts the token at p + j + label_offset (0:
    DFlash, slot 0 unscored; 1: DSpark, every slot scored; drafter/dspark.py)."""
    S, N, B = seq_len, num_anchors, block_size
    ids = np.zeros(S, np.int64)
    doc = np.full(S, -1, np.int32)
    pos = np.zeros(S, np.int64)
    lm = np.zeros(S, np.uint8)
    a = 0
    for d, (t, m) in enumerate(zip(input_ids, loss_masks)):
        n = t.shape[0]
        p0 = starts[d] if starts is not None else 0
        ids[a:a + n], lm[a:a + n], doc[a:a + n], pos[a:a + n] = t, m, d, np.arange(p0, p0 + n)
        a += n
    # Anchors: p with loss_mask[p] and loss_mask[p + 1] inside one document (dflash-method.md).
    ok = (lm[:-1] == 1) & (lm[1:] == 1) & (doc[:-1] == doc[1:]) & (doc[:-1] >= 0)
    cand = np.flatnonzero(ok)
    chosen = choose_anchors(cand, doc[cand], N, anchors_per_sample, rng)
    take = chosen.shape[0]
    anchors = np.zeros(N, np.int64)
    valid = np.zeros(N, bool)
    anchors[:take] = chosen
    valid[:take] = True
    j = np.arange(B)
    at = anchors[:, None] + j[None, :] + label_offset  # [N, B] row positions the block slots predict
    inside = (at < S)
    atc = np.minimum(at, S - 1)
    same_doc = inside & (doc[atc] == doc[anchors][:, None])
    block_ids = np.full((N, B), mask_token_id, np.int64)
    block_ids[:, 0] = ids[anchors]
    block_pos = pos[anchors][:, None] + j[None, :]
    labels = np.where(same_doc, ids[atc], 0)
    w = slot_weights[None, :] * same_doc * lm[atc] * valid[:, None]
    if label_offset == 0:
        labels[:, 0] = 0
    return Row(ids, doc, pos, lm, anchors, valid, block_ids.reshape(-1), block_pos.reshape(-1),
               labels.reshape(-1).astype(np.int64), w.reshape(-1).astype(np.float32))


def manifest_fingerprint(manifest: dict) -> str:
    """Identity of a cache's committed content: shard names and checksums, capture and target."""
    h = hashlib.sha256()
    h.update(repr((manifest["target"].get("weights_fingerprint"), manifest["capture"])).encode())
    for s in manifest["shards"]:
        h.update(f"{s['name']}:{s['checksum']}\n".encode())
    return "sha256:" + h.hexdigest()


def follow_fingerprint(manifest: dict) -> str:
    """Identity of a cache that is still being filled (train --follow): what decides its future
    content (target, capture, source, plan), not the shards committed so far."""
    h = hashlib.sha256()
    h.update(repr((manifest["target"].get("weights_fingerprint"), manifest["capture"],
                   [(f["rows"], f["sha256"]) for f in manifest["source"]["files"]],
                   sorted(manifest["plan"].items()))).encode())
    return "sha256:" + h.hexdigest()


def steps_per_epoch(num_rows: int, world: int, accum: int) -> int:
    """Whole optimizer steps in an epoch; the remainder rows are dropped (static shapes, equal ranks)."""
    return num_rows // (world * accum)


def accumulation(global_batch_tokens: int, seq_len: int, world: int) -> int:
    return max(1, math.ceil(global_batch_tokens / (seq_len * world)))
