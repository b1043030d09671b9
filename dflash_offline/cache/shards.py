"""Shard folders of a cache: their names and paths, the one way a written shard is committed, and
the deletion of released ones.

A shard is written under a temporary name (`tmp_shard_rel`) and only a finished one is renamed to
its own (`shard_rel`) and listed in the manifest (`publish_shard`): a reader never sees a shard
folder half-written under a committed name, and a killed writer leaves debris that the next run
recognises by name and deletes (cache-contract.md).

`ShardShape` is what every shard of one extraction shares; a shard's `writer.ShardLayout` adds
its token count. It is defined here, not beside the writer, so extract's writer processes receive
it at their start without importing Zarr before their log is open.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_offline.cache.manifest import ManifestStore
from dflash_offline.runtime.faults import fault_point


@dataclass(frozen=True)
class ShardShape:
    """What every shard of one extraction shares (module docstring)."""

    cache_layers: int  # layers per token (len(layer_ids))
    hidden_size: int
    topk: int
    chunk_tokens: int
    layer_ids: list[int]
    hidden_dtype: str = "bfloat16"


def shard_name(j: int) -> str:
    """Shard j of the plan (in plan order): the format names shards by their plan index."""
    return f"shard-{j:06d}"


def shard_rel(name: str) -> str:
    """The committed shard's folder, relative to the cache root."""
    return f"shards/{name}.zarr"


def tmp_shard_rel(name: str) -> str:
    """Where the shard is written until it is committed."""
    return f"shards/tmp-{name}.zarr"


def publish_shard(store: ManifestStore, entry: dict) -> dict:
    """Commit a shard written completely under `tmp_shard_rel(entry["name"])`: its files on storage
    (fsync), renamed to its own name, its size in `entry["bytes"]`, and then listed in the manifest.
    A kill anywhere before the listing leaves an uncommitted folder that a rerun writes again.
    Returns the manifest after the commit."""
    loc = store.loc
    name = entry["name"]
    final = shard_rel(name)
    loc.fsync_tree(tmp_shard_rel(name))
    loc.rmtree(final)  # a renamed but uncommitted folder of a killed run
    loc.rename(tmp_shard_rel(name), final)
    fault_point("shard-renamed")
    entry["bytes"] = loc.du(final)
    m = store.commit_shard(entry)
    fault_point("shard-committed")
    return m


def delete_released(store: ManifestStore, names: list[str]) -> None:
    """Delete the data of released shards (the manifest lists them in `releasing`), then record
    that it is gone: the budget counts their bytes until then."""
    for name in names:
        store.loc.rmtree(shard_rel(name))
    if names:
        store.deleted(names)
