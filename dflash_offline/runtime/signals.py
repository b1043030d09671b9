"""Stop requests: the first SIGINT/SIGTERM stops at the next unit boundary, a second one at once."""

from __future__ import annotations

import contextlib
import logging
import signal
import time

log = logging.getLogger("dflash")


# --------------------------------------------------------------------------------------------
# Graceful stop: SIGTERM / SIGINT

# A process on its own (a launcher, a torchrun rank, a one-device run) takes SIGTERM and SIGINT.
# A second signal this soon after the first is the same request arriving twice (a terminal's
# Ctrl-C reaches every process of the group; torchrun forwards it as well); a later one stops at
# once. A launcher's workers ignore both: the launcher passes each request on as the forward
# signal of the one it got, which they count without any window (one: stop at the next safe point;
# two: stop now). One forward signal per stop signal, so that a worker's log, exit code and
# heartbeat name the signal its launcher got.
REPEAT_WINDOW_S = 2.0
FORWARD_SIGNALS = {signal.SIGTERM: signal.SIGUSR2,  # SIGUSR1 is faulthandler's
                   signal.SIGINT: signal.SIGRTMIN + 2}  # a real-time signal nothing else here uses
_FORWARDED = {fwd: sig for sig, fwd in FORWARD_SIGNALS.items()}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, *FORWARD_SIGNALS.values())
STOP_CODES = {128 + signal.SIGINT, 128 + signal.SIGTERM}  # exit codes of a process that stopped on request


class Stopped(Exception):
    """The run stopped on SIGTERM/SIGINT at a safe point, its complete work committed. The CLI
    prints the message (it says how to resume) and exits with 128 + the signal's number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class StopNow(Exception):
    """Raised inside a long unit of work (a decoding loop) when a stop is requested: the unit is
    abandoned, nothing of it committed, and its caller stops at once (it is done anew on resume)."""


def check_stop() -> None:
    """Raise StopNow when a stop was requested: a loop's cheap check (one global read)."""
    if _stop.signum is not None:
        raise StopNow(signal.Signals(_stop.signum).name)


class _StopRequest:
    """The first request asks the process's loop to stop at its next safe point (extract: the next
    batch, dropping the shard in progress; generate: the next decoding step, dropping the part in
    progress; train: after the training step); a later one stops at once (KeyboardInterrupt: nothing
    half-done is ever committed, so that is safe too, only less tidy); after that, nothing."""

    def __init__(self):
        self.signum: int | None = None
        self.at = 0.0
        self.abandoned = False
        self.forward = None  # launcher: called with the signal number, passes it on to the workers
        self.launched = False  # a launcher's worker: only FORWARD_SIGNAL counts, with no window
        # What "the next safe point" is for this command, and what a second signal costs: said when
        # the first one arrives (install_stop_handlers' `safe_point`).
        self.safe_point = "the next safe point"

    def handler(self, signum, frame) -> None:
        # No heartbeat write here: the handler may interrupt one (they share a temporary file).
        if self.abandoned:
            return
        now = time.monotonic()
        signum = _FORWARDED.get(signum, signum)  # what the launcher got
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum, self.at = signum, now
            if self.launched:
                log.info("stop requested by the launcher: stopping at the next safe point")
            else:
                log.warning("%s received: stopping at %s; a second %s stops at once, losing what is in progress but "
                            "nothing committed", name, self.safe_point, name)
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


def install_stop_handlers(forward=None, launched: bool = False, safe_point: str | None = None) -> None:
    """Route stop requests to the graceful stop (main thread only), then unblock the signals a
    launcher blocked around this process's start (see `spawning`). `forward(signum)`: a launcher
    passes each request on to its workers (forward_stop). `launched`: this process is such a
    worker: SIGTERM and SIGINT are ignored (the launcher decides), the forward signals count.
    `safe_point`: where this command stops, in words ("the next batch (seconds) ..."), for the
    first request's warning."""
    _stop.forward, _stop.launched = forward, launched
    if safe_point is not None:
        _stop.safe_point = safe_point
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN if launched else _stop.handler)
    for s in FORWARD_SIGNALS.values():
        signal.signal(s, _stop.handler if launched else signal.SIG_IGN)
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
