"""Read a committed cache: the manifest, its shards, one sample, and checksum verification.

Only shards the manifest lists are visible; folders it does not list are debris and ignored.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import zarr

from ..runtime import UserError
from .location import Location
from .manifest import ManifestStore
from .writer import CHECKSUM_ARRAYS, combine_digests


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 words holding bfloat16 -> float32 (exact: bf16 is the top half of an fp32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass
class Sample:
    sample_id: int
    input_ids: np.ndarray  # int32 [t]
    loss_mask: np.ndarray  # uint8 [t]
    hidden_bits: np.ndarray  # uint16 [t, n, H] (bfloat16 bits)
    topk_ids: np.ndarray | None  # int32 [t, k]
    topk_logprobs: np.ndarray | None  # float16 [t, k]
    shard: str = ""  # the shard it was read from

    @property
    def hidden(self) -> np.ndarray:
        """float32 [t, n, H]."""
        return bf16_bits_to_float32(self.hidden_bits)


class Shard:
    def __init__(self, loc: Location, entry: dict):
        self.entry = entry
        self.name = entry["name"]
        self.group = zarr.open_group(store=loc.url(f"shards/{self.name}.zarr"), mode="r", **loc.zarr_kwargs())
        self.offsets = self.group["sample_offsets"][:]
        self.ids = self.group["sample_ids"][:]
        self._index = {int(i): k for k, i in enumerate(self.ids)}

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def sample(self, k: int) -> Sample:
        a, b = int(self.offsets[k]), int(self.offsets[k + 1])
        g = self.group
        has_topk = "topk_ids" in g
        return Sample(
            sample_id=int(self.ids[k]),
            input_ids=g["input_ids"][a:b], loss_mask=g["loss_mask"][a:b], hidden_bits=g["hidden"][a:b],
            topk_ids=g["topk_ids"][a:b] if has_topk else None,
            topk_logprobs=g["topk_logprobs"][a:b] if has_topk else None, shard=self.name,
        )

    def by_id(self, sample_id: int) -> Sample | None:
        k = self._index.get(int(sample_id))
        return None if k is None else self.sample(k)

    def compute_checksum(self, chunk_tokens: int = 8192) -> str:
        digests = {}
        for name in CHECKSUM_ARRAYS:
            if name not in self.group:
                continue
            arr = self.group[name]
            h = hashlib.sha256()
            for a in range(0, arr.shape[0], chunk_tokens):
                h.update(np.ascontiguousarray(arr[a:a + chunk_tokens]).tobytes())
            digests[name] = h.hexdigest()
        return combine_digests(digests)


class CacheReader:
    def __init__(self, root: str):
        self.loc = Location(root)
        manifest = ManifestStore(self.loc).read()
        if manifest is None:
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
        except Exception as e:  # a chunk whose CRC32C fails, a missing or truncated file
            return f"unreadable ({type(e).__name__}: {e})"
        return None if got == self.entry(name)["checksum"] else "checksum mismatch"

    def entry(self, name: str) -> dict:
        return next(s for s in self.manifest["shards"] if s["name"] == name)
