"""A command's log before it holds its output: from the first second, yet nothing left behind by a
refusal.

A stage's launcher (and eval) logs from its first second, faulthandler armed, so that a process
that dies while importing torch or loading weights has its traceback somewhere. But a command
refused by its preflight (a mistyped --out, a cache from another target) must leave nothing at the
path it refused, not even a log folder. So the log starts in a private folder of the system's
temporary space (`$TMPDIR/dflash-offline-NAME-*/NAME.log`), and moves into its destination
(`OUT/logs/NAME.log`, appended to what earlier runs wrote there) once the process holds its run:
`logs.claim_heartbeat()`, called after the preflight passed and the run lock is taken (or, at the
latest, by the CLI once the command succeeded). The heartbeat waits in memory until then too.
This module opens it; runtime/logs.py keeps it and moves it.

Before that point:
- a refusal, a stop or an interruption: the early log is deleted at exit; the destination is
  exactly as it was (a folder the user made keeps its contents; no parent folder is created);
- a crash (any other exception): the early log is kept, and the CLI's error line names it
  (`logs.keep_early_log`);
- a crash that kills the interpreter (SIGSEGV, SIGKILL): the early log stays in the temporary
  space, faulthandler's traceback in it (docs/troubleshooting.md says where to look).
The temporary space, not a folder beside the output: it exists whatever the user typed, a
read-only or missing parent of --out still gets its one line, and a kill leaves no debris at --out.
Worker processes start after the run is held: they log straight into OUT/logs.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from dflash_offline.runtime import logs
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.faults import fault_point


def open_launcher_log(log_dir: str | os.PathLike, name: str) -> Path:
    """Open this process's log early (see the module's docstring); returns the path it will have,
    `log_dir/name.log`. `log_dir` is checked now, before the preflight: a location that cannot hold
    it raises OSError (as logs.open_process_log does), for the caller's one line. Without a usable
    temporary space the log starts at its destination: the log from the first second comes first."""
    log_dir = Path(log_dir)
    _check_can_hold(log_dir)
    try:
        folder = Path(tempfile.mkdtemp(prefix=f"dflash-offline-{name}-"))
    except OSError:
        return logs.open_process_log(log_dir, name)
    logs.open_early_log(folder, log_dir, name)
    fault_point("launcher-log-opened")  # crash tests: a command that dies before its preflight ends
    return log_dir / f"{name}.log"


def open_command_log(log_dir_option: str | None, log_dir: str, name: str, out: str,
                     options: tuple[str, str] = ("--log-dir", "--out")) -> Path:
    """The launcher log of a command that writes into --out (generate, prepare): a folder that
    cannot be written is one line naming --log-dir when it was given, else --out (`options`: how
    the two are named, the flags or the recipe keys and file)."""
    try:
        return open_launcher_log(log_dir, name)
    except OSError as e:
        if refusal := logs.log_dir_refusal(log_dir_option, e, options[0]):
            raise refusal from None
        raise UserError(f"{options[1]} {out}: cannot write its log folder {log_dir} ({e.strerror or e}); choose a "
                        "writable location (or --log-dir)") from None


def _check_can_hold(log_dir: Path) -> None:
    """OSError (errno, strerror, path) when `log_dir` cannot be made or written: its nearest existing
    folder is not one, or takes no file. Probed with an unnamed file (O_TMPFILE where the file
    system has it): no name appears there, even for a moment."""
    p = log_dir.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(p))
    with tempfile.TemporaryFile(dir=p, prefix=".dflash-probe-"):
        pass
