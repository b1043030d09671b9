"""`dflash-offline status PATH`: for a cache, a training run, a generate or a prepare output (or each of those a
folder holds, the demo's --out), what is done, what is running, what failed. Reads manifest.json /
checkpoints / metrics.jsonl, and the heartbeat and log file every process keeps in `logs/`
(runtime.Heartbeat); no torch, nothing written.

A heartbeat says `running` until its process ends; one whose process is gone (same host, pid not
alive) was killed without a chance to say so (SIGKILL, OOM killer, power loss).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from dflash_offline.cache.location import Location
from dflash_offline.cache.manifest import ManifestStore, committed_names, edited_problem, occupancy
from dflash_offline.cache.manifest_check import FORMAT
from dflash_offline.rows.parts import PREPARED_FORMAT, damaged_parts, held_rows, parts_folder, read_manifest
from dflash_offline.runs.checkpoint import CHECKPOINT_PREFIX, checkpoint_damage, damaged_checkpoint, list_checkpoints
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.logs import last_error, processes
from dflash_offline.runtime.paths import require_kind
from dflash_offline.runs.folder import is_run_folder
from dflash_offline.status_records import CacheStatus, GenerateStatus, PrepareStatus, RunStatus, StatusRecord
from dflash_offline.train.resume import config_problem

HUNG = ("a process is alive but has not advanced for minutes (hung?): read its log; `kill -USR1 PID` writes "
        "its stacks there")


def cache_status(path: str) -> CacheStatus:
    loc = Location(path)
    m = ManifestStore(loc).read()
    logs = Path(loc.path("logs")) if not loc.remote else Path("dflash-logs")
    procs = processes(logs, stage="extract-") if logs.is_dir() else []
    if m is None:
        if not procs:
            raise UserError(f"{path}: no manifest.json; not a cache (or nothing committed yet)")
        # An extraction that ended before it created the manifest (refused, or failed in preflight).
        m = {"status": "not created", "plan": {"num_shards": 0}, "totals": {"samples": 0, "tokens": 0, "bytes": 0},
             "shards": []}
    committed = committed_names(m)
    on_storage = set(loc.listdir("shards"))
    debris = [n for n in on_storage if n.endswith(".zarr") and n[:-5] not in committed]
    # Committed (and not released by a streaming trainer) but gone from storage: the cache is damaged.
    released = {s["name"] for s in m.get("released", [])}
    missing = sorted(n for n in committed if f"{n}.zarr" not in on_storage and n not in released)
    running = [p for p in procs if p["state"] == "running"]
    edited = edited_problem(m)
    if m["status"] == "not created" and not running:
        verdict = "no manifest yet: the extraction ended before it created one (see the last error)"
    elif edited is not None:
        verdict = f"damaged: manifest.json: {edited}"
    else:
        verdict = _verdict(m["status"], procs, "extracting", "extract")
    return CacheStatus(
        path=str(path), status=m["status"], verdict=verdict, shards_committed=len(committed),
        shards_planned=m["plan"]["num_shards"], totals=m["totals"], shards_released=len(m.get("released", [])),
        occupancy_bytes=occupancy(m), budget_bytes=m.get("budget_bytes"), in_flight=sorted(m.get("reserved") or {}),
        consumers={k: len(v["finished"]) for k, v in (m.get("consumers") or {}).items()}, debris=debris,
        missing_shards=missing, processes=procs, last_error=last_error(logs, "extract-") if logs.is_dir() else None)


def _verdict(status: str, procs: list[dict], busy: str, command: str) -> str:
    """What a committed-by-manifest output (a cache, a generate folder) is doing, from its
    manifest's status and its processes' heartbeats."""
    if status == "complete":
        return "complete"
    if any(p["state"] == "running" for p in procs):
        return busy
    if any(p["state"] == "stale" for p in procs):
        return HUNG
    if any(p["state"] == "failed" for p in procs):
        return f"failed (see the last error): run the same {command} command again to resume once it is fixed"
    if any(p["state"] == "stopped" for p in procs):
        return f"stopped on request (SIGTERM/SIGINT): run the same {command} command again to resume"
    return f"interrupted: run the same {command} command again to resume"


def _part_folder_problem(m: dict, totals: tuple[str, ...]) -> str | None:
    """What a generate or prepare manifest lacks that `status` reads, or None."""
    if not isinstance(m.get("status"), str):
        return "no status"
    if not isinstance(m.get("plan"), dict) or not isinstance(m["plan"].get("num_parts"), int):
        return "plan.num_parts is not an integer"
    parts = m.get("parts")
    if not isinstance(parts, list):
        return "parts is not a list"
    for i, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("file"), str):
            return f"parts[{i}] has no file"
    if not isinstance(m.get("totals"), dict) or not all(isinstance(m["totals"].get(k, 0), int) for k in totals):
        return f"totals lacks integer {', '.join(totals)}"
    return None


def _read_part_manifest(folder: Path, totals: tuple[str, ...], fix: str) -> dict:
    m = read_manifest(folder)
    wrong = _part_folder_problem(m, totals) if m is not None else "no manifest"
    if wrong:
        raise UserError(f"{folder / 'manifest.json'}: damaged or not a dflash-offline manifest ({wrong}); {fix}")
    return m


def generate_status(path: str) -> GenerateStatus:
    """A `generate` output folder: parts committed of those planned, its processes, the last error."""
    folder = parts_folder(path)  # a merged file: its parts and logs are beside it
    m = _read_part_manifest(folder, ("rows", "new_tokens", "ended_by_eos"),
                            "restore it from a copy, or generate into a new --out")
    logs = folder / "logs"
    procs = processes(logs, stage="generate-") if logs.is_dir() else []
    on_disk = {f.name for f in folder.glob("part-*.parquet")}
    kept = {e["file"] for e in (m.get("held") or {}).values()}  # rows a stop kept: listed, not debris
    debris = sorted(on_disk - {p["file"] for p in m["parts"]} - kept)
    return GenerateStatus(
        path=str(path), status=m["status"], verdict=_verdict(m["status"], procs, "generating", "generate"),
        parts_committed=len(m["parts"]), parts_planned=m["plan"]["num_parts"], totals=m["totals"],
        merged=m.get("merged"), debris=debris, damaged=damaged_parts(folder, m), processes=procs,
        last_error=last_error(logs, "generate-") if logs.is_dir() else None, held_rows=held_rows(m))


def _is_generated(p: Path) -> bool:
    """A `generate` output folder (a `prepare` output's split folder is a part folder too, but not one)."""
    return (_part_manifest(p) or {}).get("format") == "dflash-offline/generated"


def _part_manifest(p: Path) -> dict | None:
    """The manifest of a generate or prepare part folder, or None (none, not ours, unreadable)."""
    try:
        return read_manifest(p) if p.is_dir() else None
    except UserError:
        return None


PREPARE_SPLITS = ("train", "eval")  # prepare's split folders (prepare/launcher.py SPLITS)
PREPARE_TOTALS = ("rows", "tokens", "trained_tokens", "conversations", "truncated")


def _prepared_splits(p: Path) -> dict[str, Path]:
    """{split: folder} of a `prepare` output: OUT (its train/ and eval/ that hold a manifest), or
    one split folder itself. {} for anything else."""
    m = _part_manifest(p)
    if m is not None:
        if m.get("format") != PREPARED_FORMAT:
            return {}
        split = (m.get("plan") or {}).get("split") if isinstance(m.get("plan"), dict) else None
        return {split if isinstance(split, str) else p.name: p}
    return {s: p / s for s in PREPARE_SPLITS if (_part_manifest(p / s) or {}).get("format") == PREPARED_FORMAT}


def _prepare_logs(p: Path) -> Path | None:
    """Where the prepare run that wrote OUT (or its split folder `p`) logs: OUT/logs."""
    split = (p / "manifest.json").exists()
    for folder in (p, p.parent) if split else (p,):
        if any((folder / "logs").glob("prepare*.heartbeat.json")) or any((folder / "logs").glob("prepare*.log")):
            return folder / "logs"
    return None


def _is_prepare_output(p: Path) -> bool:
    """A `prepare` output (or one of its split folders), or a folder a prepare run logs into that
    has written no manifest yet (refused or failed before its first part)."""
    if not p.is_dir():
        return False
    if _prepared_splits(p):
        return True
    return not (p / "manifest.json").exists() and any((p / "logs").glob("prepare*.heartbeat.json"))


def prepare_status(path: str) -> PrepareStatus:
    """A `prepare` output (OUT, or its train/ or eval/ folder): per split the parts committed of
    those planned and what they hold, the records read and dropped, the prepare process and its
    last error."""
    folder = Path(path)
    fix = "restore it from a copy, or prepare into a new --out"
    splits = {s: (f, _read_part_manifest(f, PREPARE_TOTALS, fix)) for s, f in _prepared_splits(folder).items()}
    logs = _prepare_logs(folder)
    procs = processes(logs, stage="prepare") if logs is not None else []
    states = {m["status"] for _, m in splits.values()}
    status = "not created" if not splits else "complete" if states == {"complete"} else "preparing"
    if status == "not created" and not any(p["state"] == "running" for p in procs):
        verdict = "no manifest yet: the preparation ended before it wrote one (see the last error)"
    else:
        verdict = _verdict(status, procs, "preparing", "prepare")

    dropped: Counter = Counter()
    records = None
    for _, m in splits.values():
        counts = m.get("counts") if isinstance(m.get("counts"), dict) else {}
        if records is None and isinstance(counts.get("records_read"), int):
            records = counts["records_read"]
            dropped.update({k: v for k, v in (counts.get("dropped") or {}).items() if isinstance(v, int)})
        for part in m["parts"]:
            dropped.update({k: v for k, v in (part.get("dropped") or {}).items() if isinstance(v, int)})
    out = {}
    for s, (f, m) in splits.items():
        on_disk = {x.name for x in f.glob("part-*.parquet")}
        out[s] = {"path": str(f), "kind": m.get("kind"), "status": m["status"], "parts_committed": len(m["parts"]),
                  "parts_planned": m["plan"]["num_parts"],
                  "totals": {k: m["totals"].get(k, 0) for k in PREPARE_TOTALS},
                  "debris": sorted(on_disk - {p["file"] for p in m["parts"]}), "damaged": damaged_parts(f, m)}
    return PrepareStatus(path=str(path), status=status, verdict=verdict, splits=out, records_read=records,
                         dropped=dict(dropped.most_common()), processes=procs,
                         last_error=last_error(logs, "prepare") if logs is not None else None)


def run_status(path: str) -> RunStatus:
    out = Path(path)
    steps = list_checkpoints(out)
    # Headers and sizes only (no tensors): what resume and export would refuse, said here first.
    damage = {s: what for s in steps
              if (what := checkpoint_damage(out / f"{CHECKPOINT_PREFIX}{s}", config_problem=config_problem))}
    damage_notes = [damaged_checkpoint(out, s, what) for s, what in damage.items()]
    intact = [s for s in steps if s not in damage]
    last, damaged = last_metrics(out / "metrics.jsonl")
    procs = processes(out / "logs", stage="train-") if (out / "logs").is_dir() else []
    total = next((p["total_steps"] for p in procs if p.get("total_steps")), None)
    if last is not None:
        # A heartbeat is written at most every 2 s, so a killed rank's may name an older step than
        # the metrics line rank 0 wrote after the last step all ranks took together: the later wins.
        for p in procs:
            if isinstance(p.get("step"), int) and p["step"] < last["step"]:
                p["step"] = last["step"]
    running = [p for p in procs if p["state"] == "running"]
    failed = [p for p in procs if p["state"] in ("failed", "died", "interrupted", "stopped")]
    export = (out / "export" / "config.json").is_file()
    done = [p for p in procs if p["state"] == "done"]
    if running:
        verdict = "training"
    elif any(p["state"] == "stale" for p in procs):
        verdict = HUNG
    elif export and not failed and (done or not procs):
        short = total is not None and last is not None and last["step"] < total
        verdict = (f"finished at step {last['step']} of the plan's {total} (a --max-steps stop; export written of that "
                   "step): run the train command again with a larger --max-steps, or none, to go on" if short
                   else "finished (export written)")
    elif failed or steps or last is not None:
        verdict = "stopped before the end: run the same train command again to resume" + \
                  (f" from step-{intact[-1]}" if intact else " (no checkpoint yet: from the start)")
    else:
        verdict = "nothing recorded yet"
    if damage_notes:
        verdict += f"; DAMAGED checkpoint(s): {', '.join(f'step-{s}' for s in damage)}"
    return RunStatus(path=str(path), verdict=verdict, checkpoints=steps, damaged_checkpoints=damage_notes,
                     last_metrics=last, metrics_damaged=damaged, total_steps=total, export=export, processes=procs,
                     last_error=last_error(out / "logs", "train-") if (out / "logs").is_dir() else None)


METRIC_KEYS = ("step", "loss", "acc_slot1", "tau", "step_time")  # what a step's line holds (and the report shows)


def last_metrics(path: Path) -> tuple[dict | None, str | None]:
    """(the last whole step line of metrics.jsonl or None, a note on a damaged tail or None). A
    crash during a write leaves a torn last line, or a tail of zero bytes (a file system that had
    not written the data yet): the lines after the last whole one are ignored, and said so."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:  # missing (a run without a step yet) or unreadable: nothing to show
        return None, None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for k in range(len(lines) - 1, -1, -1):
        try:
            rec = json.loads(lines[k])
        except ValueError:
            continue
        if isinstance(rec, dict) and all(isinstance(rec.get(key), (int, float)) for key in METRIC_KEYS):
            break
    else:
        k, rec = -1, None
    bad = len(lines) - 1 - k
    if not bad:
        return rec, None
    zeros = "zero bytes" if "\0" in text.rstrip("\n") else "a torn line"
    return rec, (f"{path}: the last {bad} line(s) are damaged ({zeros}, a crash during a write?) and are ignored; "
                 + (f"the last whole one is step {rec['step']}" if rec else "no whole line before them"))


def _is_cache(p: Path) -> bool:
    try:
        return json.loads((p / "manifest.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _named(kind: str, paths: list[str]) -> str:
    shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    return f"the {kind}{'s' if len(paths) > 1 else ''} {shown}"


def _contents(path: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """(caches, runs, generate outputs, prepare outputs) among the subfolders of a local folder,
    each in name order."""
    p = Path(path)
    caches, runs, generated, prepared = [], [], [], []
    for sub in sorted(p.iterdir()) if p.is_dir() else ():
        if sub.is_dir() and not sub.name.startswith("."):  # .tmp-* folders are half-written exports
            if _is_cache(sub):
                caches.append(os.path.join(path, sub.name))
            elif is_run_folder(sub):
                runs.append(os.path.join(path, sub.name))
            elif _is_generated(sub):
                generated.append(os.path.join(path, sub.name))
            elif _prepared_splits(sub):
                prepared.append(os.path.join(path, sub.name))
    return caches, runs, generated, prepared


KINDS = ("cache", "run", "generate", "prepare")


def held(path: str, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """For a local folder that is none of what `status` reads but holds some in its subfolders
    (the demo's --out): the paths of those of `kinds`, in that order (caches, then runs, then
    generate outputs, then prepare outputs by default). [] otherwise."""
    if "://" in str(path) or _kind(path) is not None:
        return []
    found = dict(zip(KINDS, _contents(path)))
    return [p for kind in kinds for p in found[kind]]


def folder_hint(path: str, command: str) -> str | None:
    """For a local folder that is not what `command` takes (status: a cache or a run; verify,
    inspect: a cache) but holds some in its subfolders (the demo's top folder): a one-line refusal
    that names them and the command to type. None when there is nothing to point at. (The CLI's
    `status` and `inspect` show what such a folder holds instead, see `held`; `verify` refuses.)"""
    what = "a cache folder (the one with manifest.json)" + (
        ", a training run folder (OUT of train), a generate or a prepare output folder" if command == "status" else "")
    require_kind(path, command, True, what)
    if "://" not in str(path) and os.path.lexists(path) and not Path(path).is_dir() and not Path(path).is_file():
        raise UserError(f"{command} {path}: not a folder (a device, a socket or a broken link); give {what}")
    if "://" in str(path) or (Path(path) / "manifest.json").exists():
        return None
    caches, runs, generated, prepared = _contents(path)
    if not caches and not runs and not ((generated or prepared) and command == "status"):
        return None
    shown = (("cache", caches), ("run", runs)) + ((("generate output", generated), ("prepare output", prepared))
                                                  if command == "status" else ())
    named = [_named(kind, found) for kind, found in shown if found]
    holds = " and ".join(named) if len(named) < 3 else ", ".join(named[:-1]) + f" and {named[-1]}"
    if command == "status":
        return (f"{path}: not a cache, a run, a generate or a prepare output; it holds {holds}: dflash-offline status "
                f"{(caches or runs or generated or prepared)[0]}")
    if caches:
        return f"{path}: no manifest.json, not a cache; it holds {holds}: dflash-offline {command} {caches[0]}"
    return (f"{path}: no manifest.json, not a cache; it holds no cache but {holds} (training runs): "
            f"dflash-offline status {runs[0]}")


def _kind(path: str) -> str | None:
    """What `status` reads PATH as: "generate", "prepare", "cache", "run", or None (none of them)."""
    p = Path(path)
    if _is_generated(p) or _is_generated(parts_folder(p)):
        return "generate"
    if "://" not in str(path) and _prepared_splits(p):
        return "prepare"
    # A manifest.json of any kind (a folder, a damaged file): read as a cache's, which says what is wrong.
    if "://" in str(path) or os.path.lexists(p / "manifest.json") or any((p / "logs").glob("extract-*")):
        return "cache"
    if is_run_folder(p):
        return "run"
    return "prepare" if _is_prepare_output(p) else None


def status(path: str) -> StatusRecord:
    kind = _kind(path)
    if kind is not None:
        return {"generate": generate_status, "prepare": prepare_status, "cache": cache_status,
                "run": run_status}[kind](path)
    if "://" not in path and not Path(path).exists():
        raise UserError(f"{path}: no such file or folder; give a cache, a training run folder, or a generate or "
                        "prepare output (or a folder holding them)")
    raise UserError(folder_hint(path, "status") or
                    f"{path}: neither a cache (manifest.json), a training run folder (metrics.jsonl, step-N/, logs/), "
                    "a generate output nor a prepare output")


def show(path: str, as_json: bool = False) -> str:
    """What `dflash-offline status PATH` prints: PATH's status, or for a folder that holds caches,
    runs or generate outputs (`held`), each one's in turn, blocks apart (--json: a list)."""
    inside = held(path)
    found = [status(p) for p in inside] if inside else status(path)
    if as_json:
        return json.dumps([st.to_json() for st in found] if inside else found.to_json(), indent=1, default=str)
    return "\n\n".join(st.text() for st in found) if inside else found.text()
