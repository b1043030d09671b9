"""The plan preflight hands to every rank (TrainPlan): what the checks fixed, the same on all
ranks; the part that differs between epochs of a complete cache and --follow is typed apart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from dflash_offline.blocks.pieces import Pieces
    from dflash_offline.drafter.config import DrafterConfig


@dataclass(frozen=True)
class EpochPlan:
    """A complete cache: every epoch runs the same number of steps over all its samples."""

    refs: list  # (shard, sample, first token)
    lengths: np.ndarray  # sample lengths
    pieces: Pieces  # what the rows pack (a sample longer than --seq-len is split or cut)
    rows_per_epoch: int
    steps_per_epoch: int


@dataclass(frozen=True)
class FollowPlan:
    """--follow: windows of shards trained as extraction commits them."""

    num_shards: int  # the extraction plan's
    consumer: str  # this run's folder, as the manifest's consumers name it
    plan_tokens: int  # the extraction plan's tokens: the learning-rate schedule runs over them


@dataclass(frozen=True)
class TrainPlan:
    """What preflight fixed, handed to every rank: the same on all of them. Exactly one of `epochs`
    and `follow` is set; `total_steps` is exact for epochs and an estimate with --follow."""

    devices: list[str]
    world: int
    accum: int  # micro-batches per step
    total_steps: int
    drafter: DrafterConfig  # the drafter's config: its block size, mask token and method are read from here
    cache_fingerprint: str
    hidden_size: int
    target_layer_count: int  # layers the drafter reads (len(target_layers), of the cache's)
    cache_layers: int  # layers a cache row holds per token
    layer_columns: list[int] | None  # their columns in the cache's rows, None for all
    topk: int
    hidden_dtype: str
    lr: float
    epochs: EpochPlan | None = None
    follow: FollowPlan | None = None
