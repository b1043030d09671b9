"""generate's plan, as plain data: the chunks of prompts (one part each, the unit of commit and
resume), the batches within a chunk, and the Job a worker process receives. A pure function of the
input and the settings (launcher.py's preflight builds it; docs/generate.md, "What is decided how")."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dflash_offline.config import GenerateConfig
from dflash_offline.generate.progress import Todo
from dflash_offline.options import replaced, where as origin
from dflash_offline.runtime.errors import UserError

log = logging.getLogger("dflash.generate")

GPU_CHUNK_PROMPTS, CPU_CHUNK_PROMPTS = 2048, 64  # --chunk-prompts' defaults (config.py says why)


@dataclass
class Job:
    """Everything a worker needs (it crosses a process spawn before the log opens: its fields are
    plain data and the config's light dataclass)."""

    cfg: GenerateConfig
    folder: str  # where parts, manifest and logs go
    target_path: str
    source: dict  # data.Source as plain fields
    chunks: list[np.ndarray]  # global rows of each chunk (one part each)
    compute_dtype: str
    eos: list[int]
    rows_per_batch: int
    max_prompt_len: int
    compile: bool
    chat: dict | None = None  # conversation prompts (a prepare output): its chat settings and template
    max_positions: int | None = None
    turns: np.ndarray | None = None  # conversation prompts: the replies the target writes for each row
    copies: int = 1  # --samples-per-prompt: plan row r is copy r % copies of global row r // copies


def make_chunks(num_rows: int, chunk_prompts: int) -> list[np.ndarray]:
    return [np.arange(a, min(a + chunk_prompts, num_rows), dtype=np.int64) for a in range(0, num_rows, chunk_prompts)]


def make_batches(lengths: np.ndarray, rows: int) -> list[np.ndarray]:
    """Positions within a chunk -> batches of at most `rows`, longest prompts first (ties in input
    order): a batch's prompts are padded to its longest, so similar lengths waste little."""
    order = np.lexsort((np.arange(lengths.shape[0]), -lengths))
    return [order[a:a + rows] for a in range(0, order.shape[0], rows)]


class Preflight(NamedTuple):
    """What the launcher's preflight hands on: the workers' job, the manifest the output must have,
    the devices, and the work still to do (for the bar)."""

    job: Job
    wanted: dict  # the generate manifest this run writes or continues (rows/parts.py)
    devices: list[str]
    todo: Todo


DEFAULT_NEW_TOKENS = 2048


def resolve_new_tokens(cfg: GenerateConfig, lengths: np.ndarray, info, most_turns: int = 1) -> GenerateConfig:
    """--max-new-tokens left out: 2048, or what the target's context leaves after the longest
    prompt where that is less (a 2048-position target and 2048 new tokens never fit); for
    conversations of up to `most_turns` replies, that room shared among the replies (rounded down
    to a multiple of 64), so that a conversation whose every reply runs to the limit still reaches
    its last turn instead of ending at "context full". Said in the log."""
    if cfg.max_new_tokens is not None:
        return cfg
    longest = int(lengths.max())
    room = DEFAULT_NEW_TOKENS if info.max_positions is None else info.max_positions - longest
    if room < 1:
        raise UserError(f"{origin(cfg, 'prompts')}: the longest prompt, {longest} tokens, fills the target's context "
                        f"({info.max_positions} positions): no room for a new token; leave out the longest prompts")
    new = min(DEFAULT_NEW_TOKENS, room)
    if most_turns > 1 and info.max_positions is not None:
        share = room // most_turns
        new = min(new, max(1, share // 64 * 64 if share >= 64 else share))
        log.info("--max-new-tokens %d: the target's %d positions less the longest first prompt (%d tokens), shared "
                 "by up to %d replies per conversation", new, info.max_positions, longest, most_turns)
    elif new < DEFAULT_NEW_TOKENS:
        log.info("--max-new-tokens %d: the target's %d positions less the longest prompt (%d tokens)", new,
                 info.max_positions, longest)
    return replaced(cfg, max_new_tokens=new)
