"""Read a committed cache: the manifest, its shards, one sample, and checksum verification.

Only shards the manifest lists are visible; folders it does not list are debris and ignored.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass

import google_crc32c
import numpy as np
import zarr

from dflash_offline.cache.location import Location
from dflash_offline.cache.manifest import ManifestStore
from dflash_offline.cache.shards import shard_rel
from dflash_offline.cache.writer import CHECKSUM_ARRAYS, checksum_algorithm, combine_digests, new_digest
from dflash_offline.runtime.errors import UserError


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 words holding bfloat16 -> float32 (exact: bf16 is the top half of an fp32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass
class Sample:
    sample_id: int
    input_ids: np.ndarray  # int32 [t]
    loss_mask: np.ndarray  # uint8 [t]
    hidden_bits: np.ndarray  # uint16 [t, n, H] (bfloat16 bits), or uint8 (float8 e4m3fn bits)
    topk_ids: np.ndarray | None  # int32 [t, k]
    topk_logprobs: np.ndarray | None  # float16 [t, k]
    shard: str = ""  # the shard it was read from
    hidden_scale: np.ndarray | None = None  # float32 [t, n]: 8-bit caches only

    @property
    def hidden(self) -> np.ndarray:
        """float32 [t, n, H]."""
        if self.hidden_scale is not None:
            from dflash_offline.cache.fp8 import dequantize_np

            return dequantize_np(self.hidden_bits, self.hidden_scale)
        return bf16_bits_to_float32(self.hidden_bits)


class ShardUnreadable(RuntimeError):
    """A committed shard's data cannot be read back as written (the message names the shard;
    `shard` is its name, `problem` what is wrong in words)."""

    def __init__(self, message: str, shard: str = "", cause: BaseException | None = None):
        super().__init__(message)
        self.shard = shard
        self.problem = damage_words(cause) if cause is not None else message


def damage_words(e: BaseException) -> str:
    """What a failed read of a shard's files says about them, in words rather than a library's
    exception text (a chunk that fails its CRC32C, a missing file, unreadable metadata)."""
    text = str(e)
    if "checksum do not match" in text or "fails its CRC32C" in text:
        return "a chunk of its data fails its CRC32C check: its bytes changed on storage"
    if "chunk files are missing" in text:
        return text  # our own words: which array, how many
    if isinstance(e, FileNotFoundError) or type(e).__name__ in ("GroupNotFoundError", "ArrayNotFoundError",
                                                                 "NodeNotFoundError"):
        return "files of the shard are missing"
    if type(e).__name__ == "JSONDecodeError":
        return "its Zarr metadata (zarr.json) is not valid JSON"
    if isinstance(e, (IndexError, KeyError)):
        return f"its arrays do not hold what the manifest lists ({type(e).__name__}: {text})"
    return f"{type(e).__name__}: {text}"


class Shard:
    """A committed shard, read through Zarr. Any read error names the shard; on a local cache a
    chunk file that is missing is an error too (Zarr would read it back as zeros)."""

    def __init__(self, loc: Location, entry: dict):
        self.entry = entry
        self.name = entry["name"]
        try:
            self.group = zarr.open_group(store=loc.url(shard_rel(self.name)), mode="r", **loc.zarr_kwargs())
            if not loc.remote:
                self._check_chunk_files(loc.path(shard_rel(self.name)))
            self.offsets = self.group["sample_offsets"][:]
            self.ids = self.group["sample_ids"][:]
        except Exception as e:
            raise ShardUnreadable(f"shard {self.name} is unreadable ({type(e).__name__}: {e})", self.name, e) from e
        self._index = {int(i): k for k, i in enumerate(self.ids)}

    def _check_chunk_files(self, root: str) -> None:
        for name, arr in self.group.arrays():
            if arr.ndim == 0:
                continue
            grid = [-(-n // c) for n, c in zip(arr.shape, arr.chunks)]
            want = int(np.prod(grid)) if arr.size else 0
            files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, name, "c")) for f in fs]
            if len(files) < want:
                raise ValueError(f"{name}: {want - len(files)} of its {want} chunk files are missing")
            # Raw bytes + CRC32C (what extract writes): every chunk file has one size, known from the
            # metadata; a cut one is named here, at open, not by the sample that first reads it.
            if [type(c).__name__ for c in arr.metadata.codecs] == ["BytesCodec", "Crc32cCodec"]:
                size = int(np.prod(arr.chunks)) * arr.dtype.itemsize + 4
                for f in files:
                    if (got := os.path.getsize(f)) != size:
                        raise ValueError(f"{name}: chunk file {os.path.relpath(f, os.path.join(root, name))} of {got} bytes, expected "
                                         f"{size} (truncated?)")

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def sample(self, k: int) -> Sample:
        try:
            return self._sample(k)
        except Exception as e:  # a chunk that fails its CRC32C, a truncated file: never skipped
            raise ShardUnreadable(f"shard {self.name}, sample {k} is unreadable ({type(e).__name__}: {e})", self.name,
                                  e) from e

    def _sample(self, k: int) -> Sample:
        a, b = int(self.offsets[k]), int(self.offsets[k + 1])
        g = self.group
        has_topk = "topk_ids" in g
        return Sample(
            sample_id=int(self.ids[k]),
            input_ids=g["input_ids"][a:b], loss_mask=g["loss_mask"][a:b], hidden_bits=g["hidden"][a:b],
            topk_ids=g["topk_ids"][a:b] if has_topk else None,
            topk_logprobs=g["topk_logprobs"][a:b] if has_topk else None, shard=self.name,
            hidden_scale=g["hidden_scale"][a:b] if "hidden_scale" in g else None,
        )

    def by_id(self, sample_id: int) -> Sample | None:
        k = self._index.get(int(sample_id))
        return None if k is None else self.sample(k)

    def compute_checksum(self, chunk_tokens: int = 8192, algorithm: str | None = None) -> str:
        """The shard's checksum, by the algorithm its manifest entry names (or `algorithm`)."""
        algorithm = algorithm or checksum_algorithm(self.entry["checksum"])
        digests = {}
        for name in CHECKSUM_ARRAYS:
            if name not in self.group:
                continue
            arr = self.group[name]
            h = new_digest(algorithm)
            for a in range(0, arr.shape[0], chunk_tokens):
                h.update(arr[a:a + chunk_tokens])
            digests[name] = h.hexdigest()
        return combine_digests(digests, algorithm)


class ChunkFiles:
    """Token ranges of a local cache's arrays, read straight from their chunk files.

    The mirror of the writer's direct chunk writes, for the trainer's loader processes: a chunk
    file is the chunk's raw little-endian bytes plus their CRC32C (codecs `bytes` + `crc32c`), so
    a range is one mapping per chunk it touches, a CRC check and a copy, where Zarr's read path adds
    its metadata machinery per shard and several copies per chunk. Each array's `zarr.json` is read
    once per process and cached (a few hundred bytes a shard). A chunk that fails its CRC32C, or a
    chunk file that is missing, raises: nothing is ever read back as zeros. Arrays whose codecs are
    anything else are read through Zarr.
    """

    def __init__(self, loc: Location):
        if loc.remote:
            raise ValueError("ChunkFiles reads local caches only")
        self.loc = loc
        self._meta: dict[tuple[str, str], dict | None] = {}

    def _array(self, shard: str, name: str) -> dict | None:
        key = (shard, name)
        if key not in self._meta:
            root = self.loc.path(f"{shard_rel(shard)}/{name}")
            with open(f"{root}/zarr.json", "rb") as f:
                m = json.load(f)
            codecs = [(c["name"], (c.get("configuration") or {}).get("endian")) for c in m["codecs"]]
            enc = m["chunk_key_encoding"]
            # One-byte dtypes carry no byte order (Zarr writes their `bytes` codec without one).
            one_byte = np.dtype(m["data_type"]).itemsize == 1
            plain = (codecs in ([("bytes", "little"), ("crc32c", None)],) + (([("bytes", None), ("crc32c", None)],)
                                                                             if one_byte else ())
                     and enc.get("name") == "default" and m["chunk_grid"]["name"] == "regular")
            if not plain:
                self._meta[key] = None
            else:
                chunk = tuple(m["chunk_grid"]["configuration"]["chunk_shape"])
                shape = tuple(m["shape"])
                if chunk[1:] != shape[1:]:
                    self._meta[key] = None  # chunked along more than the token axis
                else:
                    self._meta[key] = {"root": root, "shape": shape, "chunk": chunk, "dtype": np.dtype(m["data_type"]),
                                       "sep": (enc.get("configuration") or {}).get("separator", "/")}
        return self._meta[key]

    def read(self, shard: str, name: str, a: int, b: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [a, b) of array `name` of committed shard `shard` (into `out` when given: a
        C-contiguous array of the range's shape and dtype)."""
        m = self._array(shard, name)
        if m is None:
            g = zarr.open_group(store=self.loc.url(shard_rel(shard)), mode="r")
            got = g[name][a:b]
            if out is None:
                return got
            out[...] = got
            return out
        C, tail, dt, sep = m["chunk"][0], m["shape"][1:], m["dtype"], m["sep"]
        if not 0 <= a <= b <= m["shape"][0]:
            raise IndexError(f"shard {shard}, {name}: tokens [{a}, {b}) outside [0, {m['shape'][0]})")
        row = int(np.prod(tail, dtype=np.int64)) * dt.itemsize
        if out is None:
            out = np.empty((b - a,) + tail, dt)
        elif out.shape != (b - a,) + tail or out.dtype != dt or not out.flags.c_contiguous:
            raise ValueError(f"out of shape {out.shape} {out.dtype} for {name} tokens [{a}, {b}): expected "
                             f"{(b - a,) + tail} {dt}, C-contiguous")
        flat = out.reshape(-1).view(np.uint8)
        size = C * row + 4
        for i in range(a // C, (b - 1) // C + 1 if b > a else a // C):
            path = f"{m['root']}/c{sep}{i}" + f"{sep}0" * len(tail)
            # Mapped, not read: the CRC and the copy of the range read the page cache in place,
            # where readinto() first copies the whole chunk into a buffer (2.5-3x slower measured,
            # see docs/benchmarks.md). Committed chunk files never change, so the mapping is safe.
            with open(path, "rb", buffering=0) as f:
                got = os.fstat(f.fileno()).st_size
                if got != size:
                    raise ValueError(f"{path}: chunk file of {got} bytes, expected {size} (truncated?)")
                mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            chunk = np.frombuffer(mm, np.uint8)
            try:
                ok = google_crc32c.value(chunk[:-4]) == int.from_bytes(chunk[-4:].tobytes(), "little")
                if ok:
                    lo, hi = max(a, i * C), min(b, (i + 1) * C)
                    flat[(lo - a) * row:(hi - a) * row] = chunk[(lo - i * C) * row:(hi - i * C) * row]
            finally:
                chunk = None  # the mapping can close only once no array views it
                mm.close()
            if not ok:
                raise ValueError(f"{path}: chunk fails its CRC32C (corrupted data)")
        return out


class CacheReader:
    def __init__(self, root: str):
        self.loc = Location(root)
        manifest = ManifestStore(self.loc).read_committed()
        if manifest is None:
            if not self.loc.remote and not os.path.exists(self.loc.path()):
                raise UserError(f"{root}: no such folder; give a cache folder (the one with manifest.json)")
            raise UserError(f"{root}: no manifest.json; not a dflash-offline cache (or nothing committed yet)")
        self.manifest = manifest
        self._shards: dict[str, Shard] = {}

    @property
    def shard_names(self) -> list[str]:
        return [s["name"] for s in self.manifest["shards"]]

    def shard(self, name: str) -> Shard:
        if name not in self._shards:
            entry = next((s for s in self.manifest["shards"] if s["name"] == name), None)
            if entry is None:
                raise KeyError(f"shard {name} is not committed in the manifest")
            self._shards[name] = Shard(self.loc, entry)
        return self._shards[name]

    def samples(self):
        """Every committed sample, shard by shard."""
        for name in self.shard_names:
            sh = self.shard(name)
            for k in range(len(sh)):
                yield sh.sample(k)

    def sample(self, sample_id: int) -> Sample:
        for s in self.manifest["shards"]:
            if any(a <= sample_id <= b for a, b in s["sample_ids"]):
                got = self.shard(s["name"]).by_id(sample_id)
                if got is not None:
                    return got
        raise KeyError(f"sample id {sample_id} is not in the cache")

    def verify(self) -> list[str]:
        """Names of committed shards whose data no longer matches their checksum."""
        return [name for name in self.shard_names if self.verify_shard(name) is not None]

    def verify_shard(self, name: str) -> str | None:
        """None if the shard matches its checksum, else what is wrong with it."""
        try:
            got = self.shard(name).compute_checksum()
        except ShardUnreadable as e:  # its metadata or small arrays, when it is opened
            return f"unreadable ({e.problem})"
        except Exception as e:  # a chunk whose CRC32C fails, a missing or truncated file
            return f"unreadable ({damage_words(e)})"
        return None if got == self.entry(name)["checksum"] else "checksum mismatch"

    def entry(self, name: str) -> dict:
        return next(s for s in self.manifest["shards"] if s["name"] == name)


# Opening a cache given on a command line: one line naming the option and path when it fails
# (train's and eval's preflights).


def cache_reader(cache: str, label: str):
    """A CacheReader of a cache given as `label` (flag or recipe key): no manifest is one line naming it."""
    if not Location(cache, label).exists("manifest.json"):
        raise UserError(f"{label} {cache}: no manifest.json; not a dflash-offline cache (or nothing committed yet): "
                        "give the folder extract wrote")
    return CacheReader(cache)


def checked_shards(reader, label: str, verify: str):
    """(name, shard) of every committed shard, each there and open (and, with verify "full",
    matching its checksum) or one line naming `label` (the option and path) and the shard."""
    for name in reader.shard_names:
        if not reader.loc.exists(f"shards/{name}.zarr"):
            raise UserError(f"{label}: shard {name} is listed in manifest.json but missing on storage; "
                            "re-extract it (delete its entry from a copy of the manifest) or restore it")
        try:
            sh = reader.shard(name)
        except Exception as e:
            raise UserError(f"{label}: shard {name} does not open ({type(e).__name__}: {e})") from None
        if verify == "full":
            try:
                ok = sh.compute_checksum() == sh.entry["checksum"]
            except Exception:  # a chunk's CRC32C failed while reading
                ok = False
            if not ok:
                raise UserError(f"{label}: shard {name} does not match its checksum (corrupted data); re-extract it")
        yield name, sh


def check_shards(reader, label: str, verify: str) -> None:
    """checked_shards' checks over every committed shard, keeping none of them open (a cache read
    later, such as a held-out one, checked now rather than hours into a run)."""
    for _ in checked_shards(reader, label, verify):
        continue
