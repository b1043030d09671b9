"""Write one shard (a Zarr v3 group) under a temporary name, in whole chunks, with a checksum.

The shard's length T is known before the first write (the plan fixes its samples), so every array
is created at its final shape and the token axis is filled front to back. Chunks are stored
uncompressed (compression is slower than the GPU's output rate) with a CRC32C per chunk, so a
corrupted chunk fails loudly whenever it is read, not only when the whole shard is verified.
Hidden states and top-k rows are written only as whole chunks (plus the tail at close), so no
chunk is ever rewritten: a batch's whole chunks go to Zarr straight from the caller's buffer in
one call, and only the pieces that straddle a batch boundary pass through a chunk-sized staging
buffer. On a local file system a whole chunk is written as its chunk file directly (the raw
little-endian bytes followed by their CRC32C, exactly what Zarr's `bytes` + `crc32c` codecs
store, at the path Zarr's chunk-key encoding names): one `writev` from the caller's buffer, where
Zarr's codec pipeline would copy each chunk twice. Zarr writes everything else (metadata, the
padded tail chunk, small arrays, and all chunks of URL caches) and reads it all back.

The shard checksum combines one digest per array over its bytes in token order. New shards use
CRC32C digests (hardware CRC, about 10 GB/s on one core, where sha256 manages about 1.4 GB/s and
would take a quarter of a writer's time); shards written with sha256 digests stay verifiable: the
algorithm is the checksum's prefix.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from dataclasses import dataclass, fields

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import Crc32cCodec

from dflash_offline.cache.evidence import LayerEvidence, check_batch
from dflash_offline.cache.location import Location
from dflash_offline.cache.manifest import id_ranges
from dflash_offline.cache.shards import ShardShape

log = logging.getLogger("dflash.cache")

SHARD_FORMAT = "dflash-offline/shard"
SHARD_VERSION = 1
# Arrays covered by the checksum, in the order their digests are combined.
CHECKSUM_ARRAYS = ("input_ids", "loss_mask", "hidden", "hidden_scale", "topk_ids", "topk_logprobs", "sample_offsets",
                   "sample_ids")
FP8 = "float8_e4m3fn"


CHECKSUM_ALGORITHMS = ("crc32c", "sha256")
DEFAULT_CHECKSUM = "crc32c"


class _Crc32c:
    """hashlib-like running CRC32C (Castagnoli), hardware-accelerated by google-crc32c."""

    def __init__(self):
        self.crc = 0

    def update(self, data) -> None:
        self.crc = google_crc32c.extend(self.crc, np.ascontiguousarray(data).reshape(-1).view(np.uint8))

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


def new_digest(algorithm: str):
    if algorithm == "crc32c":
        return _Crc32c()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(CHECKSUM_ALGORITHMS)}")


def checksum_algorithm(checksum: str) -> str:
    """The algorithm a stored checksum was made with: its prefix (`crc32c:...`, `sha256:...`)."""
    algo = checksum.partition(":")[0]
    if algo not in CHECKSUM_ALGORITHMS:
        raise ValueError(f"checksum {checksum[:24]!r}...: unknown algorithm {algo!r}")
    return algo


def combine_digests(digests: dict[str, str], algorithm: str = DEFAULT_CHECKSUM) -> str:
    """`ALGO:` + sha256 over `name:digest` lines of the per-array digests, in CHECKSUM_ARRAYS order."""
    h = hashlib.sha256()
    for name in CHECKSUM_ARRAYS:
        if name in digests:
            h.update(f"{name}:{digests[name]}\n".encode())
    return f"{algorithm}:" + h.hexdigest()


def _plain_codecs(arr) -> bool:
    """True when the array stores chunks as little-endian bytes + CRC32C and nothing else, so a chunk
    file can be written without Zarr's codec pipeline."""
    names = [type(c).__name__ for c in arr.metadata.codecs]
    endian = getattr(arr.metadata.codecs[0], "endian", None)
    # One-byte dtypes have no byte order: Zarr writes their `bytes` codec without one.
    ordered = (endian is None and np.dtype(arr.dtype).itemsize == 1) or (endian is not None and endian.value == "little")
    return sys.byteorder == "little" and names == ["BytesCodec", "Crc32cCodec"] and ordered


@dataclass(frozen=True, kw_only=True)
class ShardLayout(ShardShape):
    """One shard's layout: the extraction's ShardShape and the shard's token count."""

    tokens: int

    @classmethod
    def of(cls, shape: ShardShape, tokens: int) -> "ShardLayout":
        return cls(tokens=tokens, **{f.name: getattr(shape, f.name) for f in fields(ShardShape)})


class ShardWriter:
    """Append samples in order; `close()` writes the small arrays and returns the manifest entry."""

    def __init__(self, loc: Location, rel: str, layout: ShardLayout, checksum: str = DEFAULT_CHECKSUM):
        self.loc, self.rel, self.layout = loc, rel, layout
        self.checksum = checksum
        T, n, H, k, C = layout.tokens, layout.cache_layers, layout.hidden_size, layout.topk, layout.chunk_tokens
        self.group = zarr.open_group(
            store=loc.url(rel), mode="w", zarr_format=3, **loc.zarr_kwargs(),
            attributes={
                "format": SHARD_FORMAT, "version": SHARD_VERSION, "layer_ids": list(layout.layer_ids),
                "hidden_size": H, "hidden_dtype": layout.hidden_dtype, "topk": k,
            },
        )

        def make(name, shape, chunks, dtype, dims, attrs=None):
            # Every chunk gets its file, zeros included: a missing chunk file is then always damage
            # (Zarr would skip all-fill chunks and read them back as zeros).
            return self.group.create_array(
                name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0, compressors=[Crc32cCodec()],
                dimension_names=dims, attributes=attrs or {}, config={"write_empty_chunks": True},
            )

        small = max(1, min(T, 1 << 20))
        fp8 = layout.hidden_dtype == FP8
        if layout.hidden_dtype not in ("bfloat16", FP8):
            raise ValueError(f"hidden_dtype {layout.hidden_dtype!r}: this version writes bfloat16 or {FP8}")
        self.hidden_np_dtype = np.dtype(np.uint8 if fp8 else np.uint16)
        self.hidden = make("hidden", (T, n, H), (C, n, H), self.hidden_np_dtype, ("token", "layer", "channel"),
                           {"dtype": FP8, "note": "uint8 words holding float8 e4m3fn bits; value = bits x "
                                                  "hidden_scale[token, layer]"} if fp8 else
                           {"dtype": "bfloat16", "note": "uint16 words holding bfloat16 bits"})
        # The arrays along the token axis that are written chunk by chunk: name -> (array, staging buffer).
        self._tok = {"hidden": (self.hidden, np.empty((C, n, H), self.hidden_np_dtype))}
        if fp8:
            scale = make("hidden_scale", (T, n), (C, n), "float32", ("token", "layer"),
                         {"note": "float32 scale of each token's and layer's float8 values"})
            self._tok["hidden_scale"] = (scale, np.empty((C, n), np.float32))
        self.topk_ids = self.topk_lp = None
        if k > 0:
            self.topk_ids = make("topk_ids", (T, k), (C, k), "int32", ("token", "rank"))
            self.topk_lp = make("topk_logprobs", (T, k), (C, k), "float16", ("token", "rank"))
            self._tok["topk_ids"] = (self.topk_ids, np.empty((C, k), np.int32))
            self._tok["topk_logprobs"] = (self.topk_lp, np.empty((C, k), np.float16))
        self._small = small
        self._make = make
        # Local stores: whole chunks go straight to their files (see the module docstring).
        self._direct_root = None if loc.remote or not _plain_codecs(self.hidden) else loc.path(rel)
        self._made_dirs: set[str] = set()
        self.timing = {"write_s": 0.0, "hash_s": 0.0, "stage_s": 0.0, "bytes": 0}
        self._fill = 0  # rows staged in the buffers
        self._flushed = 0  # tokens already written to storage
        self._hash = {name: new_digest(checksum) for name in CHECKSUM_ARRAYS}
        self._input_ids: list[np.ndarray] = []
        self._loss_mask: list[np.ndarray] = []
        self._offsets = [0]
        self._ids: list[int] = []
        self.evidence = LayerEvidence(list(layout.layer_ids), H)

    @property
    def tokens_written(self) -> int:
        return self._offsets[-1]

    def append(self, sample_id: int, input_ids: np.ndarray, loss_mask: np.ndarray,
               hidden: np.ndarray, topk_ids: np.ndarray | None, topk_logprobs: np.ndarray | None,
               hidden_scale: np.ndarray | None = None, evidence: np.ndarray | None = None) -> None:
        """One sample: hidden [t, n, H] (uint16 bf16 bits, or uint8 fp8 bits with hidden_scale
        float32 [t, n]), top-k [t, k] (or None when topk == 0)."""
        self.append_batch([(sample_id, input_ids, loss_mask)], hidden, topk_ids, topk_logprobs, hidden_scale, evidence)

    def append_batch(self, samples: list, hidden: np.ndarray, topk_ids: np.ndarray | None,
                     topk_logprobs: np.ndarray | None, hidden_scale: np.ndarray | None = None,
                     evidence: np.ndarray | None = None) -> None:
        """Consecutive samples [(id, input_ids, loss_mask), ...] whose rows lie back to back in
        hidden [N, n, H] (and hidden_scale [N, n] for fp8) and top-k [N, k]; N is the sum of their
        lengths. `evidence`: the batch's table (cache/evidence.py), checked before anything of the
        batch is written (DegenerateLayer) and added to the shard's `layer_stats`."""
        lens = [int(ids.shape[0]) for _, ids, _ in samples]
        N = sum(lens)
        if evidence is not None:
            first = int(samples[0][1][0]) if N else 0
            check_batch(evidence, list(self.layout.layer_ids), [(int(sid), t) for (sid, _, _), t in zip(samples, lens)],
                        self.rel.rsplit("/", 1)[-1].removeprefix("tmp-").removesuffix(".zarr"),
                        one_token=all(bool(np.all(np.asarray(ids) == first)) for _, ids, _ in samples))
            self.evidence.add(evidence, N)
        n, H = self.layout.cache_layers, self.layout.hidden_size
        if self._offsets[-1] + N > self.layout.tokens:
            raise RuntimeError(f"shard {self.rel}: samples {samples[0][0]}.. overflow the planned {self.layout.tokens} tokens")
        if hidden.shape != (N, n, H) or hidden.dtype != self.hidden_np_dtype:
            raise RuntimeError(f"shard {self.rel}: hidden of shape {hidden.shape} {hidden.dtype} for {N} tokens of "
                               f"{len(samples)} samples, expected ({N}, {n}, {H}) {self.hidden_np_dtype}")
        inputs = {"hidden": hidden}
        if "hidden_scale" in self._tok:
            if hidden_scale is None or hidden_scale.shape != (N, n):
                raise RuntimeError(f"shard {self.rel}: fp8 hidden states need hidden_scale of shape ({N}, {n}), got "
                                   f"{None if hidden_scale is None else hidden_scale.shape}")
            inputs["hidden_scale"] = hidden_scale.astype(np.float32, copy=False)
        if self.topk_ids is not None:
            inputs["topk_ids"], inputs["topk_logprobs"] = topk_ids, topk_logprobs
        for (sid, ids, mask), t in zip(samples, lens):
            self._input_ids.append(np.asarray(ids, np.int32))
            self._loss_mask.append(np.asarray(mask, np.uint8))
            self._offsets.append(self._offsets[-1] + t)
            self._ids.append(int(sid))
        C = self.layout.chunk_tokens
        pos = 0
        # 1. Complete a partly staged chunk.
        if self._fill:
            take = min(C - self._fill, N)
            self._stage(inputs, pos, take)
            pos += take
            if self._fill == C:
                self._flush()
        # 2. Whole chunks straight from the caller's buffer.
        whole = (N - pos) // C * C
        if whole:
            a, b = self._flushed, self._flushed + whole
            for name, data in inputs.items():
                self._write(self._tok[name][0], name, a, b, data[pos:pos + whole])
            self._flushed = b
            pos += whole
        # 3. Stage the tail.
        if pos < N:
            self._stage(inputs, pos, N - pos)

    def _stage(self, inputs: dict, pos: int, take: int) -> None:
        t0 = time.perf_counter()
        f = self._fill
        for name, data in inputs.items():
            self._tok[name][1][f:f + take] = data[pos:pos + take]
        self._fill += take
        self.timing["stage_s"] += time.perf_counter() - t0

    def _write(self, arr, name: str, a: int, b: int, data: np.ndarray) -> None:
        t0 = time.perf_counter()
        C = self.layout.chunk_tokens
        if self._direct_root is not None and a % C == 0 and (b - a) % C == 0:
            for i in range(a // C, b // C):
                self._write_chunk_file(arr, name, i, data[(i - a // C) * C:(i - a // C + 1) * C])
        else:
            arr[a:b] = data
        t1 = time.perf_counter()
        self._hash[name].update(data)
        self.timing["write_s"] += t1 - t0
        self.timing["hash_s"] += time.perf_counter() - t1
        self.timing["bytes"] += data.nbytes

    def _write_chunk_file(self, arr, name: str, i: int, chunk: np.ndarray) -> None:
        """One whole chunk as Zarr stores it with codecs [bytes(little), crc32c]: raw bytes + CRC32C."""
        raw = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
        crc = np.array([google_crc32c.value(raw)], dtype="<u4").view(np.uint8)
        key = arr.metadata.encode_chunk_key((i,) + (0,) * (chunk.ndim - 1))
        path = f"{self._direct_root}/{name}/{key}"
        parent = path.rsplit("/", 1)[0]
        if parent not in self._made_dirs:
            os.makedirs(parent, exist_ok=True)
            self._made_dirs.add(parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(raw)
            done = os.writev(fd, [view, crc])
            total = raw.nbytes + 4
            while done < total:  # short write (rare): finish it
                rest = (view[done:], crc) if done < raw.nbytes else (crc[done - raw.nbytes:],)
                done += os.writev(fd, list(rest))
        finally:
            os.close(fd)

    def _flush(self) -> None:
        if self._fill == 0:
            return
        a, b = self._flushed, self._flushed + self._fill
        for name, (arr, buf) in self._tok.items():
            self._write(arr, name, a, b, buf[: self._fill])
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
            self._hash[aname].update(arr)
        digests = {k: h.hexdigest() for k, h in self._hash.items()
                   if k in self._tok or k in small}
        if self.evidence.vectors:  # what extraction saw of each layer (cache/evidence.py)
            self.group.attrs.update({"layer_stats": self.evidence.summary()})
        return {
            "name": name,
            "samples": len(self._ids),
            "tokens": T,
            "bytes": 0,
            "checksum": combine_digests(digests, self.checksum),
            "sample_ids": id_ranges(self._ids),
        }
