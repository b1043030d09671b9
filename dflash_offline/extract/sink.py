"""The extract worker's side of its shard writer processes: batches in shared host memory -> committed shards.

The extract worker's one thread runs the forward pass; everything after the device-to-host copy
runs in writer *processes* of its own, so the Zarr writes, the checksums and the memory copies
never hold the interpreter lock that the forward's kernel launches need (a writer thread in the
worker cost the forward about 30% on an H200, see docs/benchmarks.md).

    worker (one compute thread)                        writer process w (writer_process.py)
      forward -> gather -> async copies into slot s,     gets Batch(s, samples, N, seq) at once,
      then (same copy stream) seq into the slot's flag   waits until the slot's flag reads seq,
      Batch(s, ..., seq) -> writer w                  -> writes whole chunks straight from slot s,
      <- Free(s), Progress(tokens, bytes)                 stages the rest, CRC32C, and at a shard's
                                                          end renames and commits it

The flag is what makes the hand-over independent of the worker's thread: the device writes the
batch's sequence number into the slot after its data (stream order), and the writer polls it, so
a batch is written as soon as its copy lands, even while the worker's thread is blocked launching
the next forward (with a CUDA event instead, the hand-over waited for the thread, and the writer
idled while the forward queue was full).

Slots (slots.py) are shared-memory blocks, each holding one batch (hidden states, top-k ids and
log-probs).
On CUDA they are page-locked with cudaHostRegister, so the copies run asynchronously on a copy
stream. The segments are anonymous (slots.Segment): a SIGKILL of the whole process tree, at any
moment, leaves no slot behind (multiprocessing's queue semaphores, 32 bytes each, do stay). Shard j goes to writer (j-th shard begun) % W, so
several writers write consecutive shards side by side; a shard is written by exactly one process.
Back-pressure: when all slots are taken, `acquire` blocks the forward loop, so host memory stays at
`slots x slot size` whatever the writers' speed.
"""


from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time

from dflash_offline.cache.evidence import DegenerateLayer
from dflash_offline.cache.shards import ShardShape
from dflash_offline.extract.messages import (Batch, Begin, Close, Closed, Drop, End, Free, Progress, Ready,
                                             ShardDone, WriterError)
from dflash_offline.extract.slots import Segment, close_shm, slot_arrays, slot_bytes, slot_views
from dflash_offline.extract.writer_process import writer_main
from dflash_offline.runtime.signals import spawning

log = logging.getLogger("dflash.extract")


class WriterFailed(RuntimeError):
    """A shard writer process failed or died; the message names it and where its log is."""


class ShardSink:
    """The worker's handle on its writer processes and the shared slots they read.

    Use, per batch: `slot, seq = acquire()`, fill `views(slot)` (on CUDA asynchronously on a copy
    stream, then write `seq` into `views(slot)["flag"]` on the same stream, last), then
    `batch(slot, samples, N, seq)`; `begin(j, tokens)` / `end(j)` around each shard (`drop(j)` in
    place of `end` abandons it); `close()` at the end (raises if a writer failed), `abort()` on the
    error path.
    """

    def __init__(self, cache: str, shape: ShardShape, *, batch_tokens: int, writers: int, slots: int, pin: bool,
                 log_dir: str, log_name: str, on_progress, discard: bool = False):
        if writers < 1 or slots < 1:
            raise ValueError(f"need at least one writer and one slot (got {writers}, {slots})")
        self.on_progress = on_progress
        self.arrays = slot_arrays(batch_tokens, shape.cache_layers, shape.hidden_size, shape.topk, shape.hidden_dtype)
        size = slot_bytes(self.arrays)
        self.log_dir, self.log_name = log_dir, log_name
        self.shms: list[Segment] = []
        self._np: list[dict] = []
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

        try:
            for _ in range(slots):
                self.shms.append(Segment.create(size))
            self._np = [slot_views(s.buf, self.arrays) for s in self.shms]
            with spawning():  # the writers set their own signal dispositions first
                for w in range(writers):
                    p = ctx.Process(target=writer_main, name=f"{log_name}-writer{w}", daemon=True,
                                    args=(w, cache, shape, [s.handle for s in self.shms], self.arrays,
                                          self.inqs[w], self.outq, log_dir, f"{log_name}-writer{w}", discard))
                    p.start()
                    self.procs.append(p)
            self._release_handles()  # each writer was started with its own copies of the descriptors
            ready = 0
            deadline = time.time() + 300
            while ready < writers:
                msg = self._get(timeout=0.5)
                if isinstance(msg, Ready):
                    ready += 1
                if time.time() > deadline:
                    raise WriterFailed(f"shard writers did not start within 300 s; see {log_dir}")
            if pin:
                self._pin()
        except BaseException:
            self.abort()
            raise
        log.info("%d shard writer processes (pids %s), %d shared slots of %.1f MB%s", writers,
                 ", ".join(str(p.pid) for p in self.procs), slots, size / 1e6, ", page-locked" if pin else "")

    # -- shared memory --------------------------------------------------------------------------

    def _release_handles(self) -> None:
        for s in self.shms:
            s.release_handle()

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
        if isinstance(msg, Free):
            self.free.append(msg.slot)
        elif isinstance(msg, Progress):
            self.on_progress(msg.tokens, msg.nbytes)
        elif isinstance(msg, ShardDone):
            self.stats["shards"] += 1
            self.stats["writer_busy_s"] += msg.busy_s
            for key, v in msg.timing.items():
                self.stats[key] = self.stats.get(key, 0) + v
        elif isinstance(msg, WriterError):
            if msg.content:  # the forward's output refused: the line as it is, no advice to run again
                raise DegenerateLayer(msg.error)
            self.errors.append(f"writer {msg.writer}: {msg.error}")
            raise WriterFailed(self._failure())
        elif isinstance(msg, Closed):
            self._closed.add(msg.writer)

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
        self.inqs[w].put(Begin(j, tokens))

    def batch(self, slot: int, samples: list, N: int, seq: int) -> None:
        """Hand the slot to the current shard's writer now; it waits for the flag itself."""
        self.inqs[self._writer_of[self._current]].put(Batch(slot, samples, N, seq))
        self._drain()

    def end(self, j: int) -> None:
        self.inqs[self._writer_of[j]].put(End(j))
        self._drain()

    def drop(self, j: int) -> None:
        """Shard j is abandoned: its writer removes what it wrote of it (the shards handed over
        whole before it are still finished and committed)."""
        self.inqs[self._writer_of[j]].put(Drop(j))
        self._drain()

    def close(self) -> None:
        """Hand over everything, let the writers finish and exit; raises if one failed."""
        t0 = time.perf_counter()
        try:
            for q in self.inqs:
                q.put(Close())
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
        self._release_handles()
        self._np = []
        for s in self.shms:
            close_shm(s)
        self.shms = []
