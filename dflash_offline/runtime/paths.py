"""Checks on paths given by the user, before any work: file or folder, writable, ours to replace.

Nothing the tool did not create is ever overwritten: each destination is checked here first."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from dflash_offline.runtime.errors import UserError


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


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (inputs and parts are identified by content, not by path)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
