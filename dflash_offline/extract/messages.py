"""The messages on extract's queues, one type each: an extract worker's to its launcher, and the
ones between a worker and its shard writer processes (`sink.py`).

NamedTuples: they pickle small (a batch message crosses a process queue per forward batch), and a
receiver tells them apart by type rather than by a leading string. The worker's failure line is
run_workers' own WorkerError (runtime/supervise.py) and is not among them.
"""

from __future__ import annotations

from typing import NamedTuple


# -- an extract worker -> its launcher (progress bar and heartbeat); also writer -> worker ---------


class Progress(NamedTuple):
    """Tokens written into shards, and bytes committed (0 until a shard is committed)."""

    tokens: int
    nbytes: int


class Paused(NamedTuple):
    """A worker waits for the cache budget (--max-bytes), or goes on again (paused False)."""

    paused: bool
    used: int  # the cache's occupancy in bytes
    why: str  # what it waits for, in words ("" when it goes on)


# -- worker -> shard writer w ------------------------------------------------------------------


class Begin(NamedTuple):
    """Shard j starts: `tokens` tokens in all (its arrays are made that long)."""

    j: int
    tokens: int


class Batch(NamedTuple):
    """A batch of shard j in `slot`: its samples (id, input_ids, loss_mask) and `tokens` rows of
    the slot's arrays; the data is there once the slot's flag reads `seq`."""

    slot: int
    samples: list
    tokens: int
    seq: int


class End(NamedTuple):
    """Shard j is complete: close, rename and commit it."""

    j: int


class Drop(NamedTuple):
    """Shard j is abandoned (a stop landed mid-shard): its temporary folder goes, nothing commits."""

    j: int


class Close(NamedTuple):
    """No more shards: the writer exits after the messages before this one."""


# -- shard writer w -> worker ------------------------------------------------------------------


class Ready(NamedTuple):
    """Writer w has mapped every slot."""

    writer: int
    pid: int


class Free(NamedTuple):
    """The writer is done with this slot: the worker may fill it again."""

    slot: int


class ShardDone(NamedTuple):
    """Writer w committed shard `name`: its busy time, wall time and the writer's timing counters."""

    writer: int
    name: str
    busy_s: float
    seconds: float
    timing: dict


class WriterError(NamedTuple):
    """Writer w failed with this one-line error (it exits with 1 next); `content`: it refused what
    the forward wrote (cache/evidence.py), which running again would not change."""

    writer: int
    error: str
    content: bool = False


class Closed(NamedTuple):
    """Writer w has finished every message and exits."""

    writer: int
