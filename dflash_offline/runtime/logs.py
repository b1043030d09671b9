"""Log files from the first second, faulthandler, and the heartbeat file that `status` reads.

This module imports nothing heavy (no torch, no zarr): it runs first in every process so that a
process that dies while importing torch or loading weights has already written its log header and
armed faulthandler. The earlier pipeline this project replaces died without a single log line."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import gc
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.signals import Stopped


LOG_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"

log = logging.getLogger("dflash")


# --------------------------------------------------------------------------------------------
# Logs


def log_dir_refusal(log_dir_option: str | None, e: OSError, option: str = "--log-dir") -> UserError | None:
    """The one line for a `--log-dir` folder that cannot hold a log; None when no --log-dir was
    given (the caller names its own default folder). `option`: how the message names it (the
    flag, or the recipe key and file)."""
    if not log_dir_option:
        return None
    return UserError(f"{option} {log_dir_option}: cannot write the log folder there ({e.strerror or e}); choose a "
                     "writable folder")


def open_process_log(log_dir: str | os.PathLike, name: str, *, console: bool = True, claim: bool = False) -> Path:
    """Create `log_dir/name.log`, point the `dflash` logger at it and arm faulthandler on it.

    Call this before importing torch or touching model weights. The file is opened in append mode
    so a resumed run keeps the history of the interrupted one.

    The heartbeat `log_dir/name.heartbeat.json` is written at once when there is none yet, or with
    `claim` (a worker, started by a launcher that holds the run). Otherwise it is another run's
    (one running, or the finished run this command would resume): it stays as it is until this
    process calls `claim_heartbeat()`, once it holds the run (its lock taken, its preflight passed).
    Workers open their logs here; a command's own process opens its log with
    `early_log.open_launcher_log`, which writes nothing at `log_dir` until then.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{name}.log"
    _start_log(path, name, console)
    hb_path = log_dir / f"{name}{HEARTBEAT_SUFFIX}"
    _new_heartbeat(hb_path, name, path, claimed=claim or not hb_path.exists())
    return path


@dataclasses.dataclass
class _EarlyLog:
    """A launcher's log before its process holds the run (runtime/early_log.py)."""

    folder: Path  # the private temporary folder holding it
    log_dir: Path  # where it goes once the run is held
    name: str
    pid: int  # a forked child inherits this state, but the log is not its own
    keep: bool = False  # an error line names it: left in place at exit


_early: _EarlyLog | None = None


def open_early_log(folder: Path, log_dir: Path, name: str) -> None:
    """This process's log in the private folder `folder` until it holds its run: then
    claim_heartbeat moves it to `log_dir/name.log` and writes its heartbeat there. Deleted at exit
    unless an error line names it (keep_early_log). The scheme: runtime/early_log.py."""
    global _early
    _early = _EarlyLog(folder, log_dir, name, os.getpid())
    atexit.unregister(_drop_early_log)
    atexit.register(_drop_early_log)
    path = folder / f"{name}.log"
    _start_log(path, name, True)
    _new_heartbeat(log_dir / f"{name}{HEARTBEAT_SUFFIX}", name, path, claimed=False)


def _start_log(path: Path, name: str, console: bool) -> None:
    """Open `path` (appending), make it the `dflash` logger's file and faulthandler's, and write the
    header line."""
    # Line-buffered: a SIGKILL loses at most the line being written.
    stream = open(path, "a", buffering=1, encoding="utf-8")
    _arm_faulthandler(stream)
    # The interpreter's last garbage collection walks every object torch and transformers made
    # (over a second per process, each worker, writer and rank); nothing of ours needs it (files,
    # caches and processes are closed explicitly), so the objects are frozen out of it. (Once per
    # process, however many logs it opens.)
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
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
        ch = _ConsoleHandler(sys.stderr)
        ch.setLevel(logging.WARNING)
        ch.setFormatter(_ConsoleFormatter("%(levelname)s: %(message)s"))
        root.addHandler(ch)
    root.propagate = False
    root.info(
        "---- %s started: pid %d on %s, python %s, argv %s",
        name, os.getpid(), socket.gethostname(), sys.version.split()[0], " ".join(sys.argv),
    )


class _ConsoleHandler(logging.StreamHandler):
    """The terminal's handler: a line written while a progress bar is drawn goes through tqdm, which
    clears the bar, prints the line on its own and draws the bar again (a Ctrl-C's warning was
    glued to the bar's line)."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        if tqdm is None or not getattr(tqdm.tqdm, "_instances", None):
            return super().emit(record)
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:  # as logging does: a console that cannot be written stops nothing
            self.handleError(record)


class _ConsoleFormatter(logging.Formatter):
    """The terminal's lines: `warning: ...` and `error: ...` in lower case, as the command line's own
    refusals (`error: ...`) are written, so one run never shows two spellings of one level. The
    log file keeps logging's upper-case level names."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        lower = logging.makeLogRecord({**record.__dict__, "levelname": record.levelname.lower()})
        return super().formatMessage(lower)


def _arm_faulthandler(stream) -> None:
    # faulthandler writes tracebacks of all threads on SIGSEGV/SIGFPE/SIGABRT/SIGBUS/SIGILL, and
    # on SIGUSR1 on demand (`kill -USR1 PID` shows where a hung process is).
    faulthandler.enable(file=stream, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True, chain=False)


def _new_heartbeat(hb_path: Path, name: str, log_path: Path, claimed: bool) -> None:
    global _heartbeat
    if _heartbeat is not None and _heartbeat.data["pid"] == os.getpid() and _heartbeat.data["state"] == "running":
        # An earlier stage of this process (the demo: extract, then train) returned normally: a
        # failure or a stop would have been recorded. Left `running`, `status` would call it died.
        _heartbeat.finish("done")
    _heartbeat = Heartbeat(hb_path, name, log_path, claimed=claimed)


def _move_early_log() -> None:
    """The process holds its run: its early log goes on in its destination, appended to what earlier
    runs wrote there, faulthandler too. An OSError (the folder became unwritable since it was
    checked) leaves the early log where it is and goes on to the caller: the CLI's line names it."""
    global _early
    early = _early
    if early is None or early.pid != os.getpid():
        return
    early.log_dir.mkdir(parents=True, exist_ok=True)
    dest = early.log_dir / f"{early.name}.log"
    stream = open(dest, "a", buffering=1, encoding="utf-8")
    fh = _file_handler
    fh.acquire()  # no line lands between the copy and the switch
    try:
        fh.flush()
        with open(early.folder / f"{early.name}.log", encoding="utf-8", errors="replace") as f:
            shutil.copyfileobj(f, stream)
        old = fh.setStream(stream)
        _arm_faulthandler(stream)
    except BaseException:
        stream.close()
        raise
    finally:
        fh.release()
    _early = None
    old.close()
    shutil.rmtree(early.folder, ignore_errors=True)
    _heartbeat.data["log"] = str(dest)


def keep_early_log() -> str | None:
    """The early log's path when this process's log has not reached its destination (a crash
    before its preflight passed), kept at exit for the error line that names it; else None."""
    if not in_early_log():
        return None
    _early.keep = True
    return str(_early.folder / f"{_early.name}.log")


def in_early_log() -> bool:
    """Whether this process's log is still the early one (its preflight has not passed): a
    refusal then leaves nothing behind."""
    return _early is not None and _early.pid == os.getpid()


def _drop_early_log() -> None:
    """At exit: an early log that no error line names (a refusal, a stop) is deleted."""
    early = _early
    if early is not None and early.pid == os.getpid() and not early.keep:
        shutil.rmtree(early.folder, ignore_errors=True)  # the open file goes with it


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
        # A process that finished its work is in no phase any more: its last one (held-out
        # evaluation, extract) would read as still under way. A failed or stopped one keeps the
        # phase it ended in: that is where to look.
        phase = "done" if state == "done" else self.data["phase"]
        self.data.update(state=state, phase=phase, updated=time.time(), error=error)
        self._write()

    def claim(self) -> None:
        if not self.claimed:
            self.claimed = True
            self.data["updated"] = time.time()
            self._write()

    def _write(self) -> None:

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
    """This process holds the run now (its lock taken, its preflight passed): its early log moves
    into its destination (see open_launcher_log) and its heartbeat replaces the one a previous run
    left (see open_process_log)."""
    _move_early_log()
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


# ----------------------------------------------------------------------------------------------
# Reading heartbeats (status, and train --follow waiting on extraction)

STALE_S = 120.0  # a live process whose heartbeat is older than this is reported as not advancing


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process whose parent died first can linger as a zombie: not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return True


def processes(log_dir: Path, now: float | None = None, stage: str = "") -> list[dict]:
    """One entry per heartbeat file of the stage's processes (names starting with `stage`: an
    `eval` of a run's export logs beside the run, and is not the run): name, pid, state (running /
    done / failed / stopped / interrupted / died / stale), phase, progress fields, age of the last
    beat, error, log path."""
    now = time.time() if now is None else now
    host = socket.gethostname()
    out = []
    for f in sorted(log_dir.glob(f"{stage}*{HEARTBEAT_SUFFIX}")):
        try:
            hb = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # being replaced right now, or damaged: the log still tells
        age = now - float(hb.get("updated", 0))
        state = hb.get("state", "running")
        if state == "running":
            if hb.get("host") == host and not pid_alive(int(hb["pid"])):
                state = "died"
            elif age > STALE_S:
                state = "stale"
        elif state == "done":  # a heartbeat written before finish() set it names the last phase of the work
            hb["phase"] = "done"
        out.append({**hb, "state": state, "age_s": age})
    return out


# --------------------------------------------------------------------------------------------
# Reading a folder's logs back (status)


def _log_time(stamp: str) -> float:
    """Seconds since the epoch of a log line's time (`2025-01-31 12:00:00,123`, local time)."""
    t = time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S"))
    return t + (int(stamp[20:23]) / 1000 if stamp[20:23].isdigit() else 0.0)


def _superseded(error: dict, beats: list[dict]) -> bool:
    """An error that a later run of the same output made moot: a process of the stage that started
    after it and finished its work (its own process name again, or a launcher: the whole command
    succeeded). A command refused before it held the run wrote nothing there (early_log.py):
    a success before it stays the last word."""
    try:
        when = _log_time(error["time"])
    except ValueError:
        return False
    name = Path(error["log"]).name[:-len(".log")]
    return any(b.get("state") == "done" and isinstance(b.get("started"), (int, float)) and b["started"] > when
               and (b.get("name") == name or str(b.get("name", "")).endswith("launcher")) for b in beats)


def last_error(log_dir: Path, stage: str = "") -> dict | None:
    """The newest error line (and the exception line of its traceback) in the stage's process logs
    (names starting with `stage`). A launcher's "worker N exited" is only the echo of a worker's
    own error: the worker's is shown. An error that a later, successful run superseded
    (`_superseded`) is not one any more."""
    found = []
    beats = processes(log_dir, stage=stage)
    for f in sorted(log_dir.glob(f"{stage}*.log")):
        try:
            lines = f.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for i in range(len(lines) - 1, -1, -1):
            if " ERROR " in lines[i] or lines[i].startswith("Fatal Python error"):
                when = lines[i][:23]
                detail = lines[i].split("] ", 1)[-1]
                # A traceback follows the ERROR line; its last line names the exception.
                tail = [ln for ln in lines[i + 1:i + 200] if ln and not ln.startswith((" ", "Traceback", "20"))]
                if tail:
                    detail = tail[-1] if detail.startswith("failed:") else detail
                if not _superseded({"time": when, "log": str(f)}, beats):
                    found.append({"time": when, "log": str(f), "error": detail})
                break
    if not found:
        return None
    newest = max(found, key=lambda e: e["time"])
    if newest["log"].endswith("launcher.log"):
        # The launcher's failure echoes a worker's: show the worker's own, if it is from this run.
        def seconds(e):
            try:
                return _log_time(e["time"])
            except ValueError:  # a line that is not ours (Fatal Python error ...): no time to compare
                return float("-inf")

        causes = [e for e in found if not e["log"].endswith("launcher.log")
                  and 0 <= seconds(newest) - seconds(e) < 60]
        if causes:
            return max(causes, key=lambda e: e["time"])
    return newest
