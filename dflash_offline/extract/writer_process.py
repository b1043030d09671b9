"""A shard writer process: batches in the shared slots -> Zarr shards, each committed at its end.

Started by `sink.ShardSink`, one or more per extract worker; numpy and Zarr only (no torch, no
CUDA), so its writes, checksums and memory copies never hold the worker's interpreter lock. It
takes `messages.Begin` / `Batch` / `End` / `Close` from its worker, in order, and answers with
`Ready`, `Free` (a slot it is done with), `Progress`, `ShardDone`, `WriterError` and `Closed`.
"""

from __future__ import annotations

import logging
import os
import queue
import time

import numpy as np

from dflash_offline.cache.evidence import DegenerateLayer
from dflash_offline.cache.location import Location
from dflash_offline.cache.manifest import ManifestStore
from dflash_offline.cache.shards import ShardShape, publish_shard, shard_name, tmp_shard_rel
from dflash_offline.extract.messages import (Batch, Begin, Close, Closed, Drop, End, Free, Progress, Ready,
                                             ShardDone, WriterError)
from dflash_offline.extract.slots import Segment, SegmentHandle, close_shm, slot_bytes, slot_views
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.logs import heartbeat, open_process_log, reported_outcome
from dflash_offline.runtime.signals import ignore_stop_signals
from dflash_offline.runtime.supervise import die_with_parent

log = logging.getLogger("dflash.extract")


def _wait_flag(flag: np.ndarray, seq: int) -> None:
    """Until the device's copy of batch `seq` into this slot has landed (its flag is written last).
    The worker's death ends this process (die_with_parent), and a worker that stops waits for no
    writer, so no timeout is needed here; the heartbeat keeps saying the process is alive."""
    delay = 0.0002
    while int(flag[0]) != seq:
        time.sleep(delay)
        delay = min(delay * 2, 0.002)
        heartbeat()


def _next_message(inq):
    """The next message from the worker, beating the heartbeat while there is none."""
    while True:
        try:
            return inq.get(timeout=5.0)
        except queue.Empty:
            heartbeat()


def writer_main(w: int, cache: str, shape: ShardShape, slot_handles: list[SegmentHandle], arrays, inq, outq,
                log_dir: str, log_name: str, discard: bool = False) -> None:
    """Entry of writer process w: log file first, then its loop (numpy and Zarr only)."""
    die_with_parent()
    ignore_stop_signals()  # the worker decides when its writers stop (it finishes the shard first)
    open_process_log(log_dir, log_name, console=False, claim=True)
    try:
        with reported_outcome():
            _writer_loop(w, cache, shape, slot_handles, arrays, inq, outq, discard)
    except DegenerateLayer as e:  # the content refused before the shard commits: its one line, no traceback
        log.error("refused: %s", e)
        outq.put(WriterError(w, str(e), content=True))
        raise SystemExit(1) from None
    except BaseException as e:
        log.exception("shard writer %d failed", w)
        outq.put(WriterError(w, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None


def _writer_loop(w, cache, shape, slot_handles, arrays, inq, outq, discard: bool) -> None:
    loc = Location(cache)
    store = ManifestStore(loc)
    shms = [Segment.attach(h) for h in slot_handles]
    try:
        _write_loop(w, loc, store, shms, arrays, shape, inq, outq, discard)
    finally:
        for shm in shms:
            close_shm(shm)
    outq.put(Closed(w))


def _write_loop(w, loc, store, shms, arrays, shape, inq, outq, discard: bool) -> None:
    from dflash_offline.cache.writer import ShardLayout, ShardWriter

    slots = [slot_views(s.buf, arrays) for s in shms]
    outq.put(Ready(w, os.getpid()))
    log.info("shard writer %d: %d shared slots of %.1f MB mapped", w, len(shms), slot_bytes(arrays) / 1e6)
    writer, t_shard, busy = None, 0.0, 0.0
    heartbeat(phase="write")
    while True:
        msg = _next_message(inq)
        if isinstance(msg, Close):
            break
        heartbeat()
        t0 = time.perf_counter()
        if discard:  # benchmarks only: measures the pipeline without the writes
            if isinstance(msg, Batch):
                _wait_flag(slots[msg.slot]["flag"], msg.seq)
                outq.put(Free(msg.slot))
                outq.put(Progress(msg.tokens, 0))
            continue
        if isinstance(msg, Begin):
            tmp = tmp_shard_rel(shard_name(msg.j))
            loc.rmtree(tmp)
            writer = ShardWriter(loc, tmp, ShardLayout.of(shape, msg.tokens))
            t_shard, busy = time.time(), 0.0
        elif isinstance(msg, Batch):
            v, N = slots[msg.slot], msg.tokens
            _wait_flag(v["flag"], msg.seq)
            t0 = time.perf_counter()  # busy time starts when the data is there
            has_k = shape.topk > 0
            fp8 = shape.hidden_dtype == "float8_e4m3fn"
            writer.append_batch(msg.samples, v["hidden"][:N], v["ids"][:N] if has_k else None,
                                v["lp"][:N] if has_k else None, v["scale"][:N] if fp8 else None,
                                evidence=v["evidence"])
            outq.put(Free(msg.slot))
            outq.put(Progress(N, 0))
            fault_point("batch-written")
        elif isinstance(msg, Drop):  # a stop mid-shard: what was written of it goes (resume writes it anew)
            writer = None
            loc.rmtree(tmp_shard_rel(shard_name(msg.j)))
            log.info("dropped %s: a stop landed before its last batch; it is written anew on resume", shard_name(msg.j))
            continue
        elif isinstance(msg, End):
            name = shard_name(msg.j)
            entry = writer.close(name)
            writer_timing = dict(writer.timing)
            writer = None
            m = publish_shard(store, entry)
            dt = time.time() - t_shard
            busy += time.perf_counter() - t0
            log.info("committed %s: %d samples, %d tokens, %.1f MB in %.2fs (%.0f tokens/s; writer busy %.2fs, "
                     "%.0f MB/s while busy); cache %d/%d shards", name, entry["samples"], entry["tokens"],
                     entry["bytes"] / 1e6, dt, entry["tokens"] / max(dt, 1e-9), busy, entry["bytes"] / 1e6 / max(busy, 1e-9),
                     len(m["shards"]), m["plan"]["num_shards"])
            outq.put(Progress(0, entry["bytes"]))
            outq.put(ShardDone(w, name, busy, dt, writer_timing))
            continue
        else:
            raise TypeError(f"shard writer {w}: unexpected message {msg!r}")
        busy += time.perf_counter() - t0
    v = None
    slots.clear()  # the views pin the mappings: drop them before closing
