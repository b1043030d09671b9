"""Progress of `generate` in new tokens, so that the bar moves and gives an ETA within a batch.

A batch decodes for as long as its longest row: one batch holding every conversation of a CPU run
went 11 minutes without completing a prompt, and a bar of prompts stood at 0. So the bar counts
new tokens as they are decoded, against an upper bound of the work: every prompt (every turn, for
conversations) not finished may take up to --max-new-tokens; a row that ends early (its
end-of-sequence token) takes its unused tokens off the bound, and a conversation cut short its
unwritten turns. The bar's rate is the token rate and its ETA an upper bound at that rate; the
prompts (or conversations and turns) completed are shown beside it.

Worker side: a `Tracker` the decoder reports to from its loop (decoding.py, at most every
`REPORT_EVERY_S`: one device sync each time) and the launcher's loop tells of completed prompts
and turns; it sends `Progress` deltas, to the launcher's queue or straight to this process's `Bar`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

import numpy as np

from dflash_offline.runtime.logs import heartbeat

log = logging.getLogger("dflash.generate")

REPORT_EVERY_S = 0.5  # a worker's progress messages (and the decoder's syncs for them), at most this often
LOG_EVERY_S = 60.0  # a progress line in the log file (a run without a terminal shows it there)


class Progress(NamedTuple):
    """A worker's progress since its previous message (deltas: several workers' add up)."""

    tokens: int = 0  # new tokens decoded
    bound: int = 0  # change of the bound on all new tokens (<= 0: rows that ended early, turns not written)
    prompts: int = 0  # prompts (conversations) completed
    turns: int = 0  # turns completed (conversations)

    def __add__(self, other: "Progress") -> "Progress":  # type: ignore[override]
        return Progress(*(a + b for a, b in zip(self, other)))


class Todo(NamedTuple):
    """The work to do: prompts, and for conversation prompts the turns they hold (None otherwise)."""

    prompts: int
    turns: int | None

    def bound(self, max_new_tokens: int) -> int:
        return (self.prompts if self.turns is None else self.turns) * max_new_tokens


def turns_per_row(source, last_only: bool) -> np.ndarray:
    """How many replies the target writes for each conversation prompt (turns.py's reply slots)."""
    import pyarrow.parquet as pq

    from dflash_offline.generate.turns import parse_conversation

    counts = []
    for f in source.files:
        for text in pq.read_table(f.path, columns=["messages"]).column(0).to_pylist():
            counts.append(len(parse_conversation(0, text, last_only).slots) if text else 0)
    return np.asarray(counts, dtype=np.int64)


def todo_of(chunks: list[np.ndarray], turns: np.ndarray | None) -> Todo:
    prompts = sum(len(c) for c in chunks)
    return Todo(prompts, None if turns is None else int(sum(int(turns[c].sum()) for c in chunks)))


class Tracker:
    """A worker's progress, fed by the decoder's loop (`batch_start`, `batch_step`) and by its own
    (`completed`); what has changed goes to `send` at most every `every_s` (and on `flush`)."""

    def __init__(self, send: Callable[[Progress], None], every_s: float = REPORT_EVERY_S):
        self.send = send
        self.every_s = every_s
        self._made = self._batch_bound = 0  # the current batch's tokens and bound as last reported
        self._pending = Progress()
        self._sent_at = time.monotonic()
        self.tokens = 0  # this worker's new tokens so far

    def batch_start(self, bound: int) -> None:
        """A batch begins whose rows may take `bound` new tokens (rows x --max-new-tokens)."""
        self._made, self._batch_bound = 0, bound

    def batch_step(self, made: int, bound: int) -> None:
        """The batch has `made` new tokens and may take `bound` in all (made + rows running x tokens left)."""
        self._add(Progress(made - self._made, bound - self._batch_bound))
        self._made, self._batch_bound = made, bound

    def completed(self, prompts: int = 0, turns: int = 0, bound: int = 0) -> None:
        self._add(Progress(0, bound, prompts, turns))

    def due(self) -> bool:
        return time.monotonic() - self._sent_at >= self.every_s

    def _add(self, p: Progress) -> None:
        self._pending += p
        self.tokens += p.tokens
        if self.due():
            self.flush()

    def flush(self) -> None:
        if self._pending != Progress():
            self.send(self._pending)
            self._pending = Progress()
        self._sent_at = time.monotonic()
        heartbeat(phase="generate", tokens_done=self.tokens)


class Bar:
    """The terminal's bar (tqdm, new tokens against their bound) and the log's progress line, fed
    `Progress` from this process's tracker or from the workers' messages."""

    def __init__(self, todo: Todo, max_new_tokens: int, show: bool, desc: str = "generate"):
        from tqdm import tqdm

        self.todo = todo
        self.bar = tqdm(total=todo.bound(max_new_tokens), unit="tok", unit_scale=True, desc=desc, disable=not show,
                        dynamic_ncols=True, smoothing=0.1)
        self.done = Progress()
        self.t0: float | None = None  # the first tokens: the rate leaves out the start-up (the model's load)
        self._logged = time.monotonic()

    def what(self) -> str:
        """Prompts (conversations and turns) completed, and the bound's meaning."""
        d, t = self.done, self.todo
        if t.turns is None:
            return f"{d.prompts}/{t.prompts} prompts"
        return f"{d.prompts}/{t.prompts} conversations, {d.turns}/{t.turns} turns"

    def __call__(self, p: Progress) -> None:
        self.done += p
        if p.bound:
            self.bar.total = max(self.bar.total + p.bound, self.done.tokens)
        self.bar.set_postfix_str(self.what(), refresh=False)
        if p.tokens:
            self.bar.update(p.tokens)
        else:
            self.bar.refresh()
        now = time.monotonic()
        if self.t0 is None and self.done.tokens:
            self.t0, self._first = now, self.done.tokens
        rate = (self.done.tokens - self._first) / max(now - self.t0, 1e-9) if self.t0 is not None else 0.0
        heartbeat(phase="generate", prompts_done=self.done.prompts, prompts_todo=self.todo.prompts,
                  tokens_done=self.done.tokens, tokens_bound=int(self.bar.total), tokens_per_s=round(rate, 1))
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            left = (self.bar.total - self.done.tokens) / rate if rate > 0 else float("inf")
            log.info("progress: %d new tokens of at most %d, %s; %.0f new tokens/s, at most %s left",
                     self.done.tokens, self.bar.total, self.what(), rate,
                     f"{left / 60:.0f} min" if left != float("inf") else "unknown")

    def close(self) -> None:
        self.bar.close()
