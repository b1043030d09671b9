"""Errors a user can act on: the one-line UserError, and a full device named as such."""

from __future__ import annotations

import errno


class UserError(Exception):
    """Bad input or configuration: the CLI prints the message as one line and exits with 2."""


class NoRoom(RuntimeError):
    """A write that found no room (a full device, a quota, a file-size limit) after its partial
    output was removed: the message says what is intact and how to go on."""


def no_room_reason(err: BaseException | str) -> str | None:
    """Why a failed write found no room (a full device, a quota, a file-size limit), in words, or
    None when the error says otherwise. `err` is the exception, or its one-line text as a worker
    process reports it to its launcher. Native writers (safetensors, torch.save) report it only in
    their message text."""
    text = str(err)
    for code, words, marks in ((errno.ENOSPC, "the device is full", ("No space left",)),
                               (getattr(errno, "EDQUOT", errno.ENOSPC), "the disk quota is reached", ("quota",)),
                               (errno.EFBIG, "a file-size limit was reached (ulimit -f)", ("File too large",))):
        if (getattr(err, "errno", None) == code or f"[Errno {code}]" in text or f"os error {code})" in text
                or any(m in text for m in marks)):
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
