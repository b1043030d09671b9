"""Warm starts for `run_cli`: each CLI command is a real process of its own, forked from an
interpreter that has already imported torch and transformers.

On 2 CPU cores most of a test's CLI call is spent importing torch, transformers and the Qwen
modeling code (4-7 s per process) before a one-line refusal or a few milliseconds of work. A
zygote process (one per test process) imports those third-party libraries once, then, per call,
forks a child that does what `python -m dflash_offline ARGS` does: its own session (process
group), its own stdin/stdout/stderr pipes, working folder, environment and the test process's
umask, and `runpy` runs the package's `__main__` as `-m` does (sys.argv, sys.path[0],
`__main__.__spec__`, so spawned workers start as they do under `-m`). The child ends through the
interpreter's normal exit (atexit handlers, thread joins); the test sees its exit code, or the
signal that killed it, as Popen.returncode gives them. Its workers and ranks are spawned fresh
interpreters as always. The zygote never imports dflash_offline: every command imports the package
cold.

What a warm start does not exercise, and where that stays covered:
- importing torch and transformers at start-up: every test that starts the CLI with subprocess
  directly (graceful stop, the crash campaign, follow, torchrun launches, the file-size limit, the
  broken-torch import of test_failure_logs, ...) and every spawned worker or rank;
- a str hash seed of its own per process (the children of one zygote share the zygote's): the
  bit-exact comparisons between cold processes (crash campaign, graceful stop against
  straight_run, spawned workers and ranks).
Calls whose environment changes how the interpreter or those libraries start (PYTHONPATH, thread
counts: anything but DFLASH_*, PYTEST_* and the torch.distributed launch variables), or made while
the test process's resource limits differ from the zygote's, take the cold path.
DFLASH_TEST_COLD_CLI=1 runs every call cold.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Third-party modules the zygote imports before it forks. Not pyarrow: it starts a jemalloc
# background thread at import, and a process with threads is not forked here (the zygote reports
# its thread count; with more than one, e.g. an OpenMP pool under OMP_NUM_THREADS > 1, every call
# is cold).
PRELOAD = ("numpy", "click", "safetensors", "safetensors.torch", "torch", "torch.distributed", "transformers",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_5.modeling_qwen3_5", "zarr", "fsspec",
           "google_crc32c", "tqdm")

# Environment variables that may differ between the zygote and a call: read by dflash_offline at run
# time only (fault points, launch layout), never by the preloaded libraries at import; and pytest's
# own (PYTEST_CURRENT_TEST changes with every test).
_RUNTIME_PREFIXES = ("DFLASH_", "PYTEST_")
_RUNTIME_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


# ----------------------------------------------------------------------------------------------
# Zygote side (runs in its own interpreter: `python -c "...; _zygote.serve(path)"`)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(sock_path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    if any(m == "dflash_offline" or m.startswith("dflash_offline.") for m in sys.modules):
        raise SystemExit("the zygote must not import dflash_offline")
    # The preloaded objects live as long as the interpreter: keep them out of the cyclic collector,
    # so that a child's collections (and the one at its exit, 1 s otherwise) do not walk them.
    gc.freeze()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(64)
    sys.stdout.write(f"ready {_threads()}\n")
    sys.stdout.flush()
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)  # EOF: the test process is gone
    while True:
        ready = [key.fileobj for key, _ in sel.select()]
        _reap()
        if sys.stdin in ready:
            os._exit(0)
        conn, _ = srv.accept()
        if os.fork() == 0:
            sel.close()
            srv.close()
            _handle(conn)  # the handler ends with os._exit; the CLI child raises SystemExit from here
        conn.close()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _handle(conn: socket.socket) -> None:
    """In a fork of the zygote: fork the CLI process, tell its pid, wait for it, tell its exit code."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 2)
    body = json.loads(_recv_exact(conn, struct.unpack("!I", head)[0]))
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become_cli(body, fds)  # raises SystemExit (or any exception) to the interpreter's exit
        raise SystemExit(0)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def _become_cli(body: dict, fds: list[int]) -> None:
    """Turn this process into `python -m dflash_offline ARGS` (start_new_session=True, pipes for
    stdout and stderr, stdin from /dev/null)."""
    import runpy

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        os.close(fd)
    os.chdir(body["cwd"])
    os.umask(body["umask"])
    os.environ.clear()
    os.environ.update(body["env"])
    sys.path[0] = os.getcwd()  # as `-m` sets it
    sys.argv = ["-m", *body["args"]]
    runpy._run_module_as_main("dflash_offline", alter_argv=True)


# ----------------------------------------------------------------------------------------------
# Test side


class Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.rlimits = _rlimits()
        self.dir = tempfile.mkdtemp(prefix="dflash-zygote-")
        self.path = os.path.join(self.dir, "sock")
        tests = str(Path(__file__).resolve().parent)
        code = (f"import sys; sys.path.insert(0, {tests!r}); import _zygote; sys.path.remove({tests!r}); "
                f"_zygote.serve({self.path!r})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=self.env, cwd=self.dir, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline().split()
        self.ok = line[:1] == ["ready"] and line[1:] == ["1"]
        if not self.ok:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the zygote exits on EOF
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def fits(self, env: dict[str, str]) -> bool:
        """A call whose environment differs from the zygote's only in variables read at run time, from
        a process whose resource limits are the zygote's (a cold child would inherit them)."""
        keys = set(env) | set(self.env)
        return (all(env.get(k) == self.env.get(k) or k in _RUNTIME_VARS or k.startswith(_RUNTIME_PREFIXES) for k in keys)
                and _rlimits() == self.rlimits)

    def run(self, cmd: list[str], args: list[str], cwd, env: dict[str, str], timeout: float):
        """The finished command as subprocess.run(..., capture_output=True, text=True) returns it;
        None where the zygote could not start it (the caller then starts it cold)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            body = json.dumps({"args": args, "cwd": str(cwd), "env": env, "umask": _umask()}).encode()
            socket.send_fds(conn, [struct.pack("!I", len(body))], [out_w, err_w])
            conn.sendall(body)
            reader = conn.makefile("r")
            pid = int(reader.readline())  # the command runs from here on
        except (OSError, ValueError):
            self.ok = False
            for fd in (out_r, err_r):
                os.close(fd)
            conn.close()
            return None
        finally:
            os.close(out_w)
            os.close(err_w)
        deadline = time.monotonic() + timeout
        out, err = bytearray(), bytearray()
        sel = selectors.DefaultSelector()
        sel.register(out_r, selectors.EVENT_READ, out)
        sel.register(err_r, selectors.EVENT_READ, err)
        timed_out = False
        while sel.get_map():  # until both pipes reach EOF, as Popen.communicate
            left = deadline - time.monotonic()
            if left <= 0 and not timed_out:
                timed_out = True
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for key, _ in sel.select(timeout=max(left, 0.1) if not timed_out else 1.0):
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    key.data.extend(chunk)
                else:
                    sel.unregister(key.fd)
                    os.close(key.fd)
        code = int(reader.readline())
        reader.close()
        conn.close()
        stdout, stderr = _text(out), _text(err)
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _umask() -> int:
    """This process's umask (which a child inherits), read without changing it."""
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Umask:")), 8)


def _rlimits() -> dict[str, tuple[int, int]]:
    import resource

    return {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")}


def _text(data: bytes) -> str:
    """What Popen(text=True).communicate() returns for these bytes (locale encoding, universal newlines)."""
    import locale

    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


_LOCK = threading.Lock()
_ZYGOTE: Zygote | None = None
_TRIED = False


def get(env: dict[str, str]) -> Zygote | None:
    """The test process's zygote, started on first use with `env`; None where it cannot run."""
    global _ZYGOTE, _TRIED
    if (os.environ.get("DFLASH_TEST_COLD_CLI") or not hasattr(socket, "send_fds") or not hasattr(os, "fork")
            or not os.path.exists("/proc/self/status")):
        return None
    with _LOCK:
        if not _TRIED:
            _TRIED = True
            z = Zygote(env)
            _ZYGOTE = z if z.ok else None
            atexit.register(z.close)
        return _ZYGOTE if _ZYGOTE is not None and _ZYGOTE.ok else None


def close_all() -> None:
    """Stop this process's zygote now (the suite's end: before its temporary folder goes)."""
    if _ZYGOTE is not None:
        _ZYGOTE.close()
