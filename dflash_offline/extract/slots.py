"""The shared-memory slots between an extract worker and its shard writer processes: one batch each.

A slot is one shared-memory segment holding, in this order, 64-byte aligned: a flag (the sequence
number of the batch whose copy has landed), the hidden states, their fp8 scales, the top-k ids and
log-probs, and the batch's evidence table (cache/evidence.py). The worker creates the segments, every writer maps them (`Segment.attach`); both see them
as numpy arrays (`slot_views`).

The segments are anonymous (Linux memfd; an unlinked /dev/shm file where Python lacks memfd_create),
not names in /dev/shm: the kernel frees one when the last process that maps it or holds its
descriptor ends, so a SIGKILL at any moment, writers' start-up included, leaves nothing behind. A
writer receives the descriptors with its start (multiprocessing passes them to the spawned child,
`SegmentHandle`), so nothing is opened by name or through /proc.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from multiprocessing import context, reduction

import numpy as np

from dflash_offline.cache.evidence import table_columns


def _anonymous_fd(size: int) -> int:
    """A descriptor of `size` bytes of shared memory that no file name reaches."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("dflash-slot", os.MFD_CLOEXEC)
    else:
        fd = _libc_memfd()
        if fd is None:  # some Python builds lack os.memfd_create (built on an older glibc)
            fd = _unlinked_shm_file()
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _libc_memfd() -> int | None:
    try:
        f = ctypes.CDLL(None, use_errno=True).memfd_create
    except (AttributeError, OSError):
        return None
    fd = f(b"dflash-slot", 1)  # MFD_CLOEXEC
    return fd if fd >= 0 else None


def _unlinked_shm_file() -> int:
    """A /dev/shm file unlinked as soon as it exists (named for microseconds, not for a run)."""
    if not os.path.isdir("/dev/shm"):
        raise RuntimeError("extract's shared slots need Linux shared memory (memfd_create or /dev/shm); "
                           "this system has neither")
    path = f"/dev/shm/dflash-slot-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o600)
    os.unlink(path)
    return fd


class SegmentHandle:
    """What a writer maps a segment from: its descriptor, which travels only as an argument of a
    process being started (multiprocessing duplicates it into the child); the child's copy is
    closed once mapped."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size

    def __reduce__(self):
        if context.get_spawning_popen() is None:
            raise RuntimeError("a SegmentHandle can only be passed to a process being started")
        return (SegmentHandle._received, (reduction.DupFd(self.fd), self.size))

    @staticmethod
    def _received(dup, size: int) -> "SegmentHandle":
        return SegmentHandle(dup.detach(), size)


class Segment:
    """One anonymous shared-memory block: `buf` (a memoryview), `size`, and for the creator
    `handle` (to give to a writer at its start) until `release_handle`."""

    def __init__(self, mm: mmap.mmap, size: int, fd: int | None):
        self._mmap, self.size, self._fd = mm, size, fd
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, size: int) -> "Segment":
        fd = _anonymous_fd(size)
        try:
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(mm, size, fd)

    @property
    def handle(self) -> SegmentHandle:
        if self._fd is None:
            raise RuntimeError("this segment's descriptor is closed: no process can map it any more")
        return SegmentHandle(self._fd, self.size)

    @classmethod
    def attach(cls, handle: SegmentHandle) -> "Segment":
        """Map the segment a handle received at this process's start names."""
        try:
            mm = mmap.mmap(handle.fd, handle.size)
        finally:
            os.close(handle.fd)  # the mapping keeps the memory
        return cls(mm, handle.size, None)

    def release_handle(self) -> None:
        """Close the creator's descriptor: the memory lives exactly as long as the mappings (and
        the descriptors the writers were started with)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self.release_handle()
        if self.buf is not None:
            self.buf.release()
            self._mmap.close()
            self.buf = self._mmap = None


def slot_arrays(batch_tokens: int, cache_layers: int, hidden_size: int, topk: int,
                hidden_dtype: str = "bfloat16") -> list[tuple[str, tuple, str]]:
    """(name, shape, numpy dtype) of the arrays of one slot, in memory order. fp8 hidden states
    come as uint8 bits plus a float32 scale per token and layer."""
    k = max(topk, 1)
    fp8 = hidden_dtype == "float8_e4m3fn"
    return [("flag", (1,), "int64"), ("hidden", (batch_tokens, cache_layers, hidden_size), "uint8" if fp8 else "uint16"),
            ("scale", (batch_tokens, cache_layers), "float32"),
            ("ids", (batch_tokens, k), "int32"), ("lp", (batch_tokens, k), "float16"),
            ("evidence", (cache_layers, table_columns(cache_layers)), "float64")]


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
