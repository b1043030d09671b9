"""What a cache manifest must hold for this version to read it: the format and version, every
key the schema (manifests/cache-manifest.schema.json) requires, and each field's shape and range.
`check_manifest` is the one check every reader (train, eval, inspect, verify, status) and extract
go through (cache/manifest.py's ManifestStore.read): a hand edit or another program's file is one
line naming the key, never a KeyError deep in a reader. No torch, no storage."""

from __future__ import annotations

import json
import re

from dflash_offline.runtime.errors import UserError

FORMAT = "dflash-offline/cache"
VERSION = 1

# What a reader does about a manifest it cannot use as it is (damaged, another program's file).
DAMAGED_FIX = "restore manifest.json from a copy, or extract into a new --cache"

# What a reader relies on, as the schema (manifests/cache-manifest.schema.json) says it: every key a
# cache manifest has, the states, the storage dtypes this version reads, a shard's name (a folder
# name under shards/, never a path: "../x" would lead a reader out of the cache) and checksum.
REQUIRED_KEYS = ("format", "version", "status", "target", "capture", "plan", "shards", "totals")
STATUSES = ("extracting", "complete")
HIDDEN_DTYPES = ("bfloat16", "float8_e4m3fn")
SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
CHECKSUM = re.compile(r"(crc32c|sha256):[0-9a-f]{64}")
INT64_MAX = 2 ** 63 - 1  # sample ids are stored as int64


def describe(v) -> str:
    """A value as its JSON, cut to a line (a message quotes it in its own type)."""
    s = json.dumps(v)
    return s if len(s) < 120 else s[:117] + "..."


def _json_kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}.get(
        type(v), "a number")


def check_manifest(m, where: str) -> None:
    """Refuse, as one UserError naming the key, a manifest this version cannot read as a cache's:
    not a JSON object, another format, a key missing, a newer version, or a field of the wrong
    shape or range (`_malformed`). The one check every reader (train, eval, inspect, verify,
    status) and extract go through, in ManifestStore.read."""
    def damaged(what: str) -> UserError:
        return UserError(f"{where}: damaged or not a dflash-offline manifest ({what}); {DAMAGED_FIX}")

    if not isinstance(m, dict):
        raise damaged(f"the file holds {_json_kind(m)}, not an object")
    if "format" in m and m["format"] != FORMAT:
        raise UserError(f"{where}: not a dflash-offline cache manifest (format {describe(m['format'])}, not "
                        f"\"{FORMAT}\"): damaged or another program's file; {DAMAGED_FIX}")
    missing = [k for k in REQUIRED_KEYS if k not in m]
    if missing:
        raise damaged(f"no {', '.join(missing)}")
    v = m["version"]
    if _is_int(v) and v > VERSION:
        raise UserError(f"{where}: cache format version {v} but this tool writes {VERSION}: the cache was written by a "
                        "newer dflash-offline; upgrade dflash-offline to read it, or extract into a new --cache (see "
                        "docs/cache-format.md)")
    if not _is_int(v) or v != VERSION:
        raise damaged(f"version is {describe(v)}, not {VERSION}")
    wrong = _malformed(m)
    if wrong:
        raise damaged(wrong)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _malformed(m: dict) -> str | None:
    """The first field every reader relies on that has the wrong shape or range (a hand edit,
    another program's file), or None: named in one line rather than met as a KeyError deep in a
    reader, or as a value shown or used as if it were right (a path out of the cache, ids no
    shard holds)."""
    if m["status"] not in STATUSES:
        return f"status is {describe(m['status'])}, not " + " or ".join(f'"{s}"' for s in STATUSES)
    # An empty target or capture is a synthetic cache's (benchmarks, tests); a filled one is read.
    if not isinstance(m["target"], dict):
        return "target is not an object"
    if m["target"] and (not _ints(m["target"], ("num_layers", "hidden_size", "vocab_size"))
                        or not isinstance(m["target"].get("model_type"), str)):
        return "target lacks a model_type and integer num_layers, hidden_size and vocab_size"
    if not isinstance(m["capture"], dict):
        return "capture is not an object"
    return _capture_problem(m["capture"]) or _counts_problem(m) or _lists_problem(m)


def _ints(d, keys) -> bool:
    return isinstance(d, dict) and all(_is_int(d.get(k)) for k in keys)


def _count(d: dict, key: str, section: str, least: int = 0) -> str | None:
    """`section.key`, when present, is an integer >= least."""
    if key in d and (not _is_int(d[key]) or d[key] < least):
        return f"{section}{key} is {describe(d[key])}, not an integer >= {least}"
    return None


def _capture_problem(capture: dict) -> str | None:
    """What is wrong with the manifest's capture: its layer ids, dtype, top-k and length."""
    ids = capture.get("layer_ids")
    if "layer_ids" in capture and (not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids)):
        return f"capture.layer_ids is not a list of integers (it holds {json.dumps(ids)})"
    if ids and (ids[0] < 0 or any(b <= a for a, b in zip(ids, ids[1:]))):
        return f"capture.layer_ids is not a list of increasing layer numbers >= 0 (it holds {describe(ids)})"
    if capture:
        lacking = [k for k in ("layer_ids", "topk", "hidden_dtype") if k not in capture]
        if lacking:
            return f"capture has no {', '.join(lacking)}"
    if "hidden_dtype" in capture and capture["hidden_dtype"] not in HIDDEN_DTYPES:
        return (f"capture.hidden_dtype is {describe(capture['hidden_dtype'])}, not "
                + " or ".join(f'"{d}"' for d in HIDDEN_DTYPES))
    return _count(capture, "topk", "capture.") or (capture.get("max_len") is not None
                                                   and _count(capture, "max_len", "capture.", 1)) or None


def _counts_problem(m: dict) -> str | None:
    """What is wrong with the plan's and totals' counts and the byte budget."""
    if not _ints(m["plan"], ("num_shards",)):
        return "plan.num_shards is not an integer"
    problem = _count(m["plan"], "num_shards", "plan.") or _count(m["plan"], "tokens", "plan.")
    if problem:
        return problem
    if not _ints(m["totals"], ("samples", "tokens", "bytes")):
        return "totals lacks integer samples, tokens and bytes"
    for k in ("samples", "tokens", "bytes"):
        if problem := _count(m["totals"], k, "totals."):
            return problem
    for key in ("budget_bytes", "max_shard_bytes"):
        if m.get(key) is not None and (problem := _count(m, key, "")):
            return problem
    return None


def _lists_problem(m: dict) -> str | None:
    """What is wrong with the shard lists (committed, released, releasing), the reservations and
    the consumers."""
    for key in ("shards", "released"):
        entries = m.get(key, [])
        if not isinstance(entries, list):
            return f"{key} is not a list"
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or not isinstance(e.get("name"), str):
                return f"{key}[{i}] has no name"
            if not SHARD_NAME.fullmatch(e["name"]):
                return (f"{key}[{i}] is named {describe(e['name'])}, not a shard name (letters, digits, '.', '_' and "
                        "'-', not a path)")
    for i, e in enumerate(m["shards"]):
        problem = _shard_problem(e)
        if problem:
            return f"shards[{i}] ({e['name']}){problem}"
    releasing = m.get("releasing", [])
    if not isinstance(releasing, list) or not all(isinstance(n, str) and SHARD_NAME.fullmatch(n) for n in releasing):
        return f"releasing is not a list of shard names (it holds {describe(releasing)})"
    reserved = m.get("reserved") or {}
    if not isinstance(reserved, dict) or not all(_is_int(b) and b >= 0 for b in reserved.values()):
        return f"reserved is not an object of shard names and byte counts (it holds {describe(reserved)})"
    consumers = m.get("consumers") or {}
    if not isinstance(consumers, dict) or not all(isinstance(c, dict) and isinstance(c.get("finished"), list)
                                                  for c in consumers.values()):
        return f"consumers is not an object of trainers, each with its finished shards (it holds {describe(consumers)})"
    return None


def _shard_problem(e: dict) -> str | None:
    """What is wrong with one entry of `shards` (its name already checked), as the end of a
    sentence that starts with the entry's place: " lacks ...: no checksum", ": sample_ids ..."."""
    lacks = " lacks integer samples, tokens, bytes, a checksum or its sample_ids"
    for k in ("samples", "tokens", "bytes", "checksum", "sample_ids"):
        if k not in e:
            return f"{lacks}: no {k}"
    for k in ("samples", "tokens", "bytes"):
        if not _is_int(e[k]):
            return f"{lacks}: {k} is {describe(e[k])}"
        if e[k] < 0:
            return f": {k} is {e[k]}, not an integer >= 0"
    if not isinstance(e["checksum"], str):
        return f"{lacks}: checksum is {describe(e['checksum'])}"
    if not CHECKSUM.fullmatch(e["checksum"]):
        return f": checksum is {describe(e['checksum'])}, not crc32c: or sha256: and 64 hex digits"
    ranges = e["sample_ids"]
    if not isinstance(ranges, list):
        return f"{lacks}: sample_ids is {describe(ranges)}"
    if not all(isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r) for r in ranges):
        return ": sample_ids is not a list of [first, last] integer id ranges"
    for k, (a, b) in enumerate(ranges):
        if not 0 <= a <= b <= INT64_MAX:
            return (f": sample_ids holds [{a}, {b}], not an id range [first, last] with 0 <= first <= last <= "
                    f"{INT64_MAX}")
        if k and a < ranges[k - 1][0]:  # extract writes them sorted (an id may repeat: a benchmark's rows)
            return f": sample_ids is not sorted ([{a}, {b}] follows [{ranges[k - 1][0]}, {ranges[k - 1][1]}])"
    return None
