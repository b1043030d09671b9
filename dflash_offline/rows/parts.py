"""The output folder of `dflash-offline generate`: Parquet parts and the manifest that commits them.

```
OUT/
  manifest.json        the commit point: a part exists only once listed here
  part-00000.parquet   chunk 0 of the prompts, in the input contract (id, input_ids, loss_mask, ...)
  part-00003.held-N.parquet  N finished rows of a part a stop found in progress (generate/held.py)
  logs/                one log file (and heartbeat) per process
```
A part is written under a temporary name, flushed, renamed into place, and only then listed in
the manifest (read-modify-replace under a lock, like the cache's). A part file the manifest does
not list is debris of a killed run: resume deletes it and writes the chunk again. `extract --data
OUT` reads the listed parts, and refuses the folder until the manifest says `complete`.

No torch here: `data.resolve_files` reads this module before any model is loaded.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from dflash_offline.cache.location import Location, fsync_dir
from dflash_offline.cache.manifest import check_compatible, create_or_check, replace_unbound
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.paths import file_sha256

log = logging.getLogger("dflash.generate")

FORMAT = "dflash-offline/generated"
VERSION = 1
MANIFEST = "manifest.json"
# The output of `prepare` (prepare/output.py) is a part folder of the same shape: prompts for
# generate (kind "prompts") or completions for extract (kind "completions").
PREPARED_FORMAT = "dflash-offline/prepared"

# A run that differs in any of these would write other rows: the first that differs is named.
IDENTITY_FIELDS = [
    ("target", "model_type"), ("target", "vocab_size"), ("target", "config_sha256"),
    ("target", "weights_fingerprint"),
    ("settings", "max_new_tokens"), ("settings", "temperature"), ("settings", "top_p"), ("settings", "seed"),
    ("settings", "eos_token_ids"), ("settings", "compute_dtype"), ("settings", "turns"), ("settings", "reasoning"),
    ("settings", "samples_per_prompt"),
    ("chat", "template_sha256"), ("chat", "thinking"), ("chat", "system"),
    ("source", "rows"), ("source", "files"),
    ("plan", "chunk_prompts"), ("plan", "num_parts"),
]
HOW_TO_FIX = "write into a new --out, or run with the target and settings the output was made with"


def part_name(j: int) -> str:
    return f"part-{j:05d}"


def parts_folder(path: str | Path) -> Path:
    """The folder of a generate output's parts and manifest: `path` itself, or for a merged
    `x.parquet` (generate --out x.parquet) its `x.parquet.parts/` beside it."""
    p = Path(path)
    return p.with_name(p.name + ".parts") if p.suffix == ".parquet" else p


def read_manifest(folder: str | Path) -> dict | None:
    """The output manifest of a generate folder; None when the folder holds no manifest of ours."""
    path = Path(folder) / MANIFEST
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable ({e}); restore it from a copy, or generate into a new --out") from None
    return m if isinstance(m, dict) and m.get("format") in (FORMAT, PREPARED_FORMAT) else None


def listed_parts(folder: str | Path) -> list[Path] | None:
    """The part files of a complete generate or prepare folder, in plan order; None if the folder
    is not one. Refuses a folder whose writing has not finished (its rows would be missing)."""
    m = read_manifest(folder)
    if m is None:
        return None
    if m["status"] != "complete":
        cmd, what = ("prepare", "preparation") if m.get("format") == PREPARED_FORMAT else ("generate", "generation")
        raise UserError(f"{folder}: {what} not complete ({len(m['parts'])}/{m['plan']['num_parts']} parts); "
                        f"run the same `dflash-offline {cmd}` command again to finish it")
    return [Path(folder) / p["file"] for p in m["parts"]]


def check_part_folders(paths, option: str) -> None:
    """Refuses generate and prepare folders among `paths` whose committed parts are gone or changed
    size (committed data never changes), before they are read: one line with the way out."""
    for folder in paths:
        m = read_manifest(folder) if Path(folder).is_dir() else None
        damaged = damaged_parts(folder, m) if m is not None else []
        if damaged:
            more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
            raise UserError(f"{option} {folder}: {damaged[0]}{more}; {damaged_fix(m)}")


def damaged_fix(m: dict | None) -> str:
    """The way out of a part folder whose committed parts are damaged (`m`: its manifest)."""
    cmd = "prepare" if (m or {}).get("format") == PREPARED_FORMAT else "generate"
    return f"the folder is damaged: restore the part from a copy, or run `dflash-offline {cmd}` again into a new --out"


def damaged_parts(folder: str | Path, m: dict) -> list[str]:
    """The committed parts of a part folder whose file is missing or not the size its manifest
    recorded (a stat each: cheap), each as a phrase."""
    out = []
    for p in m.get("parts") or []:
        f = Path(folder) / p["file"]
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            out.append(f"committed part {p['file']} is missing")
            continue
        if isinstance(p.get("bytes"), int) and size != p["bytes"]:
            out.append(f"committed part {p['file']} is {size} bytes, its manifest recorded {p['bytes']}")
    return out


def held_rows(m: dict) -> int:
    """Rows a stop kept of the parts then in progress (the manifest's `held`: generate/held.py)."""
    return sum(e["rows"] for e in (m.get("held") or {}).values())


def chat_settings_of(paths) -> dict | None:
    """The chat settings recorded by `prepare` (and carried by `generate`) in the manifests of the
    part folders among `paths`: None when none records any. Folders that disagree are refused:
    one cache, one way of rendering."""
    found = {}
    for p in paths:
        m = read_manifest(p) if Path(p).is_dir() else None
        if m is not None and m.get("chat"):
            found[str(p)] = m["chat"]
    values = list(found.values())
    if any(v != values[0] for v in values[1:]):
        a, b = list(found)[:2]
        raise UserError(f"{a} and {b} were rendered with different chat settings (template, thinking or system "
                        "prompt): give inputs prepared one way")
    return values[0] if values else None


def check_part_hashes(source, option: str) -> None:
    """The parts of generate and prepare folders among the scanned input are the files their
    manifests committed: each file's sha256 (the scan computed it) against the manifest's record."""
    recorded = {}
    for folder in {f.path.parent for f in source.files}:
        m = read_manifest(folder)
        for p in (m or {}).get("parts") or []:
            if isinstance(p.get("sha256"), str):
                recorded[Path(folder) / p["file"]] = p["sha256"]
    for f in source.files:
        want = recorded.get(Path(f.path))
        if want is not None and f.sha256 != want:
            raise UserError(f"{option} {f.path}: not the part its folder's manifest.json committed (its sha256 "
                            "differs): committed data never changes; restore the part from a copy, or make the "
                            "folder again into a new --out")


def check_made_for(paths, info, option: str, target_option: str) -> None:
    """Refuses `generate` folders among `paths` whose completions another model wrote (their
    weights differ from `info`, read_target's): a drafter trained on them learns that model's text,
    not this target's. Parquet files given directly are not checked: that is how another model's
    text is used on purpose. (A `prepare` folder records the target whose tokenizer rendered it; a
    sibling model with the same tokenizer reads it as well, so it is not refused.)"""
    for p in paths:
        m = read_manifest(p) if Path(p).is_dir() else None
        if m is None or m.get("format") != FORMAT:
            continue
        made = m.get("target") or {}
        if made.get("weights_fingerprint") not in (None, info.weights_fingerprint):
            raise UserError(f"{option} {p} holds completions another model wrote ({made.get('path')}: its weights differ "
                            f"from {target_option} {info.path}): a drafter trained on them learns that model's text; "
                            f"generate them with this target, or give the folder's part files (*.parquet) to use "
                            "them on purpose")


def new_manifest(target: dict, settings: dict, source: dict, plan: dict, chat: dict | None = None) -> dict:
    return {"format": FORMAT, "version": VERSION, "status": "generating", "target": target, "settings": settings,
            "source": source, "plan": plan, "chat": chat, "parts": [],
            "totals": {"rows": 0, "tokens": 0, "new_tokens": 0, "ended_by_eos": 0},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


class OutputStore:
    """Read-modify-replace of an output folder's manifest under its lock; part files beside it.
    `prepare`'s output subclasses it with its own format, identity fields and totals."""

    FORMAT = FORMAT
    VERSION = VERSION
    FIELDS = IDENTITY_FIELDS
    HOW_TO_FIX = HOW_TO_FIX
    WHAT = "generate output"
    TOTALS = ("rows", "tokens", "new_tokens", "ended_by_eos")

    def __init__(self, folder: str | Path):
        self.loc = Location(str(folder))
        self.folder = Path(self.loc.path())

    def read(self) -> dict | None:
        text = self.loc.read_text(MANIFEST)
        if text is None:
            return None
        try:
            m = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{self.folder / MANIFEST}: not valid JSON ({e}); restore it from a copy, or write "
                            "into a new --out") from None
        if not isinstance(m, dict) or any(k not in m for k in ("format", "status", "plan", "parts")):
            raise UserError(f"{self.folder / MANIFEST}: not the manifest of a {self.WHAT}; {self.HOW_TO_FIX}")
        return m

    def init_or_check(self, wanted: dict) -> dict:
        """Create the manifest if absent, else refuse a run with another target or settings."""
        return create_or_check(self.loc, wanted, self.read, self._refuser(wanted))

    def replace_unbound(self, wanted: dict) -> None:
        """With the run lock held: a manifest that lists no part (an earlier attempt that failed
        before its first commit) and was made with other settings is replaced by this run's, and
        its part debris removed; the rerun that attempt's error advised is then not refused."""
        differs = replace_unbound(self.loc, wanted, self.read, lambda m: not m["parts"], self._refuser(wanted),
                                  self._remove_parts)
        if differs is not None:
            log.warning("an earlier attempt on this output committed no part (%s): its manifest is replaced by "
                        "this run's settings", differs)

    def _refuser(self, wanted: dict):
        """The check that refuses an existing manifest made with another target or settings."""
        return lambda existing: check_compatible(existing, wanted, str(self.folder / MANIFEST), fmt=self.FORMAT,
                                                 version=self.VERSION, fields=self.FIELDS,
                                                 how_to_fix=self.HOW_TO_FIX, what=self.WHAT)

    def _remove_parts(self) -> None:
        for name in self.loc.listdir(""):
            if name.startswith("part-"):
                os.remove(self.loc.path(name))

    def commit_part(self, entry: dict) -> dict:
        """List one complete, renamed part; mark the output complete when the plan is fulfilled."""
        with self.loc.lock():
            m = self.read()
            if m is None:
                raise RuntimeError(f"{self.folder / MANIFEST} vanished during generation")
            held = (m.get("held") or {}).pop(entry["name"], None)  # rows a stop kept: now in the part
            if entry["name"] not in {p["name"] for p in m["parts"]}:
                m["parts"].append(entry)
                m["parts"].sort(key=lambda p: p["name"])
                m["totals"] = {k: sum(p.get(k, 0) for p in m["parts"]) for k in self.TOTALS}
                if len(m["parts"]) == m["plan"]["num_parts"]:
                    m["status"] = "complete"
                    m["completed"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                self.loc.write_json_atomic(MANIFEST, m)
            if held is not None:
                Path(self.loc.path(held["file"])).unlink(missing_ok=True)
            return m

    def hold(self, name: str, entry: dict) -> None:
        """List the finished rows a stop kept of part `name` (generate/held.py), replacing an
        earlier list of them; the file it replaces goes after the manifest does."""
        with self.loc.lock():
            m = self.read()
            before = m.setdefault("held", {}).get(name)
            m["held"][name] = entry
            self.loc.write_json_atomic(MANIFEST, m)
        if before is not None and before["file"] != entry["file"]:
            Path(self.loc.path(before["file"])).unlink(missing_ok=True)

    def record(self, key: str, value) -> None:
        """Set one top-level field (e.g. the merged single-file output) under the lock."""
        with self.loc.lock():
            m = self.read()
            m[key] = value
            self.loc.write_json_atomic(MANIFEST, m)

    def remove_debris(self, mine: set[str]) -> None:
        """Part files (finished or temporary) of these uncommitted parts, left by a killed run; and
        their held-row files (generate/held.py) but the ones the manifest lists."""
        listed = {e["file"] for e in ((self.read() or {}).get("held") or {}).values()}
        for name in self.loc.listdir(""):
            stem = name.split(".parquet", 1)[0]
            part = stem.split(".", 1)[0]  # part-00003 of part-00003.held
            if name.startswith("part-") and part in mine and name not in listed:
                os.remove(self.loc.path(name))


def write_parquet_atomic(table, final: Path, on_written=None) -> int:
    """Write a pyarrow table to `final` so that it appears whole or not at all: a temporary file
    beside it, fsync, rename, fsync of the folder. `on_written()` runs between the fsync and the
    rename (a fault point). Returns the file's bytes."""
    import pyarrow.parquet as pq

    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, row_group_size=1024)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    if on_written is not None:
        on_written()
    os.replace(tmp, final)
    fsync_dir(str(final.parent))
    return final.stat().st_size


def write_part(folder: Path, name: str, table) -> tuple[str, int]:
    """Write one part as `name`.parquet. -> (file name, bytes)."""
    final = folder / f"{name}.parquet"
    return final.name, write_parquet_atomic(table, final, on_written=lambda: fault_point("part-written"))


def write_completions(folder: Path, name: str, ids, prompts, new, eos_end) -> dict:
    """One part of prompt + completion rows in the input contract; returns its manifest entry."""
    import pyarrow as pa

    seqs = [p + t for p, t in zip(prompts, new)]
    masks = [[0] * len(p) + [1] * len(t) for p, t in zip(prompts, new)]
    table = pa.table({
        "id": pa.array(ids, type=pa.int64()),
        "input_ids": pa.array(seqs, type=pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, type=pa.list_(pa.int8())),
        "finish_reason": pa.array(["eos" if e else "length" for e in eos_end], type=pa.string()),
    })
    file, nbytes = write_part(folder, name, table)
    return {"name": name, "file": file, "rows": len(ids), "tokens": sum(len(s) for s in seqs),
            "new_tokens": sum(len(t) for t in new), "ended_by_eos": int(sum(eos_end)), "bytes": nbytes,
            "sha256": file_sha256(folder / file)}
