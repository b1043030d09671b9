"""What the steps run over: epochs of a complete cache, or (--follow) windows of shards of a cache
being filled, each trained once all its shards are committed; the windows' record (consumed.jsonl)
and their release to extraction (the manifest's consumers, --stream)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NamedTuple

from dflash_offline.cache.location import Location
from dflash_offline.cache.manifest import ManifestStore, committed_names, occupancy
from dflash_offline.cache.shards import delete_released, shard_name
from dflash_offline.options import also, where
from dflash_offline.runs.checkpoint import FollowPosition
from dflash_offline.train.config import TrainConfig
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.logs import heartbeat, pid_alive, processes
from dflash_offline.train.plan import TrainPlan
from dflash_offline.runs.folder import CONSUMED

if TYPE_CHECKING:
    import numpy as np

    from dflash_offline.blocks.pieces import Pieces, SampleTable
    from dflash_offline.train.trainer import LoopState

log = logging.getLogger("dflash.train")


def window_misfit(cfg: TrainConfig, m: dict) -> str | None:
    """Why a follow window can never be on storage at once under the cache's budget, or None.
    A window is up to follow_window shards of at most the plan's largest shard (extract records
    both); fewer than that would leave extraction paused and the trainer waiting, forever."""
    budget, biggest = m.get("budget_bytes"), m.get("max_shard_bytes")
    if budget and biggest and cfg.follow_window * biggest > budget:
        return (f"{where(cfg, 'follow_window')} {cfg.follow_window} shards of up to {biggest / 1e6:.1f} MB do not fit the cache's "
                f"budget ({budget / 1e6:.1f} MB, extract --max-bytes): extraction would pause and the trainer wait "
                f"forever; lower --follow-window to {max(1, budget // biggest)} or raise the budget")
    return None


@dataclass
class Segment:
    """A run of steps over one sample order: an epoch, or a follow window of shards."""

    key: int  # epoch, or window index: seeds the order and the anchors
    refs: list  # (shard, sample, first token)
    lengths: np.ndarray  # sample lengths
    pieces: Pieces  # what the rows pack
    base: int  # global step at the segment's first step
    steps: int
    shards: list = field(default_factory=list)
    sample_ids: list = field(default_factory=list)  # follow: ids of the samples the rows hold
    tokens: int = 0  # follow: the window's tokens, and those of all windows before it (the schedule)
    tokens_before: int = 0



def extraction_gone(cache: str, fresh_s: float = 120.0) -> str | None:
    """When the processes that fill `cache` have all ended, their states; None while one may still
    run, or when nothing can be known. Read from the cache's log folder: heartbeats (running or
    stale counts as running), the last start line of each extract log (a launcher that starts
    again writes its log at once but claims its heartbeat only after its preflight: a live pid on
    this host, or a log written within `fresh_s` on another, counts as running); and heartbeats
    older than the manifest's last commit belong to an earlier run (this one logs elsewhere, with
    --log-dir): unknown. A remote cache: unknown."""
    loc = Location(cache)
    logs = None if loc.remote else Path(loc.path("logs"))
    procs = processes(logs, stage="extract-") if logs is not None and logs.is_dir() else []
    if not procs or any(p["state"] in ("running", "stale") for p in procs):
        return None
    now, host = time.time(), socket.gethostname()
    for f in logs.glob("extract-*.log"):
        try:
            with open(f, "rb") as fh:
                fh.seek(max(0, os.fstat(fh.fileno()).st_size - 65536))
                tail = fh.read().decode("utf-8", "replace")
            mtime = os.stat(f).st_mtime
        except OSError:
            continue
        starts = re.findall(r"started: pid (\d+) on (\S+),", tail)
        if starts:
            pid, on = int(starts[-1][0]), starts[-1][1]
            if (on == host and pid_alive(pid)) or (on != host and now - mtime < fresh_s):
                return None
    try:
        committed_at = os.stat(loc.path("manifest.json")).st_mtime
    except OSError:
        return None
    if committed_at > max(float(p.get("updated", 0)) for p in procs) + 60:
        return None  # a commit after every logged process ended: the writer logs elsewhere
    return ", ".join(f"{p['name']} {p['state']}" for p in procs)


def epoch_segments(plan: TrainPlan, step: int, stop: int):
    """The epochs from the one holding `step` to the one holding step `stop`."""
    ep = plan.epochs
    spe = ep.steps_per_epoch
    for e in range(step // spe, -(-stop // spe)):
        yield Segment(e, ep.refs, ep.lengths, ep.pieces, e * spe, spe)


class WindowRows(NamedTuple):
    """A committed follow window: its samples, the ids of those its rows hold, and its steps."""

    table: SampleTable
    sample_ids: list[int]
    steps: int


def follow_window_rows(cfg: TrainConfig, plan: TrainPlan, window: int, names: list[str]) -> WindowRows:
    """A committed window's samples and steps: its pieces are packed in the order
    epoch_order(window), and the last step is filled with empty rows (no sample dropped)."""
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.blocks.packing import epoch_order
    from dflash_offline.blocks.pieces import pack_pieces, scan_samples

    reader = CacheReader(cfg.cache)
    table = scan_samples([(name, reader.shard(name)) for name in names], cfg.seq_len, cfg.long_samples)
    rows = pack_pieces(table.pieces, epoch_order(len(table.refs), cfg.seed, window), cfg.seq_len)
    # A split sample's pieces follow each other in the order: each id once, where its first piece is.
    trained = list(dict.fromkeys(table.ids[p.sample] for row in rows for p in row))
    return WindowRows(table, trained, -(-len(rows) // (plan.world * plan.accum)))


class Waiting(NamedTuple):
    """follow_segments waits for shards: every rank checks here for an agreed stop (a stop ends the
    iteration: the loop stops asking for windows)."""


class CheckpointDue(NamedTuple):
    """Extraction waits for space that trained windows hold (--stream): checkpoint after `seg`, which
    releases them, then the wait goes on."""

    seg: Segment


WAITING = Waiting()


def follow_segments(cfg: TrainConfig, plan: TrainPlan, rank: int, world: int, device: str, start: FollowPosition,
                    st: LoopState) -> Iterator[Segment | Waiting | CheckpointDue]:
    """Windows of `follow_window` shards in plan order, each yielded once all its shards are
    committed, and between them the points where the loop acts while it waits (Waiting: check for
    a stop; CheckpointDue: checkpoint). Rank 0 watches the manifest and tells the others (a
    broadcast per poll), so every rank gets the same items at the same moment. `st`, the loop's
    state, is read (its step and last checkpoint), never written."""
    import torch
    import torch.distributed as dist

    G, N = cfg.follow_window, plan.follow.num_shards
    window, base, tokens_before = start.window, start.window_start, start.tokens_before
    store = ManifestStore(Location(cfg.cache, where(cfg, "cache")))
    flag = torch.zeros(1, dtype=torch.int64, device=device if device.startswith("cuda") else "cpu")
    prev, warned = None, False
    while window * G < N:
        names = [shard_name(i) for i in range(window * G, min((window + 1) * G, N))]
        t0, last_log, told = time.time(), 0.0, None
        while True:
            if rank == 0:
                m = store.read()
                problem = window_misfit(cfg, m)  # a budget set (or changed) after this run started
                if problem:
                    raise UserError(problem)
                have = committed_names(m)
                missing = [n for n in names if n not in have]
                budget, biggest = m.get("budget_bytes"), m.get("max_shard_bytes") or 0
                blocked = (budget is not None and missing[:1] and missing[0] not in (m.get("reserved") or {})
                           and occupancy(m) + biggest > budget)
                if not missing:
                    code = 1
                elif cfg.stream and blocked and prev is not None and st.last_ckpt < st.step:
                    code = 2  # extraction waits for space that trained windows hold: checkpoint, release them
                else:
                    code = 0
                    if time.time() - last_log > 30:
                        log.info("waiting for %s (window %d: %d of %d shards committed; the cache has %d of %d%s)",
                                 missing[0], window, len(names) - len(missing), len(names), len(have), N,
                                 "; extraction is paused for space" if blocked else "")
                        last_log = time.time()
                        gone = extraction_gone(cfg.cache)
                        if gone is not None and gone != told:  # on the terminal: this wait has no end by itself
                            log.warning("waiting for %s, but no extract process of %s is running (%s): run the "
                                        "extract command again (it resumes), or stop this run", missing[0],
                                        cfg.cache, gone)
                        told = gone
                flag.fill_(code)
            if world > 1:
                dist.broadcast(flag, 0)
            code = int(flag.item())
            if code == 1:
                break
            if code == 2:
                yield CheckpointDue(prev)
                continue
            yield WAITING
            heartbeat(phase="waiting for shards", step=st.step, window=window, first_shard=names[0])
            fault_point("train-waiting")
            time.sleep(0.5)
        if time.time() - t0 > 1 and rank == 0:
            log.info("window %d ready after %.1fs waiting", window, time.time() - t0)
        got = follow_window_rows(cfg, plan, window, names)
        table = got.table
        said = table.long.line(where(cfg, "seq_len"), also(cfg, "seq_len"), also(cfg, "long_samples"))
        if said and rank == 0:  # on the terminal once, in the log for every window
            (log.info if warned else log.warning)("window %d: %s", window, said)
            warned = True
        # The schedule runs over the cache's tokens (the plan's count), whatever the rows keep of them.
        prev = Segment(window, table.refs, table.lengths, table.pieces, base, got.steps, names, got.sample_ids,
                       int(table.lengths.sum()), tokens_before)
        yield prev
        base += got.steps
        tokens_before += prev.tokens
        window += 1


def record_window(out: Path, seg: Segment) -> None:
    """One line per trained window: its shards and the ids of the samples its rows held (a
    multi-pass cache holds each id once per pass). Lines past the resumed checkpoint go on resume."""
    with open(out / CONSUMED, "a") as f:
        f.write(json.dumps({"window": seg.key, "first_step": seg.base, "steps": seg.steps, "shards": seg.shards,
                            "sample_ids": seg.sample_ids}) + "\n")


def release_consumed(cfg: TrainConfig, plan: TrainPlan, window: int) -> None:
    """Rank 0, after a checkpoint whose next window is `window`: the shards of all earlier windows
    are finished for good. Recorded in the manifest first; with --stream their data is deleted
    after (a kill in between leaves folders that the next call deletes)."""
    n = min(window * cfg.follow_window, plan.follow.num_shards)
    if n == 0:
        return
    loc = Location(cfg.cache, where(cfg, "cache"))
    finished = [shard_name(i) for i in range(n)]
    store = ManifestStore(loc)
    pending = store.record_consumed(plan.follow.consumer, finished, release=cfg.stream)
    fault_point("train-released")
    delete_released(store, pending)
    if pending:
        log.info("released %d shards (%s .. %s)", len(pending), pending[0], pending[-1])
