"""What `status` finds in a folder, one typed record per kind (a cache, a run, a `generate` output,
a `prepare` output), each with the lines it prints; status.py reads the folders and builds them.

`--json` writes a record as `{"kind": ..., field: value, ...}` in field order (`to_json`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import ClassVar

from dflash_offline.prepare.output import dropped_text


@dataclass
class _Record:
    """The parts every record has: its processes (heartbeats) and the last error of its logs are
    the last two fields of each kind."""

    kind: ClassVar[str]

    def to_json(self) -> dict:
        return {"kind": self.kind, **{f.name: getattr(self, f.name) for f in fields(self)}}

    def head(self) -> list[str]:
        raise NotImplementedError

    def text(self) -> str:
        """The block `dflash-offline status` prints: the kind's own lines, its processes, its last error."""
        lines = self.head()
        procs = self.processes
        # Columns as wide as the longest name and pid of this block: names like extract-rank0-writer0
        # would push the state column out of line.
        name_w = max((len(p["name"]) for p in procs), default=0)
        pid_w = max((len(str(p["pid"])) for p in procs), default=0)
        for p in procs:
            prog = ", ".join(f"{k} {p[k]}" for k in ("shard", "part", "prompts_done", "tokens_done", "step",
                                                     "total_steps") if k in p)
            state = p["state"]
            note = {"died": " (process gone without a word: killed?)", "stale": " (no heartbeat: hung?)"}.get(state, "")
            err = f": {p['error']}" if p.get("error") and state in ("failed", "interrupted", "stopped") else ""
            lines.append(f"  {p['name']:<{name_w}} pid {p['pid']:<{pid_w}} {state}{note}{err}; phase {p['phase']}"
                         + (f", {prog}" if prog else "") + f"; last heartbeat {_age(p['age_s'])} ago")
        e = self.last_error
        lines.append(f"  last error: {e['error']} ({e['log']}, {e['time']})" if e else "  last error: none")
        return "\n".join(lines)


def _age(s: float) -> str:
    return f"{s:.0f}s" if s < 120 else (f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h")


@dataclass
class CacheStatus(_Record):
    kind: ClassVar[str] = "cache"
    path: str
    status: str  # the manifest's
    verdict: str
    shards_committed: int
    shards_planned: int
    totals: dict  # the manifest's: samples, tokens, bytes
    shards_released: int
    occupancy_bytes: int
    budget_bytes: int | None
    in_flight: list  # shards reserved by a writer
    consumers: dict  # consumer -> shards it finished
    debris: list  # uncommitted shard folders
    missing_shards: list  # committed, gone from storage
    processes: list
    last_error: dict | None

    def head(self) -> list[str]:
        t = self.totals
        lines = [f"cache {self.path}: {self.verdict}",
                 f"  {self.shards_committed}/{self.shards_planned} shards committed: {t['samples']} samples, "
                 f"{t['tokens']} tokens, {t['bytes'] / 1e9:.3f} GB"]
        if self.debris:
            lines.append(f"  {len(self.debris)} uncommitted shard folder(s) (removed when extraction resumes): "
                         + ", ".join(self.debris[:4]))
        if self.missing_shards:
            lines.append(f"  DAMAGED: {len(self.missing_shards)} committed shard(s) missing on storage: "
                         + ", ".join(self.missing_shards[:4]) + "; training refuses this cache: restore them or "
                         "re-extract into a new --cache (`dflash-offline verify` checks the rest)")
        return lines


@dataclass
class GenerateStatus(_Record):
    kind: ClassVar[str] = "generate"
    path: str
    status: str
    verdict: str
    parts_committed: int
    parts_planned: int
    totals: dict  # rows, new_tokens, ended_by_eos
    merged: dict | None  # the merged file's record
    debris: list  # uncommitted part files
    damaged: list  # committed parts missing, or not the size committed
    processes: list
    last_error: dict | None
    held_rows: int = 0  # finished rows of parts in progress a stop kept (generate/held.py)

    def head(self) -> list[str]:
        t = self.totals
        lines = [f"generated {self.path}: {self.verdict}",
                 f"  {self.parts_committed}/{self.parts_planned} parts committed: {t['rows']} rows, "
                 f"{t['new_tokens']} new tokens ({t['ended_by_eos']} ended by end-of-sequence)"]
        if self.held_rows:
            lines.append(f"  {self.held_rows} finished rows of the parts in progress kept by a stop (the rest of "
                         "those parts is decoded on resume)")
        if self.debris:
            lines.append(f"  {len(self.debris)} uncommitted part file(s) (removed when generation resumes): "
                         + ", ".join(self.debris[:4]))
        if self.damaged:
            lines.append(f"  DAMAGED: {'; '.join(self.damaged[:3])}; extract refuses this folder: restore the parts "
                         "from a copy, or generate into a new --out")
        return lines


@dataclass
class PrepareStatus(_Record):
    kind: ClassVar[str] = "prepare"
    path: str
    status: str
    verdict: str
    splits: dict  # split -> {path, kind, status, parts_committed, parts_planned, totals, debris}
    records_read: int | None
    dropped: dict  # reason -> records
    processes: list
    last_error: dict | None

    def head(self) -> list[str]:
        lines = [f"prepared {self.path}: {self.verdict}"]
        for split, sp in self.splits.items():
            t = sp["totals"]
            what = "training rows" if sp["kind"] == "completions" else "prompts"
            lines.append(f"  {split}: {sp['parts_committed']}/{sp['parts_planned']} parts committed: "
                         f"{t['conversations']} conversations -> {t['rows']} {what}, {t['tokens']} tokens"
                         + (f" ({t['trained_tokens']} trained, {t['truncated']} rows truncated)"
                            if sp["kind"] == "completions" else "") + f" ({sp['path']})")
            if sp["debris"]:
                lines.append(f"  {len(sp['debris'])} uncommitted part file(s) in {split} (removed when preparation "
                             "resumes): " + ", ".join(sp["debris"][:4]))
            if sp.get("damaged"):
                lines.append(f"  DAMAGED {split}: {'; '.join(sp['damaged'][:3])}; restore the parts from a copy, or "
                             "prepare into a new --out")
        if self.records_read is not None:
            lines.append(f"  {self.records_read} records read; dropped: {dropped_text(Counter(self.dropped))}")
        return lines


@dataclass
class RunStatus(_Record):
    kind: ClassVar[str] = "run"
    path: str
    verdict: str
    checkpoints: list  # steps of the step-N/ folders
    damaged_checkpoints: list  # one line each, with the fix
    last_metrics: dict | None  # the last whole line of metrics.jsonl
    metrics_damaged: str | None
    total_steps: int | None
    export: bool
    processes: list
    last_error: dict | None

    def head(self) -> list[str]:
        lines = [f"run {self.path}: {self.verdict}"]
        m = self.last_metrics
        if m:
            of = f"/{self.total_steps}" if self.total_steps else ""
            lines.append(f"  last step {m['step']}{of}: loss {m['loss']:.4f}, slot-1 accuracy {m['acc_slot1']:.3f}, "
                         f"tau {m['tau']:.2f}, {m['step_time']:.3f} s/step")
        if self.metrics_damaged:
            lines.append(f"  note: {self.metrics_damaged}")
        for note in self.damaged_checkpoints or []:
            lines.append(f"  DAMAGED: {note}")
        lines.append(f"  checkpoints: {', '.join(f'step-{s}' for s in self.checkpoints) or 'none'}; "
                     f"export: {'yes' if self.export else 'no'}")
        return lines


StatusRecord = CacheStatus | GenerateStatus | PrepareStatus | RunStatus
