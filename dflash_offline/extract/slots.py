"""The shared-memory slots between an extract worker and its shard writer processes: one batch each.

A slot is one shared-memory segment holding, in this order, 64-byte aligned: a flag (the sequence
number of the batch whose copy has landed), the hidden states, their fp8 scales, the top-k ids and
log-probs. The worker creates the segments, every writer maps them (`attach_shm`); both see them
as numpy arrays (`slot_views`).
"""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np


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


def close_shm(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:
        # A view still exports the buffer (on the error path, from a traceback's frame): the mapping
        # goes with it or with the process. Drop the handles so that the object's finalizer does not
        # try again at exit and print "Exception ignored" on the terminal.
        shm._buf = shm._mmap = None


def attach_shm(name: str) -> shared_memory.SharedMemory:
    """Map a segment the worker created. A spawned child shares its parent's resource tracker, so
    registering the name again there is a no-op, and the worker's unlink unregisters it once."""
    return shared_memory.SharedMemory(name=name)
