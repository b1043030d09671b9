"""Process plumbing shared by both stages: log files, faulthandler, devices, launch, fault points.

This module imports nothing heavy (no torch, no zarr): it runs first in every process so that a
process that dies while importing torch or loading weights has already written its log header and
armed faulthandler. The earlier pipeline this project replaces died without a single log line.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
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


def require_kind(path, option: str, folder: bool, what: str) -> None:
    """A local path given where a folder (`folder=True`) or a file is expected, but that is the
    other kind, refused in one line naming the option and the path (`what`: what to give instead).
    A missing path or a URL passes: the caller's own checks name those."""
    if path is None or "://" in str(path):
        return
    p = Path(path)
    if folder and p.is_file():
        raise UserError(f"{option} {path}: a file, not a folder; give {what}")
    if not folder and p.is_dir():
        raise UserError(f"{option} {path}: a folder, not a file; give {what}")


def unwritable_folder(folder: str | os.PathLike) -> str | None:
    """Why nothing can be created in `folder` (or, when it does not exist yet, in its nearest
    existing parent), else None. It really creates and removes a file there: permission bits do
    not tell (root passes them; /proc, read-only mounts and full devices refuse anyway)."""
    import tempfile

    p = Path(folder).absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a folder"
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".dflash-probe-"):
            pass
    except OSError as e:
        return f"cannot create a file in {p}: {e.strerror or e}"
    return None


REPORT_FORMAT = "dflash-offline/eval-report"


def check_report_dest(path: str | os.PathLike | None, option: str = "--json") -> None:
    """A report file may be written only where its folder exists and takes files, and only over
    nothing or an earlier report of ours (a JSON object with our `format`, or an older report
    with its keys): someone else's file, e.g. a manifest or a model's config.json, is refused."""
    if path is None:
        return
    p = Path(path)
    if not p.parent.absolute().is_dir():
        raise UserError(f"{option} {path}: its folder {p.parent} does not exist; create it or choose another path")
    why = unwritable_folder(p.parent)
    if why:
        raise UserError(f"{option} {path}: {why}; choose another path")
    if p.exists():
        try:
            old = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = None
        ours = isinstance(old, dict) and (old.get("format") == REPORT_FORMAT
                                          or {"target", "device", "drafters"} <= old.keys())
        if not ours:
            raise UserError(f"{option} {path}: the file exists and is not an eval report; refusing to replace it "
                            "(nothing was changed): choose another path")


def refuse_foreign_folder(folder: str | os.PathLike, option: str, kind: str, marker: str, own: set[str],
                          own_prefixes: tuple[str, ...] = ()) -> None:
    """Nothing the tool did not create is written into: an existing, non-empty folder whose entries
    are not all names this stage makes (`own`, `own_prefixes`) is refused in one line, untouched; the
    caller checks first that the folder lacks `marker`, what only a folder of this kind holds."""
    try:
        names = [p.name for p in Path(folder).iterdir()]
    except OSError:  # missing, a file, unreadable: the caller's own checks say so
        return
    foreign = sorted(n for n in names if n not in own and not n.startswith(own_prefixes))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UserError(f"{option} {os.fspath(folder)}: the folder exists, is not empty and is not {kind} (no {marker}; "
                        f"it holds {shown}); choose a new or empty folder (nothing is overwritten)")


# --------------------------------------------------------------------------------------------
# Logs


def open_process_log(log_dir: str | os.PathLike, name: str, *, console: bool = True, claim: bool = False) -> Path:
    """Create `log_dir/name.log`, point the `dflash` logger at it and arm faulthandler on it.

    Call this before importing torch or touching model weights. The file is opened in append mode
    so a resumed run keeps the history of the interrupted one.

    The heartbeat `log_dir/name.heartbeat.json` is written at once when there is none yet, or with
    `claim` (a worker, started by a launcher that holds the run). Otherwise it is another run's
    (one running, or the finished run this command would resume): it stays as it is until this
    process calls `claim_heartbeat()`, once it holds the run (its lock taken, its preflight passed).
    A rerun that is refused, or a side process (eval beside an export), leaves it untouched.
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
    fh = _LogFileHandler(stream)
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
    if _heartbeat is not None and _heartbeat.data["pid"] == os.getpid() and _heartbeat.data["state"] == "running":
        # An earlier stage of this process (the demo: extract, then train) returned normally: a
        # failure or a stop would have been recorded. Left `running`, `status` would call it died.
        _heartbeat.finish("done")
    hb_path = log_dir / f"{name}{HEARTBEAT_SUFFIX}"
    _heartbeat = Heartbeat(hb_path, name, path, claimed=claim or not hb_path.exists())
    return path


class _LogFileHandler(logging.StreamHandler):
    """A log file whose device is full (or gone) drops lines instead of printing a "--- Logging
    error ---" traceback per line on the terminal: the run's own error message is the one to see."""

    def handleError(self, record) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handleError(record)


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

    def __init__(self, path: Path, name: str, log_path: Path, claimed: bool = True):
        self.path = path
        self.claimed = claimed  # False: the file is another run's until claim()
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

    def claim(self) -> None:
        if not self.claimed:
            self.claimed = True
            self.data["updated"] = time.time()
            self._write()

    def _write(self) -> None:
        import json

        self._last = time.time()
        if not self.claimed:
            return
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


def current_log() -> str | None:
    """This process's log file (None before open_process_log)."""
    return _heartbeat.data["log"] if _heartbeat is not None else None


def claim_heartbeat() -> None:
    """This process holds the run now (its lock taken, its preflight passed): its heartbeat
    replaces the one a previous run left (see open_process_log)."""
    if _heartbeat is not None:
        _heartbeat.claim()


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


@contextlib.contextmanager
def worker_outcome(on_error=None):
    """Around a stage worker process's work (extract worker, training rank): like
    reported_outcome, and a stop on request ends the process with 128 + the signal, a second
    signal (KeyboardInterrupt) with 130, each with its state in the heartbeat. An error goes to
    the log (with its traceback) and to `on_error(one line)` (the launcher's queue: the log and
    the heartbeat may sit on a full disk), and the process exits with 1, printing nothing."""
    try:
        yield
    except Stopped as e:
        log.info("%s", e)
        finish_heartbeat("stopped", str(e))
        raise SystemExit(e.exit_code) from None
    except KeyboardInterrupt:
        log.warning("interrupted: stopped at once, the unit in progress abandoned (it is not committed)")
        finish_heartbeat("interrupted", "stopped at once by a second signal")
        raise SystemExit(128 + signal.SIGINT) from None
    except Exception as e:
        record_failure(e)
        if on_error is not None:
            with contextlib.suppress(Exception):
                on_error(f"{type(e).__name__}: {e}".splitlines()[0][:1000])
        raise SystemExit(1) from None
    except BaseException as e:
        record_failure(e)
        raise
    finish_heartbeat("done")


def is_no_space(text: str) -> bool:
    """Whether an error line is a full device (ENOSPC, or the quota kind EDQUOT)."""
    import errno

    return any(f"[Errno {n}]" in text for n in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)))


class NoRoom(RuntimeError):
    """A write that found no room (a full device, a quota, a file-size limit) after its partial
    output was removed: the message says what is intact and how to go on."""


def no_room_reason(exc: BaseException) -> str | None:
    """Why a failed write found no room, in words, or None when the error says otherwise. Native
    writers (safetensors, torch.save) report it only in their message text."""
    import errno

    text = str(exc)
    for code, words, marks in ((errno.ENOSPC, "the device is full", ("No space left",)),
                               (getattr(errno, "EDQUOT", errno.ENOSPC), "the disk quota is reached", ("quota",)),
                               (errno.EFBIG, "a file-size limit was reached (ulimit -f)", ("File too large",))):
        if getattr(exc, "errno", None) == code or f"os error {code})" in text or any(m in text for m in marks):
            return words
    return None


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside nested dicts and lists (a checkpoint's weights, optimizer state)."""
    if hasattr(obj, "nbytes") and hasattr(obj, "dtype"):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def record_failure(exc: BaseException) -> None:
    """Write the error (with its traceback, unless it is bad input) into the log file only (the
    terminal gets the CLI's one line) and mark the heartbeat failed: what `status` shows."""
    if _file_handler is not None:
        bad_input = isinstance(exc, UserError)
        phase = _heartbeat.data["phase"] if _heartbeat is not None else "starting"
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0,
                                "refused: %s" if bad_input else "failed: %s (phase: %s)",
                                (exc,) if bad_input else (exc, phase),
                                None if bad_input else (type(exc), exc, exc.__traceback__))
        _file_handler.handle(record)
    finish_heartbeat("failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:500])


# --------------------------------------------------------------------------------------------
# Files for others to read, and numbers for people


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc), else by
    setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def ordinary_mode(*paths: str | os.PathLike) -> None:
    """Give files the mode a plain open() would (0644 under umask 022). Writers that go through
    a temporary file (safetensors) leave 0600, which a serving process of another user cannot read."""
    mode = 0o666 & ~umask()
    for path in paths:
        os.chmod(path, mode)


def human_count(n: float) -> str:
    """1234 -> "1.23K", 2.1e9 -> "2.10B": parameter and token counts in log lines."""
    for unit in ("", "K", "M", "B"):
        if abs(n) < (999.5 if unit == "" else 999.995):  # what rounds to 1000 takes the next unit
            return f"{n:.0f}" if unit == "" else f"{n:.2f}{unit}"
        n /= 1000
    return f"{n:.2f}T"


# --------------------------------------------------------------------------------------------
# Graceful stop: SIGTERM / SIGINT

# A process on its own (a launcher, a torchrun rank, a one-device run) takes SIGTERM and SIGINT.
# A second signal this soon after the first is the same request arriving twice (a terminal's
# Ctrl-C reaches every process of the group; torchrun forwards it as well); a later one stops at
# once. A launcher's workers ignore both: the launcher passes each request on as FORWARD_SIGNAL,
# which they count without any window (one: stop at the next safe point; two: stop now).
REPEAT_WINDOW_S = 2.0
FORWARD_SIGNAL = signal.SIGUSR2  # SIGUSR1 is faulthandler's
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, FORWARD_SIGNAL)
STOP_CODES = {128 + signal.SIGINT, 128 + signal.SIGTERM}  # exit codes of a process that stopped on request


class Stopped(Exception):
    """The run stopped on SIGTERM/SIGINT at a safe point, its complete work committed. The CLI
    prints the message (it says how to resume) and exits with 128 + the signal's number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class _StopRequest:
    """The first request asks the process's loop to stop at its next safe point (after the shard
    being written, after the training step); a later one stops at once (KeyboardInterrupt: nothing
    half-done is ever committed, so that is safe too, only less tidy); after that, nothing."""

    def __init__(self):
        self.signum: int | None = None
        self.at = 0.0
        self.abandoned = False
        self.forward = None  # launcher: called with the signal number, passes it on to the workers
        self.launched = False  # a launcher's worker: only FORWARD_SIGNAL counts, with no window

    def handler(self, signum, frame) -> None:
        # No heartbeat write here: the handler may interrupt one (they share a temporary file).
        if self.abandoned:
            return
        now = time.monotonic()
        name = "SIGTERM" if signum == FORWARD_SIGNAL else signal.Signals(signum).name  # what the launcher got
        if self.signum is None:
            self.signum, self.at = (signal.SIGTERM if signum == FORWARD_SIGNAL else signum), now
            if self.launched:
                log.info("stop requested by the launcher: stopping at the next safe point")
            else:
                log.warning("%s received: stopping at the next safe point (a second signal stops at once)", name)
            if self.forward is not None:
                self.forward(signum)
            return
        if not self.launched and now - self.at < REPEAT_WINDOW_S:
            return
        self.abandoned = True
        log.warning("second %s: stopping now; the unit in progress is abandoned",
                    "stop request" if self.launched else name)
        if self.forward is not None:
            self.forward(signum)
        raise KeyboardInterrupt


_stop = _StopRequest()


def install_stop_handlers(forward=None, launched: bool = False) -> None:
    """Route stop requests to the graceful stop (main thread only), then unblock the signals a
    launcher blocked around this process's start (see `spawning`). `forward(signum)`: a launcher
    passes each request on to its workers (forward_stop). `launched`: this process is such a
    worker: SIGTERM and SIGINT are ignored (the launcher decides), FORWARD_SIGNAL counts."""
    _stop.forward, _stop.launched = forward, launched
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN if launched else _stop.handler)
    signal.signal(FORWARD_SIGNAL, _stop.handler if launched else signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def ignore_stop_signals() -> None:
    """Helper processes (shard writers, loader workers) are stopped by their owner, not by the
    terminal's Ctrl-C reaching the whole process group."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def spawning():
    """Around starting child processes: the stop signals are blocked, so a child inherits them
    blocked and receives a request only once its own handlers are set (a Ctrl-C during its
    start-up would otherwise kill it with a traceback). Requests for this process wait until the
    block ends, then arrive."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def stop_requested() -> int | None:
    """The signal number of a pending stop request, else None."""
    return _stop.signum


def request_stop(signum: int) -> None:
    """Record a stop request as if `signum` had arrived (a launcher whose worker was stopped alone)."""
    if _stop.signum is None:
        _stop.signum, _stop.at = signum, time.monotonic()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


# --------------------------------------------------------------------------------------------
# Devices and launch


@dataclass(frozen=True)
class Launch:
    """Who this process is: started by our own launcher, by torchrun, or alone."""

    rank: int
    world_size: int
    local_rank: int
    under_torchrun: bool


# What a torch.distributed launch puts in each rank's environment. torchrun (the elastic agent)
# also sets TORCHELASTIC_RUN_ID and GROUP_RANK: a shell never has them, so they tell a real launch
# from variables left over from an earlier one (`export RANK=0 WORLD_SIZE=2`), which would have a
# plain command do its share of the work and wait forever for ranks that never come.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK")
RENDEZVOUS_S = 120.0  # how long a rank of a launch other than torchrun waits for the others to join
RANK_WAIT_S = 1800.0  # how long rank 0 waits for the other ranks' commits without any progress
_UNSET = "unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT"


def _launch_env() -> str:
    return " ".join(f"{k}={os.environ[k]}" for k in LAUNCH_VARS if k in os.environ)


def torchrun_launch() -> Launch | None:
    """The rank layout torchrun (or another torch.distributed launcher) put in the environment, or
    None for a plain command. The variables count only when the launch really is distributed:
    torchrun's own markers are set, or WORLD_SIZE > 1 comes with all of RANK, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT (such a launch meets its ranks first, `join_ranks`); anything else
    (a stale RANK/WORLD_SIZE in the shell, values that do not fit) is refused in one line."""
    if not any(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None  # MASTER_ADDR/MASTER_PORT alone change nothing
    env = _launch_env()
    torchrun = all(k in os.environ for k in TORCHRUN_VARS)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        ok = 0 <= rank < world and 0 <= local <= rank
    except (KeyError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"the environment has {env}, which is not a consistent distributed launch; to run alone: "
                        f"{_UNSET} (left from an earlier torchrun?); to run distributed, start the command with "
                        "torchrun")
    if not torchrun and not (world > 1 and all(k in os.environ for k in LAUNCH_VARS)):
        raise UserError(f"the environment has {env} but this is not a torchrun launch (no {' or '.join(TORCHRUN_VARS)}"
                        f"); to run alone: {_UNSET} (left from an earlier torchrun?); to run distributed, start the "
                        "command with torchrun")
    return Launch(rank=rank, world_size=world, local_rank=local, under_torchrun=torchrun)


_rendezvous_store = None  # join_ranks' store: the training process group is built on it


def join_ranks(launch: Launch | None) -> None:
    """A launch other than torchrun (which meets its ranks before it starts them): every rank
    meets the others at MASTER_ADDR:MASTER_PORT before any work, at most
    DFLASH_OFFLINE_RENDEZVOUS_S seconds (default RENDEZVOUS_S), and says so in its log; ranks
    that do not come end the command in one line."""
    global _rendezvous_store
    if launch is None or launch.under_torchrun or launch.world_size == 1 or _rendezvous_store is not None:
        return
    timeout = float(os.environ.get("DFLASH_OFFLINE_RENDEZVOUS_S", RENDEZVOUS_S))
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    log.info("distributed launch without torchrun (%s): rank %d waits up to %.0fs for the other %d rank(s) at %s:%s",
             _launch_env(), launch.rank, timeout, launch.world_size - 1, addr, port)
    heartbeat(phase="waiting for the other ranks")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # a client's retries print C++ stacks otherwise
    import datetime

    import torch.distributed as dist

    t0 = time.time()
    try:
        _rendezvous_store = dist.TCPStore(addr, int(port), launch.world_size, launch.rank == 0,
                                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=True)
    except Exception as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"the environment has {_launch_env()}, but the other ranks did not join at {addr}:{port} "
                        f"within {time.time() - t0:.0f}s ({why}); to run alone: {_UNSET} (left from an earlier "
                        "torchrun?); to run distributed, start every rank (torchrun does)") from None
    log.info("all %d ranks joined in %.1fs", launch.world_size, time.time() - t0)


def rendezvous_store():
    """The store join_ranks met the other ranks on (None under torchrun, our launcher, or alone)."""
    return _rendezvous_store


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


def failed_process(procs, allow=()) -> int | None:
    """Index of the first process that exited with a non-zero code (other than those in `allow`), else None."""
    return next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0, *allow)), None)


def forward_stop(procs) -> None:
    """A launcher passes a stop request on to its worker processes (FORWARD_SIGNAL): each finishes
    its shard or step (the ranks agree on the step); a repeated request stops them at once."""
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, FORWARD_SIGNAL)
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


@dataclass
class WorkersEnded:
    """How a launcher's worker processes ended (run_workers)."""

    failed: int | None  # rank of the first worker that failed, else None
    error: str | None  # that worker's own one-line error, if it sent one
    exitcode: int | None  # that worker's exit code
    stopped: int | None  # the signal number when the run stopped on request, else None


def run_workers(entry, devices: list[str], job, stage: str, on_message) -> WorkersEnded:
    """Start one spawned process per device, `entry(rank, world, device, job, queue)`, and
    supervise them to the end: each message a worker puts on the queue goes to `on_message`
    (except ("error", rank, line), kept for the failure report); a stop request is passed on to
    every worker; a worker stopped on its own (kill -TERM PID) stops the others; after a failure
    the others are stopped (stop_processes)."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
    q = ctx.Queue()
    procs = []
    install_stop_handlers(forward=lambda signum: forward_stop(procs))
    with spawning():  # a request that comes meanwhile is forwarded once all are started
        for rank, dev in enumerate(devices):
            p = ctx.Process(target=entry, args=(rank, len(devices), dev, job, q), name=f"{stage}-rank{rank}")
            p.start()
            procs.append(p)
    log.info("started %d worker processes: %s", len(procs), ", ".join(f"{p.pid} on {d}" for p, d in zip(procs, devices)))
    heartbeat(phase=stage, workers=[p.pid for p in procs])
    failed = None
    errors: dict[int, str] = {}  # rank -> its error line (sent before it exits)

    def drain(timeout: float) -> bool:
        try:
            msg = q.get(timeout=timeout)
        except queue_mod.Empty:
            return False
        if msg[0] == "error":
            errors[msg[1]] = msg[2]
        else:
            on_message(msg)
        return True

    try:
        while True:
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
        while drain(0.2):  # the failed worker's own error line, sent just before it exited
            pass
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
                         "without a commit", _launch_env(), now_at, limit)
            seen, moved = now_at, time.time()
        if time.time() - moved > limit:
            raise RuntimeError(f"waited {time.time() - t0:.0f}s for the other ranks ({_launch_env()}), "
                               f"{time.time() - moved:.0f}s without a commit: {now_at}; if no other rank is "
                               f"running: {_UNSET} and run the same command again (it resumes)")
        heartbeat()
        if time.time() - last > 30:
            log.info("waiting for other ranks: %s (%.0fs)", now_at, time.time() - t0)
            last = time.time()
        time.sleep(0.5)


def single_thread_compute() -> None:
    """One compute thread per process: several worker processes share the machine's cores."""
    import torch

    torch.set_num_threads(int(os.environ.get("DFLASH_THREADS", "1")) or 1)


# --------------------------------------------------------------------------------------------
# Fault points for crash tests


_fault_counts: dict[tuple[str, str], int] = {}

# Environment variable -> what happens on the N-th arrival at the named point.
FAULT_VARS = {"DFLASH_OFFLINE_KILL_AT": "kill", "DFLASH_OFFLINE_RAISE_AT": "raise", "DFLASH_OFFLINE_STALL_AT": "stall",
              "DFLASH_OFFLINE_DELAY_AT": "delay", "DFLASH_OFFLINE_HOLD_AT": "hold"}


class InjectedFault(RuntimeError):
    """Raised by an armed fault point (DFLASH_OFFLINE_RAISE_AT): a stand-in for any crash."""


def fault_point(name: str) -> None:
    """Crash tests' hook at an exact point (mid-shard, between a shard's rename and its commit,
    after a training step...). On the N-th arrival at `name`:
      DFLASH_OFFLINE_KILL_AT=name:N   SIGKILL of the whole process group;
      DFLASH_OFFLINE_RAISE_AT=name:N  an InjectedFault exception (the error path: logs, status);
      DFLASH_OFFLINE_STALL_AT=name:N  sleep for an hour (a process caught mid-run, for `status`);
      DFLASH_OFFLINE_DELAY_AT=name:S  sleep S seconds at *every* arrival (a slow run);
      DFLASH_OFFLINE_HOLD_AT=name:N   wait there until a stop is requested (at most 10 minutes),
                                      heartbeat phase "held at name": a signal lands mid-shard
                                      or mid-step, deterministically.
    Unset, it costs five dict lookups.
    """
    for var, action in FAULT_VARS.items():
        spec = os.environ.get(var)
        if not spec:
            continue
        want, _, n = spec.partition(":")
        if want != name:
            continue
        if action == "delay":
            time.sleep(float(n))
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
        elif action == "hold":
            heartbeat(phase=f"held at {name}")
            t0 = time.monotonic()
            while stop_requested() is None and time.monotonic() - t0 < 600:
                time.sleep(0.05)
        else:
            heartbeat(phase=f"stalled at {name}")
            time.sleep(3600)
