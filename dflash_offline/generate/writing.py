"""A generate worker's parts: decoded, written as one Parquet part each and committed in the manifest.

Padded batches decode one part at a time. The continuous decoder takes the worker's parts as one
stream (continuous.ContinuousDecoder.decode_parts): once every prompt of a part holds a slot, the
next part's prompts take the slots that free up. Drained at each part's end, the slots would idle
on the part's longest replies, and with generate's GPU defaults (2048 prompts a part, 2048 slots of
128 + 384 tokens) each part would decode as one padded batch. A part is committed as its last
prompt ends; parts may end out of order (the manifest lists them by name, and a rerun redoes the
parts it does not list).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from dflash_offline.cache.manifest import id_ranges
from dflash_offline.rows import parts
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.logs import heartbeat
from dflash_offline.runtime.signals import stop_requested

log = logging.getLogger("dflash.generate")


class PartWriter:
    """Commits a worker's parts and counts its prompts (the heartbeat, the bar, crash-test points)."""

    def __init__(self, folder: Path, store, tracker):
        self.folder, self.store, self.tracker = folder, store, tracker
        self.prompts_done = 0

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

    def write(self, name: str, ids: list[int], prompts: list[list[int]], new: list, eos_end: list[bool]) -> None:
        """Write one part's completions and commit it."""
        self.tracker.flush()
        entry = parts.write_completions(self.folder, name, ids, prompts, new, eos_end)
        entry["ids"] = id_ranges(ids)
        self.commit(entry)


def stream_parts(decoder, mine: list[int], load: Callable[[int], tuple[list[list[int]], list[int]]],
                 name_of: Callable[[int], str], writer: PartWriter) -> int:
    """This worker's parts through the continuous decoder as one stream. A stop request ends the
    stream after the parts begun, which are committed. -> how many parts were not started."""
    from dflash_offline.generate.continuous import Part

    started = 0
    ids_of: dict[int, list[int]] = {}

    def parts():
        nonlocal started
        for j in mine:
            if stop_requested():
                log.info("stop requested: %d of this worker's parts not started (%s first)", len(mine) - started,
                         name_of(j))
                return
            prompts, ids = load(j)
            ids_of[j] = ids
            started += 1
            yield Part(j, name_of(j), prompts, ids)

    def on_part(part: Part, new: list, eos_end: list[bool]) -> None:
        writer.write(part.name, ids_of.pop(part.handle), part.prompts, new, eos_end)

    decoder.decode_parts(parts(), lambda j: writer.prompts_ended(name_of(j), 1), on_part)
    writer.tracker.flush()
    return len(mine) - started
