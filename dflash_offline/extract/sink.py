"""Shard writer processes: batches in shared host memory -> committed shards.

The extract worker's one thread runs the forward pass; everything after the device-to-host copy
runs in writer *processes* of its own, so the Zarr writes, the checksums and the memory copies
never hold the interpreter lock that the forward's kernel launches need (a writer thread in the
worker cost the forward about 30% on an H200, see docs/benchmarks.md).

    worker (one compute thread)                        writer process w (no torch, no CUDA)
      forward -> gather -> async copies into slot s,     gets ("batch", s, samples, N, seq) at once,
      then (same copy stream) seq into the slot's flag   waits until the slot's flag reads seq,
      ("batch", s, ..., seq) -> writer w              -> writes whole chunks straight from slot s,
      <- ("free", s), ("progress", tokens, bytes)         stages the rest, CRC32C, and at a shard's
                                                          end renames and commits it

The flag is what makes the hand-over independent of the worker's thread: the device writes the
batch's sequence number into the slot after its data (stream order), and the writer polls it, so
a batch is written as soon as its copy lands, even while the worker's thread is blocked launching
the next forward (with a CUDA event instead, the hand-over waited for the thread, and the writer
idled while the forward queue was full).

Slots are shared-memory blocks, each holding one batch (hidden states, top-k ids and log-probs).
On CUDA they are page-locked with cudaHostRegister, so the copies run asynchronously on a copy
stream. The segments are unlinked as soon as every writer has mapped them: a SIGKILL of the whole
process tree leaves nothing behind in /dev/shm. Shard j goes to writer (j-th shard begun) % W, so
several writers write consecutive shards side by side; a shard is written by exactly one process.
Back-pressure: when all slots are taken, `acquire` blocks the forward loop, so host memory stays at
`slots x slot size` whatever the writers' speed.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from multiprocessing import shared_memory

import numpy as np

from dflash_offline.runtime.faults import fault_point

log = logging.getLogger("dflash.extract")


def slot_arrays(batch_tokens: int, num_layers: int, hidden_size: int, topk: int,
                hidden_dtype: str = "bfloat16") -> list[tuple[str, tuple, str]]:
    """(name, shape, numpy dtype) of the arrays of one slot, in memory order. fp8 hidden states
    come as uint8 bits plus a float32 scale per token and layer."""
    k = max(topk, 1)
    fp8 = hidden_dtype == "float8_e4m3fn"
    return [("flag", (1,), "int64"), ("hidden", (batch_tokens, num_layers, hidden_size), "uint8" if fp8 else "uint16"),
            ("scale", (batch_tokens, num_layers), "float32"),
            ("ids", (batch_tokens, k), "int32"), ("lp", (batch_tokens, k), "float16")]


def _views(buf, arrays) -> dict[str, np.ndarray]:
    out, off = {}, 0
    for name, shape, dt in arrays:
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        out[name] = np.frombuffer(buf, dtype=dt, count=int(np.prod(shape)), offset=off).reshape(shape)
        off += (n + 63) // 64 * 64
    return out


def _slot_bytes(arrays) -> int:
    return sum((int(np.prod(s)) * np.dtype(dt).itemsize + 63) // 64 * 64 for _, s, dt in arrays)


def _close_shm(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:
        # A view still exports the buffer (on the error path, from a traceback's frame): the mapping
        # goes with it or with the process. Drop the handles so that the object's finalizer does not
        # try again at exit and print "Exception ignored" on the terminal.
        shm._buf = shm._mmap = None


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map a segment the worker created. A spawned child shares its parent's resource tracker, so
    registering the name again there is a no-op, and the worker's unlink unregisters it once."""
    return shared_memory.SharedMemory(name=name)


# ----------------------------------------------------------------------------------------------
# Writer process


def _wait_flag(flag: np.ndarray, seq: int) -> None:
    """Until the device's copy of batch `seq` into this slot has landed (its flag is written last).
    The worker's death ends this process (die_with_parent), and a worker that stops waits for no
    writer, so no timeout is needed here; the heartbeat keeps saying the process is alive."""
    from dflash_offline.runtime.logs import heartbeat

    delay = 0.0002
    while int(flag[0]) != seq:
        time.sleep(delay)
        delay = min(delay * 2, 0.002)
        heartbeat()


def _next_message(inq):
    """The next message from the worker, beating the heartbeat while there is none."""
    from dflash_offline.runtime.logs import heartbeat

    while True:
        try:
            return inq.get(timeout=5.0)
        except queue.Empty:
            heartbeat()


def writer_main(w: int, cache: str, layout_kw: dict, slot_names: list[str], arrays, inq, outq,
                log_dir: str, log_name: str, discard: bool = False) -> None:
    """Entry of writer process w: log file first, then its loop (numpy and Zarr only)."""
    from dflash_offline.runtime.logs import open_process_log, reported_outcome
    from dflash_offline.runtime.signals import ignore_stop_signals
    from dflash_offline.runtime.supervise import die_with_parent

    die_with_parent()
    ignore_stop_signals()  # the worker decides when its writers stop (it finishes the shard first)
    open_process_log(log_dir, log_name, console=False, claim=True)
    try:
        with reported_outcome():
            _writer_loop(w, cache, layout_kw, slot_names, arrays, inq, outq, discard)
    except BaseException as e:
        log.exception("shard writer %d failed", w)
        outq.put(("error", w, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None


def _writer_loop(w, cache, layout_kw, slot_names, arrays, inq, outq, discard: bool) -> None:
    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore

    loc = Location(cache)
    store = ManifestStore(loc)
    shms = [_attach(n) for n in slot_names]
    try:
        _write_loop(w, loc, store, shms, arrays, layout_kw, inq, outq, discard)
    finally:
        for shm in shms:
            _close_shm(shm)
    outq.put(("closed", w))


def _write_loop(w, loc, store, shms, arrays, layout_kw, inq, outq, discard: bool) -> None:
    from dflash_offline.cache.writer import ShardLayout, ShardWriter
    from dflash_offline.cache.manifest import shard_name
    from dflash_offline.extract.launcher import tmp_shard_rel

    slots = [_views(s.buf, arrays) for s in shms]
    outq.put(("ready", w, os.getpid()))
    log.info("shard writer %d: %d shared slots of %.1f MB mapped", w, len(shms), _slot_bytes(arrays) / 1e6)
    writer, t_shard, busy = None, 0.0, 0.0
    from dflash_offline.runtime.logs import heartbeat

    heartbeat(phase="write")
    while True:
        msg = _next_message(inq)
        if msg is None:
            break
        heartbeat()
        t0 = time.perf_counter()
        kind = msg[0]
        if discard:  # benchmarks only: measures the pipeline without the writes
            if kind == "batch":
                _wait_flag(slots[msg[1]]["flag"], msg[4])
                outq.put(("free", msg[1]))
                outq.put(("progress", msg[3], 0))
            continue
        if kind == "begin":
            _, j, tokens = msg
            loc.rmtree(tmp_shard_rel(j))
            writer = ShardWriter(loc, tmp_shard_rel(j), ShardLayout(tokens=tokens, **layout_kw))
            t_shard, busy = time.time(), 0.0
        elif kind == "batch":
            _, s, samples, N, seq = msg
            v = slots[s]
            _wait_flag(v["flag"], seq)
            t0 = time.perf_counter()  # busy time starts when the data is there
            has_k = layout_kw["topk"] > 0
            fp8 = layout_kw.get("hidden_dtype") == "float8_e4m3fn"
            writer.append_batch(samples, v["hidden"][:N], v["ids"][:N] if has_k else None,
                                v["lp"][:N] if has_k else None, v["scale"][:N] if fp8 else None)
            outq.put(("free", s))
            outq.put(("progress", N, 0))
            fault_point("batch-written")
        elif kind == "end":
            _, j = msg
            name = shard_name(j)
            entry = writer.close(name)
            writer_timing = dict(writer.timing)
            writer = None
            final = f"shards/{name}.zarr"
            loc.fsync_tree(tmp_shard_rel(j))
            loc.rmtree(final)
            loc.rename(tmp_shard_rel(j), final)
            fault_point("shard-renamed")
            entry["bytes"] = loc.du(final)
            m = store.commit_shard(entry)
            fault_point("shard-committed")
            dt = time.time() - t_shard
            busy += time.perf_counter() - t0
            log.info("committed %s: %d samples, %d tokens, %.1f MB in %.2fs (%.0f tokens/s; writer busy %.2fs, "
                     "%.0f MB/s while busy); cache %d/%d shards", name, entry["samples"], entry["tokens"],
                     entry["bytes"] / 1e6, dt, entry["tokens"] / max(dt, 1e-9), busy, entry["bytes"] / 1e6 / max(busy, 1e-9),
                     len(m["shards"]), m["plan"]["num_shards"])
            outq.put(("progress", 0, entry["bytes"]))
            outq.put(("shard", w, name, busy, dt, writer_timing))
            continue
        busy += time.perf_counter() - t0
    v = None
    slots.clear()  # the views pin the mappings: drop them before closing


# ----------------------------------------------------------------------------------------------
# Worker side


class WriterFailed(RuntimeError):
    pass


class ShardSink:
    """The worker's handle on its writer processes and the shared slots they read.

    Use, per batch: `slot, seq = acquire()`, fill `views(slot)` (on CUDA asynchronously on a copy
    stream, then write `seq` into `views(slot)["flag"]` on the same stream, last), then
    `batch(slot, samples, N, seq)`; `begin(j, tokens)` / `end(j)` around each shard; `close()` at
    the end (raises if a writer failed), `abort()` on the error path.
    """

    def __init__(self, cache: str, layout_kw: dict, *, batch_tokens: int, writers: int, slots: int, pin: bool,
                 log_dir: str, log_name: str, on_progress, discard: bool = False):
        import multiprocessing as mp

        if writers < 1 or slots < 1:
            raise ValueError(f"need at least one writer and one slot (got {writers}, {slots})")
        self.on_progress = on_progress
        self.arrays = slot_arrays(batch_tokens, layout_kw["num_layers"], layout_kw["hidden_size"], layout_kw["topk"],
                                  layout_kw.get("hidden_dtype", "bfloat16"))
        size = _slot_bytes(self.arrays)
        self.log_dir, self.log_name = log_dir, log_name
        self.shms = [shared_memory.SharedMemory(create=True, size=size) for _ in range(slots)]
        self._unlinked = False
        self._np = [_views(s.buf, self.arrays) for s in self.shms]
        ctx = mp.get_context("spawn")  # never fork a process that holds CUDA
        self.outq = ctx.Queue()
        self.inqs = [ctx.Queue() for _ in range(writers)]
        self.procs = []
        self.free: list[int] = list(range(slots))
        self._seq = 0  # batches handed over so far; the next one's flag value is _seq + 1
        self.errors: list[str] = []
        self.stats = {"shards": 0, "writer_busy_s": 0.0, "wait_slot_s": 0.0}
        self._writer_of: dict[int, int] = {}
        self._current = -1  # the shard begun last
        self._begun = 0
        self._closed: set[int] = set()
        self._pinned: list[int] = []
        # Called while waiting on the writers: run_shards sets the copy stream's query(), which
        # raises after a CUDA error (the flags would then never be written, and all would wait).
        self.poll = None
        from dflash_offline.runtime.signals import spawning

        try:
            with spawning():  # the writers set their own signal dispositions first
                for w in range(writers):
                    p = ctx.Process(target=writer_main, name=f"{log_name}-writer{w}", daemon=True,
                                    args=(w, cache, layout_kw, [s.name for s in self.shms], self.arrays,
                                          self.inqs[w], self.outq, log_dir, f"{log_name}-writer{w}", discard))
                    p.start()
                    self.procs.append(p)
            ready = 0
            deadline = time.time() + 300
            while ready < writers:
                msg = self._get(timeout=0.5)
                if msg is not None and msg[0] == "ready":
                    ready += 1
                if time.time() > deadline:
                    raise WriterFailed(f"shard writers did not start within 300 s; see {log_dir}")
            self._unlink()  # every writer has the segments mapped: nothing to leak from here on
            if pin:
                self._pin()
        except BaseException:
            self.abort()
            raise
        log.info("%d shard writer processes (pids %s), %d shared slots of %.1f MB%s", writers,
                 ", ".join(str(p.pid) for p in self.procs), slots, size / 1e6, ", page-locked" if pin else "")

    # -- shared memory --------------------------------------------------------------------------

    def _unlink(self) -> None:
        if not self._unlinked:
            for s in self.shms:
                s.unlink()
            self._unlinked = True

    def _pin(self) -> None:
        """Page-lock the slots so device-to-host copies into them run asynchronously."""
        import torch

        cudart = torch.cuda.cudart()
        for s, views in zip(self.shms, self._np):
            ptr = views["flag"].ctypes.data  # the start of the segment
            err = cudart.cudaHostRegister(ptr, s.size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of a {s.size / 1e6:.0f} MB shared slot failed ({err}); "
                                   "raise the locked-memory limit (ulimit -l) or lower --batch-tokens")
            self._pinned.append(ptr)

    def views(self, slot: int) -> dict:
        """torch views of a slot: flag [1] int64, hidden [T, n, H] uint16 (uint8 for fp8), scale [T, n]
        float32 (fp8 only), ids [T, k] int32, lp [T, k] float16."""
        import torch

        return {k: torch.from_numpy(v) for k, v in self._np[slot].items()}

    # -- messages ---------------------------------------------------------------------------

    def _get(self, timeout: float):
        try:
            msg = self.outq.get(timeout=timeout)
        except queue.Empty:
            self._check_alive()
            return None
        self._handle(msg)
        return msg

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "free":
            self.free.append(msg[1])
        elif kind == "progress":
            self.on_progress(msg[1], msg[2])
        elif kind == "shard":
            self.stats["shards"] += 1
            self.stats["writer_busy_s"] += msg[3]
            for key, v in msg[5].items():
                self.stats[key] = self.stats.get(key, 0) + v
        elif kind == "error":
            self.errors.append(f"writer {msg[1]}: {msg[2]}")
            raise WriterFailed(self._failure())
        elif kind == "closed":
            self._closed.add(msg[1])

    def _failure(self) -> str:
        what = "; ".join(self.errors) or ", ".join(
            f"writer {w} exited with code {p.exitcode}" for w, p in enumerate(self.procs) if p.exitcode not in (None, 0))
        return (f"shard writer failed ({what}); see {os.path.join(self.log_dir, self.log_name + '-writer*.log')}. "
                "Run the same command again to resume.")

    def _check_alive(self) -> None:
        if self.poll is not None:
            self.poll()  # e.g. the copy stream's query(): raises on a sticky CUDA error
        for w, p in enumerate(self.procs):
            if not p.is_alive() and w not in self._closed:
                # Let a message that is still in the queue name the cause (or say it closed).
                try:
                    while True:
                        self._handle(self.outq.get(timeout=0.2))
                except queue.Empty:
                    pass
                if w not in self._closed or p.exitcode not in (0, None):
                    raise WriterFailed(self._failure())

    def _drain(self) -> None:
        while True:
            try:
                msg = self.outq.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def acquire(self) -> tuple[int, int]:
        """(a free slot, the sequence number its batch will carry); blocks until a writer frees one."""
        self._drain()
        t0 = time.perf_counter()
        while not self.free:
            self._get(timeout=0.5)
        self.stats["wait_slot_s"] += time.perf_counter() - t0
        self._seq += 1
        return self.free.pop(), self._seq

    def begin(self, j: int, tokens: int) -> None:
        w = self._begun % len(self.procs)
        self._begun += 1
        self._writer_of[j] = w
        self._current = j
        self.inqs[w].put(("begin", j, tokens))

    def batch(self, slot: int, samples: list, N: int, seq: int) -> None:
        """Hand the slot to the current shard's writer now; it waits for the flag itself."""
        self.inqs[self._writer_of[self._current]].put(("batch", slot, samples, N, seq))
        self._drain()

    def end(self, j: int) -> None:
        self.inqs[self._writer_of[j]].put(("end", j))
        self._drain()

    def close(self) -> None:
        """Hand over everything, let the writers finish and exit; raises if one failed."""
        t0 = time.perf_counter()
        try:
            for q in self.inqs:
                q.put(None)
            while len(self._closed) < len(self.procs):
                self._get(timeout=0.5)
            for p in self.procs:
                p.join()
            self._drain()
        except BaseException:
            self.abort()
            raise
        self._release()
        self.stats["close_s"] = time.perf_counter() - t0

    def abort(self) -> None:
        """The error path: stop the writers where they are (uncommitted shards are debris)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()
        # Messages still buffered for a dead reader would block this process's exit (a queue's
        # feeder thread is joined at exit): drop them.
        for q in [*self.inqs, self.outq]:
            q.cancel_join_thread()
        self._release(aborting=True)

    def _release(self, aborting: bool = False) -> None:
        if self._pinned:
            import torch

            cudart = torch.cuda.cudart()
            try:
                torch.cuda.synchronize()  # no copy may still target a slot
            except RuntimeError:
                if not aborting:
                    raise
                self._pinned = []  # after a CUDA error: leave the mappings to the process's exit
                return
            for ptr in self._pinned:
                cudart.cudaHostUnregister(ptr)
            self._pinned = []
        self._unlink()
        self._np = []
        for s in self.shms:
            _close_shm(s)
        self.shms = []
