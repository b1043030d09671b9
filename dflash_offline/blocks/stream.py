"""Stream training rows from a committed cache, with read-ahead in background processes.

Which rows a rank sees at a step is fixed by `packing` (a pure function of seed, epoch, manifest):
micro-batch k of this rank (step k // accum, micro-step k % accum) is global row
`(step * accum + micro) * world + rank`. Loader processes (spawned, never forked: the parent may
hold CUDA) each produce every `num_workers`-th micro-batch; torch's DataLoader returns them in
order. Memory stays bounded at `num_workers x prefetch` rows whatever the cache size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np
import torch

from dflash_offline.cache.fp8 import DTYPE_NAME as FP8
from dflash_offline.blocks.packing import anchor_rng, build_row, epoch_order, loss_weights
from dflash_offline.blocks.pieces import Piece, Pieces, pack_pieces
from dflash_offline.cache.location import Location
from dflash_offline.runtime.signals import ignore_stop_signals


@dataclass(frozen=True)
class RowSpec:
    """What a training row is made of: the packing (seed, seq_len, anchors, block), the drafter's
    mask token and slot weights, and the cache's layout (which captured layers, their width and
    storage, the top-k). Built by the training loop from its plan and by the held-out walk from a
    drafter and a cache; loader processes receive it pickled."""

    seed: int
    seq_len: int
    num_anchors: int
    block_size: int
    mask_token_id: int
    gamma: float
    hidden_size: int
    row_layers: int  # layers per row the stream delivers (training: the drafter's, in its order)
    hidden_dtype: str = "bfloat16"
    cache_layers: int | None = None  # layers a cache row holds per token; None = row_layers
    layer_columns: tuple[int, ...] | None = None  # which of them, when a subset (train --target-layers)
    topk: int = 0
    anchors_per_sample: int | None = None
    label_offset: int = 0  # slot j predicts anchor + j + label_offset (1: DSpark)

    @classmethod
    def of(cls, spec: "RowSpec | dict") -> "RowSpec":
        """A RowSpec, or one from a dict of its fields (`num_layers` and `captured_layers`, the
        names scripts written before the typed spec and before the layer words pass, for `row_layers`)."""
        if isinstance(spec, RowSpec):
            return spec
        d = dict(spec)
        for old in ("num_layers", "captured_layers"):
            if old in d:
                d["row_layers"] = d.pop(old)
        if d.get("layer_columns") is not None:
            d["layer_columns"] = tuple(d["layer_columns"])
        return cls(**d)


def _dequantized(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 rows' bits [R, S, n*H] and scales [R, S, n] -> bf16 hidden states [R, S, n*H]."""
    from dflash_offline.cache.fp8 import dequantize

    R, S, width = bits.shape
    n = scale.shape[-1]
    return dequantize(bits.view(R, S, n, width // n), scale, torch.bfloat16).view(R, S, width)


@dataclass
class MicroBatch:
    """One packed training row as the loader delivers it, every tensor [1, ...]: the drafter's
    inputs (context hidden states, block tokens and positions, the anchors and the document of
    each position), the labels and loss weights, and with a top-k cache the target's distribution
    per block slot. bf16 caches fill `target_hidden`; fp8 caches its bits and scales, which `on`
    dequantises on the consumer's device (half the bytes through the loader)."""

    row: torch.Tensor  # the global row index
    doc_ids: torch.Tensor
    ctx_positions: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    block_ids: torch.Tensor
    block_positions: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    trained: torch.Tensor | None = None  # [1]: context tokens with loss mask 1 (the step's count)
    target_hidden: torch.Tensor | None = None
    target_hidden_bits: torch.Tensor | None = None
    target_hidden_scale: torch.Tensor | None = None
    soft_ids: torch.Tensor | None = None
    soft_logprobs: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def _map(self, fn) -> "MicroBatch":
        return replace(self, **{k: fn(v) for k, v in self.tensors().items()})

    def pin_memory(self) -> "MicroBatch":  # the DataLoader's pin_memory calls it
        return self._map(lambda t: t.pin_memory())

    def on(self, device, non_blocking: bool = False) -> "MicroBatch":
        """On `device`, fp8 hidden states dequantised there to bf16 `target_hidden`."""
        mb = self._map(lambda t: t.to(device, non_blocking=non_blocking))
        if mb.target_hidden_scale is not None:
            mb = replace(mb, target_hidden=_dequantized(mb.target_hidden_bits, mb.target_hidden_scale),
                         target_hidden_bits=None, target_hidden_scale=None)
        return mb

    # A read-only view by name, for scripts that index a micro-batch as the dict it used to be.
    def keys(self):
        return self.tensors().keys()

    def __iter__(self):
        return iter(self.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        v = self.tensors().get(name)
        if v is None:
            raise KeyError(name)
        return v

    def get(self, name: str, default=None):
        return self.tensors().get(name, default)


class Span(NamedTuple):
    """Steps [start, end) of one sample order: an epoch, or a follow window (its key seeds the
    order and the anchors)."""

    epoch: int
    start: int
    end: int


class RowStream(torch.utils.data.IterableDataset):
    """The micro-batches of one or more spans in turn. One stream over all of a run's epochs keeps
    its loader processes from the first step to the last: a loader per epoch costs seconds per
    epoch boundary to start its processes and to fill their read-ahead again."""

    def __init__(self, cache: str, refs: list[tuple[str, int]], lengths: np.ndarray, spec: RowSpec | dict,
                 spans: Span | list[Span], rank: int, world: int, accum: int, pad_rows: bool = False,
                 pieces: Pieces | None = None):
        self.cache, self.refs, self.lengths, self.spec = cache, refs, lengths, RowSpec.of(spec)
        # What the rows pack (training's, from its plan); None: each sample's first seq_len tokens.
        self.pieces = pieces if pieces is not None else Pieces.make(lengths, self.spec.seq_len)
        self.pad_rows = pad_rows  # rows past the packed ones are empty (weight 0): a follow window's last step
        self.spans = [spans] if isinstance(spans, Span) else list(spans)
        self.rank, self.world, self.accum = rank, world, accum
        self._reader = None

    def rows(self, epoch: int | None = None) -> list[list[Piece]]:
        """The packed rows of `epoch`'s order (default: the first span's)."""
        order = epoch_order(len(self.refs), self.spec.seed, self.spans[0].epoch if epoch is None else epoch)
        return pack_pieces(self.pieces, order, self.spec.seq_len)

    def __len__(self) -> int:
        return sum(sp.end - sp.start for sp in self.spans) * self.accum

    def _read(self, ref: tuple, keep: int, out: np.ndarray, out_scale: np.ndarray | None, topk: int = 0,
              start: int = 0):
        """(input_ids, loss_mask, hidden bits or None, hidden scale or None, top-k or None) of the
        `keep` tokens from `start` of sample ref = (shard, k, first token); the hidden bits (and fp8
        scales) go into `out` [keep, n, H] (`out_scale` [keep, n]) when None is returned; with
        `topk`, the last item is (ids [keep, k], logprobs [keep, k]).
        Local caches are read from the chunk files (cache.reader.ChunkFiles): no Zarr group is
        opened, so a loader's cost per sample does not grow with the number of shards; URL caches
        through Zarr."""
        if self._reader is None:
            from dflash_offline.cache.reader import ChunkFiles

            loc = Location(self.cache)
            self._reader = ChunkFiles(loc) if not loc.remote else False
            from dflash_offline.cache.reader import CacheReader

            self._zarr = CacheReader(self.cache)  # URL caches, and refs without their first token
        try:
            if self._reader and len(ref) > 2:
                a = int(ref[2]) + start
                b = a + keep
                f = self._reader
                f.read(ref[0], "hidden", a, b, out=out)
                if out_scale is not None:
                    f.read(ref[0], "hidden_scale", a, b, out=out_scale)
                top = (f.read(ref[0], "topk_ids", a, b), f.read(ref[0], "topk_logprobs", a, b)) if topk else None
                return (f.read(ref[0], "input_ids", a, b).astype(np.int64), f.read(ref[0], "loss_mask", a, b),
                        None, None, top)
            shard = self._zarr.shard(ref[0])
            a = int(shard.offsets[ref[1]]) + start
            g = shard.group
            b = a + keep
            top = (g["topk_ids"][a:b], g["topk_logprobs"][a:b]) if topk else None
            return (g["input_ids"][a:b].astype(np.int64), g["loss_mask"][a:b], g["hidden"][a:b],
                    g["hidden_scale"][a:b] if out_scale is not None else None, top)
        except Exception as e:
            # Never train on (or skip) unreadable data silently: name the shard and stop.
            raise RuntimeError(f"cache {self.cache}: shard {ref[0]}, sample {ref[1]} is unreadable "
                               f"({type(e).__name__}: {e}); check the cache with `dflash-offline verify`") from None

    def make(self, epoch: int, global_row: int, packed: list[Piece]) -> MicroBatch:
        sp = self.spec
        S, n, H = sp.seq_len, sp.row_layers, sp.hidden_size
        # A subset of the captured layers (train --target-layers): the cache's [tokens, n_cache, H] rows are
        # read whole, then the chosen columns are kept, in the drafter's order.
        cols = None if sp.layer_columns is None else list(sp.layer_columns)
        n_cache = sp.cache_layers if sp.cache_layers is not None else n
        subset = cols is not None and cols != list(range(n_cache))
        k = int(sp.topk)
        fp8 = sp.hidden_dtype == FP8
        # The row's hidden states, zero past its samples; local caches read straight into it.
        bits = np.zeros((S, n * H), np.uint8 if fp8 else np.uint16)
        scale = np.zeros((S, n), np.float32) if fp8 else None
        top_ids = np.zeros((S, k), np.int32) if k else None
        top_lp = np.full((S, k), -np.inf, np.float16) if k else None
        ids, masks = [], []
        t = 0
        for s, start, keep in packed:
            if subset:
                full = np.empty((keep, n_cache, H), bits.dtype)
                full_scale = np.empty((keep, n_cache), np.float32) if fp8 else None
            else:
                full = bits[t:t + keep].reshape(keep, n, H)
                full_scale = scale[t:t + keep] if fp8 else None
            i, m, h, sc, top = self._read(self.refs[s], keep, full, full_scale, k, start)
            if h is not None:
                full[...] = h.reshape(keep, n_cache, H)
                if fp8:
                    full_scale[...] = sc
            if subset:
                bits[t:t + keep] = full[:, cols].reshape(keep, -1)
                if fp8:
                    scale[t:t + keep] = full_scale[:, cols]
            if k:
                top_ids[t:t + keep], top_lp[t:t + keep] = top[0][:, :k], top[1][:, :k]
            ids.append(i)
            masks.append(m)
            t += keep
        B = sp.block_size
        row = build_row(ids, masks, sp.seq_len, sp.num_anchors, B, sp.mask_token_id,
                        loss_weights(B, sp.gamma, sp.label_offset), anchor_rng(sp.seed, epoch, global_row),
                        anchors_per_sample=sp.anchors_per_sample, starts=[p.start for p in packed],
                        label_offset=sp.label_offset)
        as_t = lambda x: torch.from_numpy(np.ascontiguousarray(x))[None]  # noqa: E731 - [1, ...]
        soft = {}
        if k:
            # Slot j of the block at anchor p predicts token p + j (+ 1 for DSpark): the target's
            # distribution for it is the top-k stored at the position before. Unscored slots keep
            # whatever they gather.
            at = np.minimum(row.anchors[:, None] + np.arange(B)[None, :] - 1 + sp.label_offset, S - 1).clip(0).reshape(-1)
            soft = {"soft_ids": as_t(top_ids[at]), "soft_logprobs": as_t(top_lp[at])}
        # bf16 rows carry the hidden states; fp8 rows their bits and scales (MicroBatch.on).
        hidden = ({"target_hidden_bits": as_t(bits), "target_hidden_scale": as_t(scale)} if fp8 else
                  {"target_hidden": as_t(bits).view(torch.bfloat16)})
        return MicroBatch(row=torch.tensor([global_row]), doc_ids=as_t(row.doc_ids), ctx_positions=as_t(row.positions),
                          anchors=as_t(row.anchors), anchor_valid=as_t(row.anchor_valid),
                          block_ids=as_t(row.block_ids), block_positions=as_t(row.block_positions),
                          labels=as_t(row.labels), weights=as_t(row.weights),
                          trained=torch.tensor([int(row.loss_mask.sum())]), **hidden, **soft)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        n = 0  # micro-batches of the stream before this one: worker n % nw makes it
        for span in self.spans:
            rows = self.rows(span.epoch)
            for k in range(span.start * self.accum, span.end * self.accum):
                mine = n % nw == wid
                n += 1
                if not mine:
                    continue
                step, micro = divmod(k, self.accum)
                g = (step * self.accum + micro) * self.world + self.rank
                if g >= len(rows) and self.pad_rows:
                    yield self.make(span.epoch, g, [])
                    continue
                if g >= len(rows):
                    raise RuntimeError(f"row {g} does not exist in epoch {span.epoch} ({len(rows)} rows): "
                                       "plan and stream disagree")
                yield self.make(span.epoch, g, rows[g])


def _loader_worker_init(worker_id: int) -> None:
    # A terminal's Ctrl-C reaches the whole process group: the rank stops its loaders itself,
    # after finishing its step (a loader dying first would fail that step).
    ignore_stop_signals()


def make_loader(stream: RowStream, num_workers: int, prefetch: int, pin: bool):
    kw = {}
    if num_workers > 0:
        # spawn: a forked loader would inherit the parent's CUDA context and threads.
        kw = dict(multiprocessing_context="spawn", prefetch_factor=prefetch, persistent_workers=False,
                  worker_init_fn=_loader_worker_init)
    return torch.utils.data.DataLoader(stream, batch_size=None, num_workers=num_workers, pin_memory=pin, **kw)
