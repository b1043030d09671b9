"""`manifest.json`, the commit point of a cache (cache-contract.md; schema in manifests/).

A shard exists only once the manifest lists it. Every change is a read-modify-replace under an
exclusive lock, so concurrent workers (our own launcher's or torchrun's ranks, on one node or many
nodes sharing a file system) never lose one another's commits.
"""

from __future__ import annotations

import json
import os
import time

from ..runtime import UserError
from .location import Location

FORMAT = "dflash-offline/cache"
VERSION = 1
MANIFEST = "manifest.json"

# Fields whose change makes an existing cache unusable for the run; the first that differs is named.
IDENTITY_FIELDS = [
    ("target", "model_type"), ("target", "num_layers"), ("target", "hidden_size"),
    ("target", "vocab_size"), ("target", "config_sha256"), ("target", "weights_fingerprint"),
    ("capture", "layer_ids"), ("capture", "topk"), ("capture", "hidden_dtype"), ("capture", "max_len"), ("capture", "compute_dtype"),
    ("source", "rows"), ("source", "files"),
    ("plan", "shard_tokens"), ("plan", "sort_window"), ("plan", "num_shards"),
]

HOW_TO_FIX = "point --cache at a new location, or run with the settings the cache was made with"


def new_manifest(target: dict, capture: dict, source: dict, plan: dict) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "status": "extracting",
        "target": target,
        "capture": capture,
        "source": source,
        "plan": plan,
        "shards": [],
        "totals": {"samples": 0, "tokens": 0, "bytes": 0},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _describe(v) -> str:
    s = json.dumps(v)
    return s if len(s) < 120 else s[:117] + "..."


def check_compatible(existing: dict, wanted: dict, where: str) -> None:
    """Raise UserError naming the first identity field on which the two manifests differ."""
    if existing.get("format") != FORMAT:
        raise UserError(f"{where}: not a dflash-offline cache manifest (format {existing.get('format')!r}); {HOW_TO_FIX}")
    if existing.get("version") != VERSION:
        raise UserError(f"{where}: cache format version {existing.get('version')} but this tool writes {VERSION}; see docs/cache-format.md")
    for section, key in IDENTITY_FIELDS:
        a = existing.get(section, {}).get(key)
        b = wanted.get(section, {}).get(key)
        if section == "source" and key == "files":
            # Paths may move between machines; the bytes may not.
            a = [(f["rows"], f["sha256"]) for f in a or []]
            b = [(f["rows"], f["sha256"]) for f in b or []]
        if a != b:
            raise UserError(
                f"{where}: the cache was made with {section}.{key} = {_describe(a)} but this run has "
                f"{_describe(b)}; {HOW_TO_FIX}"
            )


class ManifestStore:
    def __init__(self, loc: Location):
        self.loc = loc

    def read(self) -> dict | None:
        text = self.loc.read_text(MANIFEST)
        if text is None:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{self.loc.url(MANIFEST)}: not valid JSON ({e}); the cache is damaged") from None

    def init_or_check(self, wanted: dict) -> dict:
        """Create the manifest if absent, else refuse an incompatible run. Returns the manifest."""
        with self.loc.lock():
            existing = self.read()
            if existing is None:
                self.loc.write_json_atomic(MANIFEST, wanted)
                return wanted
            check_compatible(existing, wanted, self.loc.url(MANIFEST))
            # Temporary manifests are only written while the lock is held: any left now is debris
            # of a process killed between writing one and replacing manifest.json with it.
            for name in self.loc.listdir(""):
                if name.startswith(MANIFEST + ".tmp-"):
                    self.loc.rmtree(name) if self.loc.remote else os.remove(self.loc.path(name))
            return existing

    def commit_shard(self, entry: dict) -> dict:
        """Add one complete, renamed shard; mark the cache complete when the plan is fulfilled."""
        with self.loc.lock():
            m = self.read()
            if m is None:
                raise RuntimeError("manifest.json vanished during extraction")
            if any(s["name"] == entry["name"] for s in m["shards"]):
                return m  # already committed (a retried commit after a crash in between)
            m["shards"].append(entry)
            m["shards"].sort(key=lambda s: s["name"])
            m["totals"] = {
                "samples": sum(s["samples"] for s in m["shards"]),
                "tokens": sum(s["tokens"] for s in m["shards"]),
                "bytes": sum(s["bytes"] for s in m["shards"]),
            }
            if len(m["shards"]) == m["plan"]["num_shards"]:
                m["status"] = "complete"
                m["completed"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.loc.write_json_atomic(MANIFEST, m)
            return m


def id_ranges(ids) -> list[list[int]]:
    """Sorted ids -> inclusive ranges: [0,1,2,5] -> [[0,2],[5,5]]."""
    out: list[list[int]] = []
    for i in sorted(int(x) for x in ids):
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out
