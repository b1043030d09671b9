"""Process plumbing shared by both stages: log files, faulthandler, devices, launch, fault points.

This module imports nothing heavy (no torch, no zarr): it runs first in every process so that a
process that dies while importing torch or loading weights has already written its log header and
armed faulthandler. The earlier pipeline this project replaces died without a single log line.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"

log = logging.getLogger("dflash")


class UserError(Exception):
    """Bad input or configuration: the CLI prints the message as one line and exits with 2."""


# --------------------------------------------------------------------------------------------
# Logs


def open_process_log(log_dir: str | os.PathLike, name: str, *, console: bool = True) -> Path:
    """Create `log_dir/name.log`, point the `dflash` logger at it and arm faulthandler on it.

    Call this before importing torch or touching model weights. The file is opened in append mode
    so a resumed run keeps the history of the interrupted one.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{name}.log"
    # Line-buffered: a SIGKILL loses at most the line being written.
    stream = open(path, "a", buffering=1, encoding="utf-8")
    # faulthandler writes tracebacks of all threads on SIGSEGV/SIGFPE/SIGABRT/SIGBUS/SIGILL, and
    # on SIGUSR1 on demand (`kill -USR1 PID` shows where a hung process is).
    faulthandler.enable(file=stream, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True, chain=False)
    root = logging.getLogger("dflash")
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    fh = logging.StreamHandler(stream)
    fh.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(fh)
    global _file_handler
    _file_handler = fh
    if console:
        ch = logging.StreamHandler(sys.stderr)
        ch.setLevel(logging.WARNING)
        ch.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        root.addHandler(ch)
    root.propagate = False
    root.info(
        "---- %s started: pid %d on %s, python %s, argv %s",
        name, os.getpid(), socket.gethostname(), sys.version.split()[0], " ".join(sys.argv),
    )
    global _heartbeat
    _heartbeat = Heartbeat(log_dir / f"{name}{HEARTBEAT_SUFFIX}", name, path)
    return path


# --------------------------------------------------------------------------------------------
# Heartbeats: what a process is doing, for `dflash-offline status`

HEARTBEAT_SUFFIX = ".heartbeat.json"
HEARTBEAT_EVERY_S = 2.0

_heartbeat: "Heartbeat | None" = None
_file_handler: logging.Handler | None = None


class Heartbeat:
    """`LOGDIR/NAME.heartbeat.json`, replaced atomically: pid, host, phase, progress, last update.

    Written from the process's own loop (never from a thread; test-only fault points excepted),
    at most every HEARTBEAT_EVERY_S unless the phase changes: a heartbeat that stops advancing means the loop stopped, whatever
    the reason. `state` is running, done or failed (with the error); a process killed with
    SIGKILL leaves `running` behind, and `status` sees that its pid is gone.
    """

    def __init__(self, path: Path, name: str, log_path: Path):
        self.path = path
        self.data = {"name": name, "pid": os.getpid(), "host": socket.gethostname(), "log": str(log_path),
                     "started": time.time(), "updated": time.time(), "state": "running", "phase": "starting"}
        self._last = 0.0
        self._write()

    def beat(self, phase: str | None = None, **progress) -> None:
        changed = phase is not None and phase != self.data["phase"]
        if phase is not None:
            self.data["phase"] = phase
        self.data.update(progress)
        now = time.time()
        if changed or now - self._last >= HEARTBEAT_EVERY_S:
            self.data["updated"] = now
            self._write()

    def finish(self, state: str, error: str | None = None) -> None:
        self.data.update(state=state, updated=time.time(), error=error)
        self._write()

    def _write(self) -> None:
        import json

        self._last = time.time()
        tmp = self.path.with_name(self.path.name + f".tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)
        except OSError:  # a full or vanished log folder must not kill the work itself
            pass


def heartbeat(phase: str | None = None, **progress) -> None:
    """Update this process's heartbeat (a no-op before open_process_log)."""
    if _heartbeat is not None:
        _heartbeat.beat(phase, **progress)


def finish_heartbeat(state: str, error: str | None = None) -> None:
    if _heartbeat is not None:
        _heartbeat.finish(state, error)


@contextlib.contextmanager
def reported_outcome():
    """Around a worker process's work: heartbeat `done` when it returns, `failed` with the error
    (and the traceback in the log file) when it raises; the exception goes on."""
    try:
        yield
    except BaseException as e:
        record_failure(e)
        raise
    finish_heartbeat("done")


def record_failure(exc: BaseException) -> None:
    """Write the error (with its traceback, unless it is bad input) into the log file only (the
    terminal gets the CLI's one line) and mark the heartbeat failed: what `status` shows."""
    if _file_handler is not None:
        bad_input = isinstance(exc, UserError)
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "refused: %s" if bad_input else "failed: %s",
                                (exc,), None if bad_input else (type(exc), exc, exc.__traceback__))
        _file_handler.handle(record)
    finish_heartbeat("failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:500])


# --------------------------------------------------------------------------------------------
# Devices and launch


@dataclass(frozen=True)
class Launch:
    """Who this process is: started by our own launcher, by torchrun, or alone."""

    rank: int
    world_size: int
    local_rank: int
    under_torchrun: bool


def torchrun_launch() -> Launch | None:
    """The rank layout torchrun (or any torch.distributed launcher) put in the environment."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        return Launch(rank=rank, world_size=world, local_rank=local, under_torchrun=True)
    return None


def parse_devices(spec: str) -> list[str]:
    """`"0,1,2"` -> `["cuda:0", "cuda:1", "cuda:2"]`; `"cpu,cpu"` -> two CPU workers."""
    items = [s.strip() for s in str(spec).split(",") if s.strip()]
    if not items:
        raise UserError(f"--devices {spec!r} is empty: give GPU indices like 0,1,2 or 'cpu'")
    out = []
    for s in items:
        if s == "cpu":
            out.append("cpu")
        elif s.isdigit():
            out.append(f"cuda:{int(s)}")
        elif s.startswith("cuda:") and s[5:].isdigit():
            out.append(s)
        else:
            raise UserError(f"--devices: {s!r} is not a GPU index or 'cpu' (example: --devices 0,1,2,3,4)")
    gpus = [d for d in out if d != "cpu"]
    if len(set(gpus)) != len(gpus):
        raise UserError(f"--devices {spec!r} lists a GPU twice: one worker process per GPU")
    return out


def check_devices_exist(devices: list[str]) -> None:
    """Refuse GPU indices the machine does not have (torch imported here, no weights loaded)."""
    gpus = [int(d.split(":")[1]) for d in devices if d.startswith("cuda")]
    if not gpus:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [g for g in gpus if g >= count]
    if missing:
        raise UserError(
            f"--devices asks for GPU {','.join(map(str, missing))} but this machine has {count} CUDA "
            f"device(s){' (torch sees no CUDA)' if count == 0 else ''}; use --devices cpu to run on the CPU"
        )


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so a killed launcher leaves no worker
    writing into the cache behind it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def failed_process(procs) -> int | None:
    """Index of the first process that exited with a non-zero code, else None."""
    return next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)


def stop_processes(procs, failed: int | None) -> None:
    """After a failure, terminate the others (their committed work stays); then join all."""
    if failed is not None:
        for p in procs:
            if p.is_alive():
                p.terminate()
    for p in procs:
        p.join()


def single_thread_compute() -> None:
    """One compute thread per process: several worker processes share the machine's cores."""
    import torch

    torch.set_num_threads(int(os.environ.get("DFLASH_THREADS", "1")) or 1)


# --------------------------------------------------------------------------------------------
# Fault points for crash tests


_fault_counts: dict[tuple[str, str], int] = {}

# Environment variable -> what happens on the N-th arrival at the named point.
FAULT_VARS = {"DFLASH_OFFLINE_KILL_AT": "kill", "DFLASH_OFFLINE_RAISE_AT": "raise", "DFLASH_OFFLINE_STALL_AT": "stall"}


class InjectedFault(RuntimeError):
    """Raised by an armed fault point (DFLASH_OFFLINE_RAISE_AT): a stand-in for any crash."""


def fault_point(name: str) -> None:
    """Crash tests' hook at an exact point (mid-shard, between a shard's rename and its commit,
    after a training step...). On the N-th arrival at `name`:
      DFLASH_OFFLINE_KILL_AT=name:N   SIGKILL of the whole process group;
      DFLASH_OFFLINE_RAISE_AT=name:N  an InjectedFault exception (the error path: logs, status);
      DFLASH_OFFLINE_STALL_AT=name:N  sleep for an hour (a process caught mid-run, for `status`).
    Unset, it costs three dict lookups.
    """
    for var, action in FAULT_VARS.items():
        spec = os.environ.get(var)
        if not spec:
            continue
        want, _, n = spec.partition(":")
        if want != name:
            continue
        key = (action, name)
        _fault_counts[key] = _fault_counts.get(key, 0) + 1
        if _fault_counts[key] != int(n or 1):
            continue
        log.warning("fault point %s reached (%d): %s", name, _fault_counts[key], action)
        if action == "kill":
            time.sleep(0.05)
            os.killpg(os.getpgid(0), signal.SIGKILL)
        elif action == "raise":
            raise InjectedFault(f"injected failure at {name} ({var})")
        else:
            heartbeat(phase=f"stalled at {name}")
            time.sleep(3600)
