"""The shared-memory slots between an extract worker and its shard writer processes: one batch each.

A slot is one shared-memory segment holding, in this order, 64-byte aligned: a flag (the sequence
number of the batch whose copy has landed), the hidden states, their fp8 scales, the top-k ids and
log-probs. The worker creates the segments, every writer maps them (`Segment.attach`); both see them
as numpy arrays (`slot_views`).

The segments are anonymous (Linux memfd), not files in /dev/shm: the kernel frees one when the last
process that maps it or holds its descriptor ends, so a SIGKILL at any moment, writers' start-up
included, leaves nothing behind. A writer opens the worker's descriptor through /proc, which works
while the worker keeps it open; the worker closes it once every writer has mapped the segment.
"""

from __future__ import annotations

import mmap
import os

import numpy as np


class Segment:
    """One anonymous shared-memory block: `buf` (a memoryview), `size`, `handle` (what a child
    process passes to `attach`)."""

    def __init__(self, mm: mmap.mmap, size: int, handle: str, fd: int | None):
        self._mmap, self.size, self.handle, self._fd = mm, size, handle, fd
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, size: int) -> "Segment":
        if not hasattr(os, "memfd_create"):
            raise RuntimeError("extract's shared slots need Linux (memfd_create); this system has none")
        fd = os.memfd_create("dflash-slot", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(mm, size, f"/proc/{os.getpid()}/fd/{fd}", fd)

    @classmethod
    def attach(cls, handle: str, size: int) -> "Segment":
        """Map a segment another process created (while it still holds its descriptor)."""
        fd = os.open(handle, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the memory
        return cls(mm, size, handle, None)

    def release_handle(self) -> None:
        """Close the creator's descriptor: no process can attach from now on, and the memory lives
        exactly as long as the mappings."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self.release_handle()
        if self.buf is not None:
            self.buf.release()
            self._mmap.close()
            self.buf = self._mmap = None


def slot_arrays(batch_tokens: int, num_layers: int, hidden_size: int, topk: int,
                hidden_dtype: str = "bfloat16") -> list[tuple[str, tuple, str]]:
    """(name, shape, numpy dtype) of the arrays of one slot, in memory order. fp8 hidden states
    come as uint8 bits plus a float32 scale per token and layer."""
    k = max(topk, 1)
    fp8 = hidden_dtype == "float8_e4m3fn"
    return [("flag", (1,), "int64"), ("hidden", (batch_tokens, num_layers, hidden_size), "uint8" if fp8 else "uint16"),
            ("scale", (batch_tokens, num_layers), "float32"),
            ("ids", (batch_tokens, k), "int32"), ("lp", (batch_tokens, k), "float16")]


def slot_views(buf, arrays) -> dict[str, np.ndarray]:
    out, off = {}, 0
    for name, shape, dt in arrays:
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        out[name] = np.frombuffer(buf, dtype=dt, count=int(np.prod(shape)), offset=off).reshape(shape)
        off += (n + 63) // 64 * 64
    return out


def slot_bytes(arrays) -> int:
    return sum((int(np.prod(s)) * np.dtype(dt).itemsize + 63) // 64 * 64 for _, s, dt in arrays)


def close_shm(shm: Segment) -> None:
    try:
        shm.close()
    except BufferError:
        # A view still exports the buffer (on the error path, from a traceback's frame): the mapping
        # goes with it or with the process.
        shm.buf = shm._mmap = None
