"""Rows a stop kept: the finished rows of the parts in progress when `generate` was stopped.

A part is the unit of commit, and on a CPU it holds 64 prompts of minutes each: dropping the parts
in progress on a stop threw those minutes away. So a stop within a decoding step writes the rows of
each part in progress that have ended (`part-00003.held-N.parquet`, N rows, written and renamed like
a part; a later stop writes a file of more rows before the manifest lists it in place of the first)
and lists the file under the manifest's `held`, the commit point as for parts. The rerun decodes
only the part's other prompts and commits the part whole: its held rows and the new ones in the
part's order, the file an uninterrupted run writes (a row does not depend on the batch it lands in:
sampling noise is keyed by the row's id). That commit drops the `held` entry in the same manifest
replace; the held file goes after it. A held file the manifest does not list is debris of a killed
run, removed on resume like a part's.

Conversations (parts of chat turns) are not held: a conversation's turns hang together, and its part
is answered anew.

No torch here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dflash_offline.rows import parts
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.paths import file_sha256

log = logging.getLogger("dflash.generate")


def held_name(part: str, rows: int) -> str:
    """part-00003.held-12: each keep writes a new file (more rows), listed before the last one goes."""
    return f"{part}.held-{rows}"


class PartRows:
    """One part's prompts in the part's order, the rows a stop kept of it (id -> (new tokens, ended
    by eos)), and what is left to decode (`left_prompts`, `left_ids`)."""

    def __init__(self, name: str, prompts: list[list[int]], ids: list[int], kept: dict[int, tuple[list[int], bool]]):
        self.name, self.prompts, self.ids, self.kept = name, prompts, ids, kept
        left = [k for k, i in enumerate(ids) if i not in kept]
        self.left_prompts, self.left_ids = [prompts[k] for k in left], [ids[k] for k in left]

    def whole(self, new_left: list, eos_left: list[bool]) -> tuple[list[list[int]], list[bool]]:
        """The part's new tokens and eos flags in its order: the kept rows and the decoded ones."""
        got = self.finished(new_left, eos_left)
        return [got[i][0] for i in self.ids], [got[i][1] for i in self.ids]

    def finished(self, new_left: list, eos_left: list[bool]) -> dict[int, tuple[list[int], bool]]:
        """The rows ended so far (the kept ones and the left ones whose tokens came back: not None)."""
        got = dict(self.kept)
        got.update({i: (t, e) for i, t, e in zip(self.left_ids, new_left, eos_left) if t is not None})
        return got


def read_kept(folder: Path, manifest: dict, part: str) -> dict[int, tuple[list[int], bool]]:
    """The rows a stop kept of `part` (id -> (new tokens, ended by eos)); {} when none. A listed held
    file that is gone or changed is refused: committed data never changes."""
    import pyarrow.parquet as pq

    entry = (manifest.get("held") or {}).get(part)
    if entry is None:
        return {}
    f = folder / entry["file"]
    if not f.is_file() or file_sha256(f) != entry["sha256"]:
        raise UserError(f"{f}: the rows a stop kept of {part} are {'missing' if not f.is_file() else 'changed'} "
                        f"(its manifest lists them); {parts.damaged_fix(manifest)}")
    t = pq.read_table(f).to_pydict()
    out = {}
    for i, seq, mask, why in zip(t["id"], t["input_ids"], t["loss_mask"], t["finish_reason"]):
        n = len(mask) - sum(mask)  # the prompt's tokens (mask 0) come first
        out[int(i)] = (list(seq[n:]), why == "eos")
    return out


def keep(folder: Path, store, rows: PartRows, new_left: list, eos_left: list[bool]) -> int:
    """Write and list the finished rows of a part in progress (those a stop kept before included).
    -> how many rows it holds (0: nothing written)."""
    got = rows.finished(new_left, eos_left)
    if not got or len(got) == len(rows.kept):
        return len(got)
    ids = [i for i in rows.ids if i in got]
    prompt_of = dict(zip(rows.ids, rows.prompts))
    entry = parts.write_completions(folder, held_name(rows.name, len(ids)), ids, [prompt_of[i] for i in ids],
                                    [got[i][0] for i in ids], [got[i][1] for i in ids])
    store.hold(rows.name, entry)
    log.info("stop: %s keeps %d of its %d rows (%s)", rows.name, len(ids), len(rows.ids), entry["file"])
    return len(ids)


def to_do(chunks: list, todo: list[int], manifest: dict | None) -> list:
    """The rows of parts `todo` left to decode, for the bar: each part's rows less those a stop kept
    (their count; which ones does not matter to a count)."""
    held = (manifest or {}).get("held") or {}
    return [chunks[j][:len(chunks[j]) - held.get(parts.part_name(j), {}).get("rows", 0)] for j in todo]

