"""What a run folder (--out) holds besides its checkpoints: the names train writes there, the check
that a folder is a run's before anything is written into it, and the truncation of its JSON-lines
logs on resume (the steps after the resumed checkpoint run again)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.paths import refuse_foreign_folder
from dflash_offline.runs.checkpoint import CHECKPOINT_PREFIX, list_checkpoints

EXPORT = "export"
BEST = "best"
HELD_OUT_LOG = "heldout.jsonl"
CONSUMED = "consumed.jsonl"  # --follow: the windows trained

# What a run folder holds before its first checkpoint (a refused, failed or killed first run): anything
# else there was not made by train, and is never written into.
RUN_OWN_ENTRIES = {"logs", ".run.lock", "metrics.jsonl", "heldout.jsonl", "consumed.jsonl", "tensorboard", "profile",
                   EXPORT, "best", "best.json", "best.json.tmp"}


def is_run_folder(p: Path) -> bool:
    """A folder `train` made: its metrics, a checkpoint, or a training process's log."""
    return p.is_dir() and ((p / "metrics.jsonl").exists() or any(p.glob(f"{CHECKPOINT_PREFIX}*"))
                           or any((p / "logs").glob("train-*")))


def refuse_foreign_run(out: Path, option: str = "--out") -> None:
    """--out is a run folder (it holds a checkpoint), or holds nothing but what a first run makes
    (`option`: how messages name it, the flag or the recipe key and file)."""
    if not list_checkpoints(out):
        refuse_foreign_folder(out, option, "a training run", "step-N/ checkpoint", RUN_OWN_ENTRIES,
                              (".tmp-", f".{EXPORT}.", f".{BEST}."))
        # Names this stage makes are ours only if they hold what it writes: a run truncates its
        # metrics on a restart, which would rewrite someone else's file of that name.
        for name in ("metrics.jsonl", HELD_OUT_LOG):
            if (out / name).is_file() and not _our_jsonl(out / name):
                raise UserError(f"{option} {out}: its {name} was not written by `train` (not a file of JSON lines "
                                "with a step); choose a new or empty folder (nothing was changed)")


def _our_jsonl(path: Path) -> bool:
    """A file of JSON objects with a `step` each (a last line cut by a kill aside), or empty (a run
    killed before its first step). A lone line that is no record is not a cut one: it is someone's."""
    try:
        lines = [ln for ln in path.read_bytes().split(b"\n") if ln.strip(b" \t\r\0")]
    except OSError:
        return False
    records = 0
    for k, ln in enumerate(lines):
        try:
            rec = json.loads(ln)
        except ValueError:
            if k == len(lines) - 1 and k > 0:
                continue
            return False
        if not isinstance(rec, dict) or "step" not in rec:
            return False
        records += 1
    return records > 0 or not lines


def truncate_jsonl(path: Path, keep) -> None:
    """Keep the records `keep(record)` accepts (rewritten under a temporary name, then renamed)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = []
    for ln in lines:
        try:
            if keep(json.loads(ln)):
                kept.append(ln)
        except json.JSONDecodeError:  # a line cut by a kill
            pass
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records past the checkpoint we resume from: those steps run again."""
    truncate_jsonl(path, lambda r: r["step"] <= step)

