"""Supervising worker processes: a failed one stops the others; the launcher exits with its code."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

from dflash_offline.runtime.launch import RANK_WAIT_S, UNSET_RANK_VARS, launch_env
from dflash_offline.runtime.logs import heartbeat, log
from dflash_offline.runtime.signals import (
    FORWARD_SIGNALS,
    STOP_CODES,
    install_stop_handlers,
    request_stop,
    spawning,
    stop_requested,
)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so a killed launcher leaves no worker
    writing into the cache behind it."""
    if not sys.platform.startswith("linux"):
        return

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def failed_process(procs, allow=()) -> int | None:
    """Index of the first process that exited with a non-zero code (other than those in `allow`), else None."""
    return next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0, *allow)), None)


def forward_stop(procs, signum: int | None = None) -> None:
    """A launcher passes a stop request (`signum`, default the pending one) on to its worker
    processes as that signal's forward signal: each finishes its shard or step (the ranks agree on
    the step); a repeated request stops them at once."""
    fwd = FORWARD_SIGNALS.get(signum or stop_requested() or signal.SIGTERM, FORWARD_SIGNALS[signal.SIGTERM])
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, fwd)
            except ProcessLookupError:
                pass


STOP_GRACE_S = 20.0  # after a failure, how long the others get to finish their unit before SIGKILL


def stop_processes(procs, failed: int | None, abandon: bool = False) -> None:
    """Join the workers. After a failure (or when the launcher itself stops at once), the others
    are asked to stop, then killed if they are still running after STOP_GRACE_S: a rank stuck in a
    collective with a dead peer never reads its request, and SIGKILL is safe (nothing half-done is
    ever committed)."""
    if failed is not None or abandon:
        forward_stop(procs)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                log.warning("worker pid %d did not stop within %.0fs: killed", p.pid, STOP_GRACE_S)
                p.kill()
    for p in procs:
        p.join()


class WorkerError(NamedTuple):
    """A worker's own one-line error, sent to its launcher just before it exits (its log may sit on
    a full device)."""

    rank: int
    line: str


@dataclass
class WorkersEnded:
    """How a launcher's worker processes ended (run_workers)."""

    failed: int | None  # rank of the worker that failed first, else None
    error: str | None  # that worker's own one-line error, if it sent one
    exitcode: int | None  # that worker's exit code
    stopped: int | None  # the signal number when the run stopped on request, else None


def run_workers(entry, devices: list[str], job, stage: str, on_message) -> WorkersEnded:
    """Start one spawned process per device, `entry(rank, world, device, job, queue)`, and
    supervise them to the end: each message a worker puts on the queue goes to `on_message`
    (except WorkerError, kept for the failure report); a stop request is passed on to every
    worker; a worker stopped on its own (kill -TERM PID) stops the others; after a failure the
    others are stopped (stop_processes). The failure reported is the first one: the worker whose
    error line came first (after it, ranks of one process group fail in broken collectives), else
    the lowest rank that exited with an error."""
    ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
    q = ctx.Queue()
    procs = []
    install_stop_handlers(forward=lambda signum: forward_stop(procs, signum))
    with spawning():  # a request that comes meanwhile is forwarded once all are started
        for rank, dev in enumerate(devices):
            p = ctx.Process(target=entry, args=(rank, len(devices), dev, job, q), name=f"{stage}-rank{rank}")
            p.start()
            procs.append(p)
    log.info("started %d worker processes: %s", len(procs), ", ".join(f"{p.pid} on {d}" for p, d in zip(procs, devices)))
    heartbeat(phase=stage, workers=[p.pid for p in procs])
    failed = None
    errors: dict[int, str] = {}  # rank -> its error line, in the order they came

    def drain(timeout: float) -> bool:
        try:
            msg = q.get(timeout=timeout)
        except queue_mod.Empty:
            return False
        if isinstance(msg, WorkerError):
            errors.setdefault(msg.rank, msg.line)
        else:
            on_message(msg)
        return True

    try:
        while True:
            heartbeat(phase="stopping" if stop_requested() else stage)
            if drain(0.5):
                continue
            failed = failed_process(procs, allow=STOP_CODES)
            if any(p.exitcode in STOP_CODES for p in procs) and not stop_requested():
                # A worker was stopped on its own (kill -TERM PID): the others stop with it.
                request_stop(next(p.exitcode for p in procs if p.exitcode in STOP_CODES) - 128)
                forward_stop(procs)
            if failed is not None or all(p.exitcode is not None for p in procs):
                break
    except BaseException:  # a second signal (stop now), or an error in this loop
        stop_processes(procs, failed, abandon=True)
        raise
    stop_processes(procs, failed)
    if failed is not None:
        while drain(0.2):  # the failed workers' own error lines, sent just before they exited
            pass
        failed = next(iter(errors), failed)
    return WorkersEnded(failed=failed, error=errors.get(failed) if failed is not None else None,
                        exitcode=procs[failed].exitcode if failed is not None else None,
                        stopped=stop_requested() if failed is None else None)


def wait_for_other_ranks(read_manifest, progress) -> None:
    """A distributed launch: rank 0 reports the whole output, so it waits until the manifest says
    complete (every rank's units committed) or a stop is requested. No process group is needed:
    the manifest is the shared state. It says why it waits at once, how far it is every 30 s
    (`progress(manifest)`), and gives up when nothing was committed for DFLASH_OFFLINE_RANK_WAIT_S
    seconds (default RANK_WAIT_S): ranks that never started, or died without torchrun to tear
    this one down."""
    limit = float(os.environ.get("DFLASH_OFFLINE_RANK_WAIT_S", RANK_WAIT_S))
    t0 = last = moved = time.time()
    seen = None
    heartbeat(phase="waiting for the other ranks")
    while True:
        m = read_manifest()
        if m["status"] == "complete" or stop_requested():
            return
        now_at = progress(m)
        if now_at != seen:
            if seen is None:
                log.info("this rank's work is committed; waiting for the other ranks (%s): %s; giving up after %.0fs "
                         "without a commit", launch_env(), now_at, limit)
            seen, moved = now_at, time.time()
        if time.time() - moved > limit:
            raise RuntimeError(f"waited {time.time() - t0:.0f}s for the other ranks ({launch_env()}), "
                               f"{time.time() - moved:.0f}s without a commit: {now_at}; if no other rank is "
                               f"running: {UNSET_RANK_VARS} and run the same command again (it resumes)")
        heartbeat()
        if time.time() - last > 30:
            log.info("waiting for other ranks: %s (%.0fs)", now_at, time.time() - t0)
            last = time.time()
        time.sleep(0.5)
