"""What extract may delete as debris of a killed run in a cache folder, and what it must not: an
uncommitted shard folder is debris only if it holds nothing but what Zarr writes (metadata and
numbered chunks); anything else in shards/ is a user's, refused in one line, never removed."""

from __future__ import annotations

import os
import re

from dflash_offline.runtime.errors import UserError

# The folders extract writes under shards/ (a committed shard, one being written), and what Zarr
# writes inside one: zarr.json, array folders holding their zarr.json and chunk files under c/
# (named by chunk index), and the `NAME.<32 hex>.partial` files of a write Zarr had not finished.
SHARD_FOLDER = re.compile(r"(tmp-)?shard-[0-9]{6,}\.zarr")
_META = re.compile(r"zarr\.json|zarr\.[0-9a-f]{32}\.partial")
_ARRAY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CHUNK = re.compile(r"[0-9]+(\.[0-9a-f]{32}\.partial)?")


def _foreign_in_shard(folder: str) -> str | None:
    """The first entry of a shard folder (relative to it) that Zarr does not write, or None. An
    entry that vanishes while it is read (a live writer's partial file renamed) is not foreign."""

    def kind(path: str) -> str:
        if os.path.islink(path):
            return "link"
        return "dir" if os.path.isdir(path) else "file" if os.path.isfile(path) else (
            "gone" if not os.path.lexists(path) else "other")

    def names(path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    for name in names(folder):
        path = os.path.join(folder, name)
        k = kind(path)
        if k == "gone" or (k == "file" and _META.fullmatch(name)):
            continue
        if k != "dir" or not _ARRAY.fullmatch(name):
            return name
        for sub in names(path):  # an array: its zarr.json and its chunks under c/
            sub_path = os.path.join(path, sub)
            sk = kind(sub_path)
            if sk == "gone" or (sk == "file" and _META.fullmatch(sub)):
                continue
            if sk != "dir" or sub != "c":
                return f"{name}/{sub}"
            for dirpath, dirnames, filenames in os.walk(sub_path):
                for n in sorted(dirnames + filenames):
                    nk = kind(os.path.join(dirpath, n))
                    if nk == "gone":
                        continue
                    if nk not in ("dir", "file") or not _CHUNK.fullmatch(n) or (nk == "dir" and "." in n):
                        return os.path.relpath(os.path.join(dirpath, n), folder)
    return None


def foreign_in_shards(cache: str, committed: set[str] | None = None, everything: bool | None = None) -> str | None:
    """The first path under CACHE/shards/ (relative to CACHE) that extract would delete as debris
    of an interrupted run but did not write, or None. A local cache only.

    `committed`: the names the manifest commits (None: there is no manifest). `everything`
    (default: when there is no manifest): everything in shards/ must be an uncommitted shard
    folder (a manifest that binds nothing has its shards/ removed whole). Otherwise only the
    uncommitted shard folders are looked at (a worker deletes those of its shards before writing
    them again); other names are left alone. A shard folder is debris only if it holds nothing
    but what Zarr writes."""
    if everything is None:
        everything = committed is None
    root = os.path.join(cache, "shards")
    try:
        entries = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return None if not os.path.isfile(root) else "shards"
    for name in entries:
        path = os.path.join(root, name)
        if SHARD_FOLDER.fullmatch(name):
            if committed is not None and name.startswith("shard-") and name[:-len(".zarr")] in committed:
                continue  # committed: never deleted, never looked into here
            if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
                return f"shards/{name}"
            bad = _foreign_in_shard(path)
            if bad is not None:
                return f"shards/{name}/{bad}"
        elif everything and os.path.lexists(path):
            return f"shards/{name}"
    return None


def refuse_foreign_shards(cache: str, option: str = "--cache", committed: set[str] | None = None,
                          everything: bool | None = None) -> None:
    """Refuse, in one line and before anything is deleted, a cache location whose shards/ holds
    something extract did not write where it would delete debris (`foreign_in_shards`): nothing
    the tool did not create is deleted. `committed`, `everything` as for `foreign_in_shards`."""
    bad = foreign_in_shards(cache, committed, everything)
    if bad is None:
        return
    if committed is None:
        raise UserError(f"{option} {cache}: the folder exists, is not empty and is not a cache (no manifest.json; it "
                        f"holds {bad}, which extract does not write); choose a new or empty folder, "
                        f"or move {bad} out of it (nothing is overwritten)")
    raise UserError(f"{option} {cache}: {bad} was not written by extract (an uncommitted shard folder holds only Zarr "
                    "metadata and chunks), and resuming would delete it as debris of an interrupted run; move it out "
                    "of the cache (nothing was changed)")
