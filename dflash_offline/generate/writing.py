"""A generate worker's parts: decoded, written as one Parquet part each and committed in the manifest.

Padded batches decode one part at a time. The continuous decoder takes the worker's parts as one
stream (continuous.ContinuousDecoder.decode_parts): once every prompt of a part holds a slot, the
next part's prompts take the slots that free up. Drained at each part's end, the slots would idle
on the part's longest replies, and with generate's GPU defaults (2048 prompts a part, 2048 slots of
128 + 384 tokens) each part would decode as one padded batch. A part is committed as its last
prompt ends; parts may end out of order (the manifest lists them by name, and a rerun redoes the
parts it does not list). A stop within a step keeps the finished rows of the parts in progress
(held.py), and the rerun decodes only their other prompts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np

from dflash_offline.cache.manifest import id_ranges
from dflash_offline.generate.held import PartRows, keep, read_kept
from dflash_offline.generate.plan import make_batches
from dflash_offline.rows import parts
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.logs import heartbeat
from dflash_offline.runtime.signals import StopNow, stop_requested

log = logging.getLogger("dflash.generate")


class PartWriter:
    """Commits a worker's parts and counts its prompts (the heartbeat, the bar, crash-test points)."""

    def __init__(self, folder: Path, store, tracker, manifest: dict):
        self.folder, self.store, self.tracker = folder, store, tracker
        self.prompts_done = 0
        self.manifest = manifest  # as this worker found it: the rows a stop kept

    def rows(self, name: str, prompts: list[list[int]], ids: list[int]) -> PartRows:
        """Part `name`'s prompts, less the rows an earlier stop kept of it."""
        rows = PartRows(name, prompts, ids, read_kept(self.folder, self.manifest, name))
        if rows.kept:
            log.info("%s: %d prompts to decode, %d kept by a stop", name, len(rows.left_ids), len(rows.kept))
        return rows

    def hold(self, rows: PartRows, new_left: list, eos_left: list[bool]) -> int:
        """A stop within a step: keep the finished rows of this part in progress (held.py)."""
        return keep(self.folder, self.store, rows, new_left, eos_left)

    def batch_done(self, part: str) -> None:
        """After each decoded batch: the heartbeat (the tokens went with the tracker), a crash-test point."""
        heartbeat(phase="generate", part=part, prompts_done=self.prompts_done)
        fault_point("generate-batch")

    def prompts_ended(self, part: str, n: int, flush: bool = False) -> None:
        self.prompts_done += n
        self.tracker.completed(prompts=n)
        if flush:
            self.tracker.flush()
        self.batch_done(part)

    def commit(self, entry: dict) -> None:
        """List a part whose file is written and renamed."""
        fault_point("part-renamed")
        self.store.commit_part(entry)
        log.info("committed %s: %d rows, %d new tokens", entry["name"], entry["rows"], entry["new_tokens"])
        fault_point("part-committed")

    def write(self, rows: PartRows, new_left: list, eos_left: list[bool]) -> None:
        """Write one part's completions (the rows a stop kept and those decoded now) and commit it."""
        self.tracker.flush()
        new, eos_end = rows.whole(new_left, eos_left)
        entry = parts.write_completions(self.folder, rows.name, rows.ids, rows.prompts, new, eos_end)
        entry["ids"] = id_ranges(rows.ids)
        self.commit(entry)


def stream_parts(decoder, mine: list[int], load: Callable[[int], tuple[list[list[int]], list[int]]],
                 name_of: Callable[[int], str], writer: PartWriter) -> int:
    """This worker's parts through the continuous decoder as one stream. A stop request ends the
    stream after the parts begun, which are committed. -> how many parts were not started."""
    from dflash_offline.generate.continuous import Part

    started = 0
    rows_of: dict[int, PartRows] = {}

    def parts():
        nonlocal started
        for j in mine:
            if stop_requested():
                log.info("stop requested: %d of this worker's parts not started (%s first)", len(mine) - started,
                         name_of(j))
                return
            rows = rows_of[j] = writer.rows(name_of(j), *load(j))
            started += 1
            yield Part(j, rows.name, rows.left_prompts, rows.left_ids)

    def on_part(part: Part, new: list, eos_end: list[bool]) -> None:
        writer.write(rows_of.pop(part.handle), new, eos_end)

    def on_stop(part: Part, new: list, eos_end: list[bool]) -> None:
        writer.hold(rows_of[part.handle], new, eos_end)

    decoder.decode_parts(parts(), lambda j: writer.prompts_ended(name_of(j), 1), on_part, on_stop)
    writer.tracker.flush()
    return len(mine) - started


def write_padded_part(name: str, part: tuple[list[list[int]], list[int]], rows_per_batch: int, decoder,
                      writer: PartWriter) -> None:
    """A part of a prompt input ((prompts, ids)) through the padded decoder, batch by batch, less
    the rows a stop kept, then its commit; a stop within a batch keeps the batches that ended."""
    rows = writer.rows(name, *part)
    prompts, ids = rows.left_prompts, rows.left_ids
    new: list[list[int] | None] = [None] * len(prompts)
    eos_end = [False] * len(prompts)
    try:
        for batch in make_batches(np.asarray([len(p) for p in prompts], dtype=np.int64), rows_per_batch):
            res = decoder.decode([prompts[k] for k in batch], [ids[k] for k in batch])
            for k, toks, ended in zip(batch, res.tokens, res.ended_by_eos):
                new[k], eos_end[k] = toks, ended
            log.info("batch of %d prompts: %d new tokens in %.2fs (prefill %.2fs, %d steps)", len(batch),
                     sum(len(t) for t in res.tokens), res.seconds, res.prefill_s, res.steps)
            writer.prompts_ended(name, len(batch), flush=True)
    except StopNow:
        writer.hold(rows, new, eos_end)
        raise
    writer.write(rows, new, eos_end)
