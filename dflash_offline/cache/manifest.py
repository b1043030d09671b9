"""`manifest.json`, the commit point of a cache (cache-contract.md; schema in manifests/).

A shard exists only once the manifest lists it. Every change is a read-modify-replace under an
exclusive lock, so concurrent workers (our own launcher's or torchrun's ranks, on one node or many
nodes sharing a file system) never lose one another's commits.
"""

from __future__ import annotations

import json
import os
import time

from dflash_offline.cache.debris import refuse_foreign_shards
from dflash_offline.runtime.errors import UserError
from dflash_offline.cache.location import Location
from dflash_offline.cache.manifest_check import DAMAGED_FIX, FORMAT, VERSION, check_manifest, describe

MANIFEST = "manifest.json"

# Fields whose change makes an existing cache unusable for the run; the first that differs is named.
IDENTITY_FIELDS = [
    ("target", "model_type"), ("target", "num_layers"), ("target", "hidden_size"),
    ("target", "vocab_size"), ("target", "config_sha256"), ("target", "weights_fingerprint"),
    ("capture", "layer_ids"), ("capture", "topk"), ("capture", "hidden_dtype"), ("capture", "max_len"), ("capture", "compute_dtype"),
    ("source", "rows"), ("source", "files"),
    ("plan", "shard_tokens"), ("plan", "sort_window"), ("plan", "num_shards"), ("plan", "passes"),
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


def check_compatible(existing: dict, wanted: dict, where: str, *, fmt: str = FORMAT, version: int = VERSION,
                     fields=IDENTITY_FIELDS, how_to_fix: str = HOW_TO_FIX, what: str = "cache") -> None:
    """Raise UserError naming the first identity field on which the two manifests differ (also
    used for the output folder of `generate`, with its own format and fields)."""
    if existing.get("format") != fmt:
        raise UserError(f"{where}: not a dflash-offline {what} manifest (format {existing.get('format')!r}); {how_to_fix}")
    if existing.get("version") != version:
        raise UserError(f"{where}: {what} format version {existing.get('version')} but this tool writes {version}; "
                        f"see docs/{'cache-format' if what == 'cache' else 'generate'}.md")
    for section, key in fields:
        a = (existing.get(section) or {}).get(key)  # an optional section may be null (chat)
        b = (wanted.get(section) or {}).get(key)
        if section == "source" and key == "files":
            # Paths may move between machines; the bytes may not.
            fa, fb = a or [], b or []
            a = [(f["rows"], f["sha256"]) for f in fa]
            b = [(f["rows"], f["sha256"]) for f in fb]
            if a != b and len(a) == len(b):  # the same number of files: name the one that changed
                k = next(k for k in range(len(a)) if a[k] != b[k])
                raise UserError(f"{where}: the {what} was made with other source.files: input file {k} ({fb[k]['path']}) "
                                f"has other bytes (sha256 {str(fa[k]['sha256'])[:12]}... then, "
                                f"{str(fb[k]['sha256'])[:12]}... now); {how_to_fix}")
        if a != b:
            # An absent value is a setting left at its default (a manifest records only those set).
            shown = [("unset (its default)" if v is None else describe(v)) for v in (a, b)]
            raise UserError(
                f"{where}: the {what} was made with {section}.{key} = {shown[0]} but this run has "
                f"{shown[1]}; {how_to_fix}"
            )


def create_or_check(loc: Location, wanted: dict, read, check) -> dict:
    """Under the location's lock: write `wanted` as manifest.json if there is none, else pass the
    existing one to `check` (which raises to refuse the run) and return it. Shared by the cache and
    the output of `generate`."""
    with loc.lock():
        existing = read()
        if existing is None:
            loc.write_json_atomic(MANIFEST, wanted)
            return wanted
        check(existing)
        # Temporary manifests are only written while the lock is held: any left now is debris
        # of a process killed between writing one and replacing manifest.json with it.
        for name in loc.listdir(""):
            if name.startswith(MANIFEST + ".tmp-"):
                loc.rmtree(name) if loc.remote else os.remove(loc.path(name))
        return existing


def replace_unbound(loc: Location, wanted: dict, read, binds_nothing, check, remove_debris) -> str | None:
    """Under the location's lock, with the run lock held: a manifest that `binds_nothing` (an
    earlier attempt that failed before its first commit) and that `check` refuses is replaced by
    `wanted`, after `remove_debris()` deleted that attempt's uncommitted files; the rerun its error
    advised is then not refused. Shared by the cache and the output of `generate`. Returns the
    first difference in words when it replaced the manifest, else None."""
    with loc.lock():
        m = read()
        if m is None or not binds_nothing(m):
            return None
        try:
            check(m)
            return None
        except UserError as e:
            differs = str(e).split(": ", 1)[-1].split("; ")[0]
        remove_debris()
        loc.write_json_atomic(MANIFEST, wanted)
    return differs


class ManifestStore:
    def __init__(self, loc: Location):
        self.loc = loc

    def read(self) -> dict | None:
        """The manifest, or None where there is none. One that is not a cache manifest this version
        can read (not JSON, another program's, damaged, a newer version's) is refused in one line
        naming the key (`check_manifest`): every reader and extract itself read it here."""
        fix = DAMAGED_FIX
        url = self.loc.url(MANIFEST)
        try:
            text = self.loc.read_text(MANIFEST)
        except IsADirectoryError:
            raise UserError(f"{url}: a folder, not the manifest file; damaged or not a dflash-offline cache: "
                            f"{fix}") from None
        except NotADirectoryError:
            raise UserError(f"{self.loc.path()}: not a folder; give a cache folder (the one with manifest.json)") from None
        except UnicodeDecodeError as e:
            raise UserError(f"{url}: not valid JSON (not UTF-8 text: byte {e.start} is {e.object[e.start]:#04x}); the "
                            f"cache is damaged: {fix}") from None
        except PermissionError:
            raise  # the command line names the path and the fix
        except OSError as e:
            raise UserError(f"{url}: cannot be read ({e.strerror or e}); check the storage, or {fix}") from None
        if text is None:
            return None
        try:
            m = json.loads(text, parse_constant=_not_json)
        except ValueError as e:  # JSONDecodeError, and NaN / Infinity (JSON has no such numbers)
            raise UserError(f"{url}: not valid JSON ({e}); the cache is damaged: {fix}") from None
        if isinstance(m, dict) and m.get("format") == "dflash-offline/generated":
            raise UserError(f"{self.loc.path()}: a generate output (the target's completions as Parquet parts), not a "
                            f"cache: extract it with `dflash-offline extract --data {self.loc.path()}`, or see "
                            f"`dflash-offline status {self.loc.path()}`")
        if isinstance(m, dict) and m.get("format") == "dflash-offline/prepared":
            raise UserError(f"{self.loc.path()}: a prepare output (rows for `generate --prompts` or `extract --data`, as "
                            f"Parquet parts), not a cache; see `dflash-offline status {self.loc.path()}`")
        check_manifest(m, url)
        return m

    def read_committed(self) -> dict | None:
        """As `read`, for readers (train, eval, inspect, verify): a complete manifest that cannot be
        what extract committed (`edited_problem`) is refused. Extract itself uses `read`: it
        re-makes what is missing."""
        m = self.read()
        problem = edited_problem(m) if m is not None else None
        if problem is not None:
            raise UserError(f"{self.loc.url(MANIFEST)}: {problem}")
        return m

    def init_or_check(self, wanted: dict) -> dict:
        """Create the manifest if absent, else refuse an incompatible run. Returns the manifest.
        Either way, a shard folder the run would delete as debris but that holds something extract
        did not write is refused first (`debris.refuse_foreign_shards`)."""
        def read() -> dict | None:
            m = self.read()
            self._refuse_foreign_shards(None if m is None else committed_names(m))
            return m

        return create_or_check(self.loc, wanted, read, self._refuser(wanted))

    def replace_unbound(self, wanted: dict) -> str | None:
        """A manifest that binds nothing and was made with other settings is replaced by `wanted`,
        its shard debris removed (nothing there is committed; anything else there is refused
        before anything is removed). Returns what differed, or None."""
        def remove_debris() -> None:
            self._refuse_foreign_shards(set(), everything=True)
            self.loc.rmtree("shards")

        return replace_unbound(self.loc, wanted, self.read, binds_nothing, self._refuser(wanted), remove_debris)

    def _refuse_foreign_shards(self, committed: set[str] | None, everything: bool | None = None) -> None:
        if not self.loc.remote:
            refuse_foreign_shards(self.loc.path(), committed=committed, everything=everything)

    def _refuser(self, wanted: dict):
        """The check that refuses an existing manifest made with settings other than `wanted`'s."""
        return lambda existing: check_compatible(existing, wanted, self.loc.url(MANIFEST))

    def commit_shard(self, entry: dict) -> dict:
        """Add one complete, renamed shard; mark the cache complete when the plan is fulfilled."""
        with self.loc.lock():
            m = self.read()
            if m is None:
                raise RuntimeError("manifest.json vanished during extraction")
            if entry["name"] in committed_names(m):
                return m  # already committed (a retried commit after a crash in between)
            m["shards"].append(entry)
            m["shards"].sort(key=lambda s: s["name"])
            (m.get("reserved") or {}).pop(entry["name"], None)
            _update_totals(m)
            self.loc.write_json_atomic(MANIFEST, m)
            return m

    # -- the bounded cache: reservations (extract), consumer records and releases (train --stream)

    def reserve(self, name: str, nbytes: int, budget: int, before: list[str]) -> tuple[bool, int]:
        """Admit shard `name` (planned size `nbytes`) if every shard in `before` is already
        committed, released or admitted, and the unconsumed cache plus all admitted shards stays
        within `budget`. Admission in plan order means the shards on storage are always a prefix
        of the plan plus what consumers have not released, so a consumer that waits for the next
        shard can never wait on a shard that waits for space. Returns (admitted, occupancy)."""
        with self.loc.lock():
            m = self.read()
            reserved = m.setdefault("reserved", {})
            if name in reserved or name in committed_names(m):
                return True, occupancy(m)
            known = committed_names(m) | set(reserved)
            used = occupancy(m)
            if any(b not in known for b in before) or used + nbytes > budget:
                return False, used
            reserved[name] = int(nbytes)
            self.loc.write_json_atomic(MANIFEST, m)
            return True, used + nbytes

    def set_budget(self, max_bytes: int | None, max_shard_bytes: int | None = None) -> None:
        """Record the run's --max-bytes and the largest shard's planned bytes: a trainer that
        follows the cache checks that a window of its shards fits."""
        with self.loc.lock():
            m = self.read()
            if max_bytes is None:
                m.pop("budget_bytes", None)
                m.pop("max_shard_bytes", None)
            else:
                m["budget_bytes"] = int(max_bytes)
                if max_shard_bytes is not None:
                    m["max_shard_bytes"] = int(max_shard_bytes)
            self.loc.write_json_atomic(MANIFEST, m)

    def drop_reservations(self, names: set[str]) -> None:
        """Reservations of shards whose writer died (a restarted worker drops its own)."""
        with self.loc.lock():
            m = self.read()
            reserved = m.get("reserved") or {}
            if not names & set(reserved):
                return
            for n in names:
                reserved.pop(n, None)
            self.loc.write_json_atomic(MANIFEST, m)

    def register_consumer(self, consumer: str, stream: bool) -> None:
        """Enter a trainer that follows this cache, under the lock, before it reads anything: a
        streaming trainer deletes shards, so it must be the only consumer, and nobody may join
        a cache that one streams. Raises UserError naming the other consumer."""
        with self.loc.lock():
            m = self.read()
            consumers = m.setdefault("consumers", {})
            others = sorted(c for c in consumers if c != consumer)
            streaming = [c for c in others if consumers[c].get("stream")]
            if streaming or (stream and others):
                raise UserError(f"{self.loc.url(MANIFEST)}: {', '.join(streaming or others)} follows this cache"
                                + (" and deletes its shards (--stream)" if streaming else "")
                                + "; one streaming trainer per cache (remove that entry from `consumers` in "
                                "manifest.json if the run is gone)")
            rec = consumers.setdefault(consumer, {"finished": []})
            rec["stream"] = bool(stream)
            rec["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.loc.write_json_atomic(MANIFEST, m)

    def record_consumed(self, consumer: str, finished: list[str], release: bool) -> list[str]:
        """Record that `consumer` has finished these shards for good (its checkpoint is past their
        last use); with `release`, move their entries to `released` and list them in `releasing`
        until the caller has deleted their data (`deleted`): readers never see a shard listed in
        `shards` that is gone, and the budget counts the bytes until they are. Returns the names
        still to delete (this call's and any an earlier, killed caller left)."""
        with self.loc.lock():
            m = self.read()
            rec = m.setdefault("consumers", {}).setdefault(consumer, {"finished": []})
            done = set(rec["finished"])
            rec["finished"] = sorted(done | set(finished))
            rec["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            if release:
                mine = set(finished)
                keep, gone = [], []
                for s in m["shards"]:
                    (gone if s["name"] in mine else keep).append(s)
                m["shards"] = keep
                m.setdefault("released", []).extend(gone)
                m["released"].sort(key=lambda s: s["name"])
                m["releasing"] = sorted(set(m.get("releasing", [])) | {s["name"] for s in gone})
                _update_totals(m)
            self.loc.write_json_atomic(MANIFEST, m)
            return list(m.get("releasing", []))

    def deleted(self, names: list[str]) -> None:
        """The data of these released shards is gone from storage: the budget stops counting it."""
        with self.loc.lock():
            m = self.read()
            left = sorted(set(m.get("releasing", [])) - set(names))
            if left:
                m["releasing"] = left
            else:
                m.pop("releasing", None)
            self.loc.write_json_atomic(MANIFEST, m)


def committed_names(m: dict) -> set[str]:
    """Shards that have been committed: on storage (`shards`) or consumed and deleted (`released`)."""
    return {s["name"] for s in m["shards"]} | {s["name"] for s in m.get("released", [])}


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def edited_problem(m: dict) -> str | None:
    """Why a manifest that says `complete` cannot be what extract committed (an entry removed or a
    figure changed by hand), or None. A reader would otherwise train on part of the cache without
    a word; extract itself re-makes what is missing, so it does not use this check."""
    if m.get("status") != "complete":
        return None
    have, planned = len(committed_names(m)), m["plan"]["num_shards"]
    rerun = "run the extract command that made it again (it re-makes the missing shards)"
    if have != planned:
        if have > planned:
            return (f"it says complete but lists {have} shards where its plan has {planned} (an entry added by hand?); "
                    "restore manifest.json from a copy, or extract into a new --cache")
        return f"it says complete but lists {have} of the {planned} planned shards (an entry removed by hand?); {rerun}"
    sums = {k: sum(int(s[k]) for s in m["shards"]) for k in ("samples", "tokens", "bytes")}
    stated = {k: m["totals"].get(k) for k in sums}
    if sums != stated:
        return (f"its totals {json.dumps(stated)} are not the sums of its shards {json.dumps(sums)} (edited by hand?); "
                "restore manifest.json")
    return None


def binds_nothing(m: dict) -> bool:
    """A manifest that holds no work: no shard committed (or consumed and released) and no trainer
    following it, as an earlier attempt leaves that failed before its first commit (a bad row or
    option found in a worker, a target that does not load). Its settings do not bind the cache."""
    return not committed_names(m) and not m.get("consumers") and not m.get("releasing")


def occupancy(m: dict) -> int:
    """Bytes the budget counts: committed shards on storage, released shards whose data is not
    deleted yet, and admitted shards in flight."""
    releasing = set(m.get("releasing", []))
    return (sum(s["bytes"] for s in m["shards"]) + sum((m.get("reserved") or {}).values())
            + sum(s["bytes"] for s in m.get("released", []) if s["name"] in releasing))


def _update_totals(m: dict) -> None:
    m["totals"] = {
        "samples": sum(s["samples"] for s in m["shards"]),
        "tokens": sum(s["tokens"] for s in m["shards"]),
        "bytes": sum(s["bytes"] for s in m["shards"]),
    }
    if m.get("released"):
        m["totals_released"] = {k: sum(s[k] for s in m["released"]) for k in ("samples", "tokens", "bytes")}
    if len(committed_names(m)) == m["plan"]["num_shards"] and m["status"] != "complete":
        m["status"] = "complete"
        m["completed"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def id_ranges(ids) -> list[list[int]]:
    """Sorted ids -> inclusive ranges: [0,1,2,5] -> [[0,2],[5,5]]."""
    out: list[list[int]] = []
    for i in sorted(int(x) for x in ids):
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out
