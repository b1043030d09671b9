"""The output of `prepare`: OUT/train/ and OUT/eval/, each a part folder like `generate`'s (Parquet
parts, `manifest.json` as the commit point), with the chat settings and the counts recorded.

```
OUT/train/manifest.json   format dflash-offline/prepared, kind prompts | completions, chat settings,
                          counts (records read, dropped by reason), parts, totals
OUT/train/part-00000.parquet
OUT/eval/...              the same for the held-out conversations (--eval-fraction)
OUT/logs/prepare.log
```
"""

from __future__ import annotations

import time

from dflash_offline.cache.manifest import id_ranges
from dflash_offline.chat.formats import resolve_inputs
from dflash_offline.rows.parts import PREPARED_FORMAT, OutputStore, part_name, write_part
from dflash_offline.runtime.paths import file_sha256

__all__ = ["PreparedStore", "new_manifest", "part_name", "source_entry"]

VERSION = 1
IDENTITY_FIELDS = [
    ("target", "model_type"), ("target", "vocab_size"), ("target", "config_sha256"),
    ("chat", "template_sha256"), ("chat", "thinking"), ("chat", "system"),
    ("settings", "responses"), ("settings", "train_turns"), ("settings", "format"), ("settings", "eval_fraction"),
    ("settings", "max_len"), ("settings", "truncate"), ("settings", "dedup"), ("settings", "drop_unanswered"),
    ("settings", "max_records"),
    ("source", "rows"), ("source", "files"),
    ("plan", "chunk_records"), ("plan", "num_parts"), ("plan", "conversations"),
]


def new_manifest(kind: str, target: dict, chat: dict | None, settings: dict, source: dict, plan: dict,
                 counts: dict) -> dict:
    return {"format": PREPARED_FORMAT, "version": VERSION, "kind": kind, "status": "preparing", "target": target,
            "chat": chat, "settings": settings, "source": source, "plan": plan, "counts": counts, "parts": [],
            "totals": {k: 0 for k in PreparedStore.TOTALS},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def source_entry(paths: list[str]) -> dict:
    """The inputs as identity: each file's bytes (sha256), so a changed file is noticed on resume."""
    files = []
    for p in resolve_inputs(paths):
        if p.is_file():
            files.append({"path": str(p), "rows": 0, "sha256": file_sha256(p)})
        elif p.is_dir():  # a datasets folder: its Arrow files
            for f in sorted(p.rglob("*.arrow")):
                files.append({"path": str(f), "rows": 0, "sha256": file_sha256(f)})
        else:
            files.append({"path": str(p), "rows": 0, "sha256": "hub:" + str(p)})
    return {"files": files, "rows": len(files)}


class PreparedStore(OutputStore):
    FORMAT = PREPARED_FORMAT
    VERSION = VERSION
    FIELDS = IDENTITY_FIELDS
    HOW_TO_FIX = "write into a new --out, or run with the target, settings and data the output was made with"
    WHAT = "prepare output"
    TOTALS = ("rows", "tokens", "trained_tokens", "conversations", "truncated")

    def committed_names(self) -> set[str]:
        m = self.read() if self.folder.is_dir() else None
        return {p["name"] for p in m["parts"]} if m else set()

    def check(self, wanted: dict) -> None:
        """Refuse, before any work, an existing output made with other settings or inputs."""
        m = self.read() if self.folder.is_dir() else None
        if m is not None:
            self._refuser(wanted)(m)

    def write_and_commit(self, name: str, rows, conversations) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.remove_debris({name})
        file, nbytes = write_part(self.folder, name, rows.table)
        t = rows.table
        lengths = [len(x) for x in t.column("input_ids").to_pylist()]
        trained = sum(sum(x) for x in t.column("loss_mask").to_pylist()) if "loss_mask" in t.column_names else 0
        entry = {"name": name, "file": file, "rows": t.num_rows, "tokens": sum(lengths), "longest": max(lengths, default=0),
                 "trained_tokens": trained,
                 "conversations": rows.conversations, "truncated": rows.truncated, "dropped": dict(rows.dropped),
                 "bytes": nbytes, "sha256": file_sha256(self.folder / file),
                 "ids": id_ranges(sorted(t.column("id").to_pylist()))}
        self.commit_part(entry)


def dropped_text(dropped) -> str:
    """The drop counts as one text, conversations (records) apart from rows: a conversation
    dropped whole is counted by select.py (and by rows.py where the template refused it, or its
    one prompt is too long); rows.py counts the rows (turns) it dropped by reasons beginning with
    "rows "."""
    rows = [(n, why.removeprefix("rows ")) for why, n in dropped.most_common() if why.startswith("rows ")]
    convs = [(n, why) for why, n in dropped.most_common() if not why.startswith("rows ")]
    parts = []
    for what, group in (("conversation", convs), ("row", rows)):
        if group:
            total = sum(n for n, _ in group)
            parts.append(f"{total} {what}{'s' * (total != 1)} ({', '.join(f'{n} {why}' for n, why in group)})")
    return "; ".join(parts) or "none"
