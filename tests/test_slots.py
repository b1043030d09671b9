"""extract's shared slots (extract/slots.py): anonymous shared memory that a spawned writer maps
from the descriptor it was started with, whichever way this Python can make such memory
(os.memfd_create, glibc's memfd_create through ctypes, an unlinked /dev/shm file), and that
nothing reaches by name."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from dflash_offline.extract import slots
from dflash_offline.extract.slots import Segment


def _child(handles, out):
    segs = [Segment.attach(h) for h in handles]
    out.put([bytes(s.buf[:4]) for s in segs])
    for s in segs:
        s.buf[4:8] = b"back"
        s.close()


@pytest.mark.parametrize("way", ["os", "libc", "shm-file"])
def test_a_spawned_writer_maps_the_segments_it_was_started_with(way, monkeypatch):
    if way != "os":
        monkeypatch.delattr(os, "memfd_create", raising=False)
    if way == "shm-file":
        monkeypatch.setattr(slots, "_libc_memfd", lambda: None)
    before = set(os.listdir("/dev/shm"))
    segs = [Segment.create(4096) for _ in range(3)]
    for i, s in enumerate(segs):
        s.buf[:4] = f"seg{i}".encode()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_child, args=([s.handle for s in segs], out))
    p.start()
    for s in segs:  # the child holds its own descriptors from its start
        s.release_handle()
    assert out.get(timeout=60) == [b"seg0", b"seg1", b"seg2"]
    p.join(60)
    assert p.exitcode == 0
    assert [bytes(s.buf[4:8]) for s in segs] == [b"back"] * 3  # shared, both ways
    # No name of ours left anywhere (the queue's own semaphores, sem.mp-*, are multiprocessing's).
    assert [f for f in set(os.listdir("/dev/shm")) - before if not f.startswith("sem.mp-")] == []
    with pytest.raises(RuntimeError, match="descriptor is closed"):
        segs[0].handle
    for s in segs:
        s.close()


def test_a_handle_travels_only_to_a_process_being_started():
    import pickle

    s = Segment.create(4096)
    try:
        with pytest.raises(RuntimeError, match="process being started"):
            pickle.dumps(s.handle)
    finally:
        s.close()
