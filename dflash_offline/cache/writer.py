"""Write one shard (a Zarr v3 group) under a temporary name, in whole chunks, with a checksum.

The shard's length T is known before the first write (the plan fixes its samples), so every array
is created at its final shape and the token axis is filled front to back. Chunks are stored
uncompressed (compression is slower than the GPU's output rate) with a CRC32C per chunk, so a
corrupted chunk fails loudly whenever it is read, not only when the whole shard is verified. Hidden states and top-k
rows are staged in a chunk-sized buffer and written only as whole chunks (plus the tail at close),
so no chunk is ever rewritten.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec

from .location import Location
from .manifest import id_ranges

log = logging.getLogger("dflash.cache")

SHARD_FORMAT = "dflash-offline/shard"
SHARD_VERSION = 1
# Arrays covered by the checksum, in the order their digests are combined.
CHECKSUM_ARRAYS = ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs", "sample_offsets", "sample_ids")


def combine_digests(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in CHECKSUM_ARRAYS:
        if name in digests:
            h.update(f"{name}:{digests[name]}\n".encode())
    return "sha256:" + h.hexdigest()


@dataclass
class ShardLayout:
    tokens: int
    num_layers: int
    hidden_size: int
    topk: int
    chunk_tokens: int
    layer_ids: list[int]
    hidden_dtype: str = "bfloat16"


class ShardWriter:
    """Append samples in order; `close()` writes the small arrays and returns the manifest entry."""

    def __init__(self, loc: Location, rel: str, layout: ShardLayout):
        self.loc, self.rel, self.layout = loc, rel, layout
        T, n, H, k, C = layout.tokens, layout.num_layers, layout.hidden_size, layout.topk, layout.chunk_tokens
        self.group = zarr.open_group(
            store=loc.url(rel), mode="w", zarr_format=3, **loc.zarr_kwargs(),
            attributes={
                "format": SHARD_FORMAT, "version": SHARD_VERSION, "layer_ids": list(layout.layer_ids),
                "hidden_size": H, "hidden_dtype": layout.hidden_dtype, "topk": k,
            },
        )

        def make(name, shape, chunks, dtype, dims, attrs=None):
            return self.group.create_array(
                name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0, compressors=[Crc32cCodec()],
                dimension_names=dims, attributes=attrs or {},
            )

        small = max(1, min(T, 1 << 20))
        self.hidden = make("hidden", (T, n, H), (C, n, H), "uint16", ("token", "layer", "channel"),
                           {"dtype": "bfloat16", "note": "uint16 words holding bfloat16 bits"})
        self.topk_ids = self.topk_lp = None
        if k > 0:
            self.topk_ids = make("topk_ids", (T, k), (C, k), "int32", ("token", "rank"))
            self.topk_lp = make("topk_logprobs", (T, k), (C, k), "float16", ("token", "rank"))
        self._small = small
        self._make = make
        # Chunk staging buffers: filled by `append`, flushed as whole chunks.
        self._buf_h = np.empty((C, n, H), np.uint16)
        self._buf_i = np.empty((C, max(k, 1)), np.int32)
        self._buf_l = np.empty((C, max(k, 1)), np.float16)
        self._fill = 0  # rows staged in the buffers
        self._flushed = 0  # tokens already written to storage
        self._hash = {name: hashlib.sha256() for name in CHECKSUM_ARRAYS}
        self._input_ids: list[np.ndarray] = []
        self._loss_mask: list[np.ndarray] = []
        self._offsets = [0]
        self._ids: list[int] = []

    @property
    def tokens_written(self) -> int:
        return self._offsets[-1]

    def append(self, sample_id: int, input_ids: np.ndarray, loss_mask: np.ndarray,
               hidden: np.ndarray, topk_ids: np.ndarray | None, topk_logprobs: np.ndarray | None) -> None:
        """One sample: hidden uint16 [t, n, H], top-k [t, k] (or None when topk == 0)."""
        t = int(input_ids.shape[0])
        if self._offsets[-1] + t > self.layout.tokens:
            raise RuntimeError(f"shard {self.rel}: sample {sample_id} overflows the planned {self.layout.tokens} tokens")
        if hidden.shape != (t, self.layout.num_layers, self.layout.hidden_size) or hidden.dtype != np.uint16:
            raise RuntimeError(f"shard {self.rel}: hidden of shape {hidden.shape} {hidden.dtype} for a {t}-token sample")
        self._input_ids.append(np.asarray(input_ids, np.int32))
        self._loss_mask.append(np.asarray(loss_mask, np.uint8))
        self._offsets.append(self._offsets[-1] + t)
        self._ids.append(int(sample_id))
        C = self.layout.chunk_tokens
        pos = 0
        while pos < t:
            take = min(C - self._fill, t - pos)
            self._buf_h[self._fill:self._fill + take] = hidden[pos:pos + take]
            if self.topk_ids is not None:
                self._buf_i[self._fill:self._fill + take] = topk_ids[pos:pos + take]
                self._buf_l[self._fill:self._fill + take] = topk_logprobs[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == C:
                self._flush()

    def _flush(self) -> None:
        if self._fill == 0:
            return
        a, b = self._flushed, self._flushed + self._fill
        h = self._buf_h[: self._fill]
        self.hidden[a:b] = h
        self._hash["hidden"].update(h.tobytes())
        if self.topk_ids is not None:
            i, lp = self._buf_i[: self._fill], self._buf_l[: self._fill]
            self.topk_ids[a:b] = i
            self.topk_lp[a:b] = lp
            self._hash["topk_ids"].update(i.tobytes())
            self._hash["topk_logprobs"].update(lp.tobytes())
        self._flushed = b
        self._fill = 0

    def close(self, name: str) -> dict:
        """Flush the tail, write the small arrays; returns this shard's manifest entry (bytes later)."""
        self._flush()
        T = self.layout.tokens
        if self._flushed != T:
            raise RuntimeError(f"shard {self.rel}: wrote {self._flushed} tokens, planned {T}")
        small = {
            "input_ids": (np.concatenate(self._input_ids), ("token",)),
            "loss_mask": (np.concatenate(self._loss_mask), ("token",)),
            "sample_offsets": (np.asarray(self._offsets, np.int64), ("sample_edge",)),
            "sample_ids": (np.asarray(self._ids, np.int64), ("sample",)),
        }
        for aname, (arr, dims) in small.items():
            z = self._make(aname, arr.shape, (max(1, min(arr.shape[0], self._small)),), arr.dtype, dims)
            z[:] = arr
            self._hash[aname].update(arr.tobytes())
        digests = {k: h.hexdigest() for k, h in self._hash.items()
                   if k not in ("topk_ids", "topk_logprobs") or self.topk_ids is not None}
        return {
            "name": name,
            "samples": len(self._ids),
            "tokens": T,
            "bytes": 0,
            "checksum": combine_digests(digests),
            "sample_ids": id_ranges(self._ids),
        }
