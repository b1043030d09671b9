"""What the loop's steps run over, one interface and two sources: the epochs of a complete cache
(`Epochs`), and windows of shards trained as extraction commits them (`Windows`, --follow).

The loop (loop.py) asks its source for the segments (and, from --follow, the points where it
waits for shards: `Waiting`, `CheckpointDue`), each segment's rows, the position a
checkpoint records, and the schedule's place where the source holds it (--follow), and tells it
when a segment ends and a checkpoint is written; no other part of the loop asks which mode runs.
How windows are found, recorded and released is follow.py's.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Protocol

from dflash_offline.runs.checkpoint import CheckpointState, FollowPosition, Place
from dflash_offline.runs.folder import CONSUMED, truncate_jsonl
from dflash_offline.runtime.signals import spawning
from dflash_offline.train.follow import (
    CheckpointDue,
    Segment,
    Waiting,
    epoch_segments,
    follow_segments,
    record_window,
    release_consumed,
)
from dflash_offline.train.plan import EpochPlan
from dflash_offline.train.trainer import LoopState, Trainer


class Source(Protocol):
    """What the loop needs from the data it trains on."""

    stop: int | None  # the last step of the run; None: the data's end (--follow without --max-steps)

    def segments(self) -> Iterable[Segment | Waiting | CheckpointDue]:
        """The epochs or windows, from the one holding the resumed step on; --follow also yields
        the points of its waits where the loop checks for a stop or checkpoints."""

    def rows(self, seg: Segment, span) -> Iterator:
        """This rank's micro-batches of the steps `span` of `seg`."""

    def segment_done(self, seg: Segment) -> None:
        """Every rank, after a segment's last step (or for a segment with no step)."""

    def position(self, seg: Segment, in_seg: int, step: int) -> Place:
        """What a checkpoint at `step` (`in_seg` steps into `seg`) records of where the run goes on."""

    def after_checkpoint(self, state: CheckpointState) -> None:
        """Rank 0, once the checkpoint holding `state` is written."""

    def checkpoint_at_end(self, stopping: int | None) -> bool:
        """Whether the run's end needs a checkpoint the steps did not write."""

    def before_step(self, seg: Segment, s: int) -> None:
        """Before step `s` of `seg`: what the schedule needs from the data (--follow: the step's
        place in the plan's tokens; the epochs' LambdaLR counts steps itself)."""

    def done_text(self, step: int, total: int) -> str:
        """How far the run went, for its last line."""

    def close(self) -> None:
        """Stop what reads ahead (loader processes)."""


def seg_span(seg: Segment, step: int, stop: int | None):
    """The steps of `seg` from global step `step` up to `stop`, as a stream span."""
    from dflash_offline.blocks.stream import Span

    start = max(step - seg.base, 0)
    return Span(seg.key, start, seg.steps if stop is None else max(start, min(seg.steps, stop - seg.base)))


def open_rows(t: Trainer, samples: EpochPlan | Segment, spans: list, pad_rows: bool = False):
    """An iterator over this rank's micro-batches of `spans` over `samples` (refs, lengths, pieces:
    the cache's, the same every epoch, or a follow window's), read ahead by the loader processes.
    `pad_rows`: fill the last step with empty rows (a follow window's rows rarely fill its steps)."""
    from dflash_offline.blocks.stream import RowSpec, RowStream, make_loader

    cfg = t.cfg
    # The block size and mask token are the drafter's (plan.drafter, its config: their one owner
    # after the command line); the layers and widths the cache's.
    spec = RowSpec(seed=cfg.seed, seq_len=cfg.seq_len, num_anchors=cfg.num_anchors,
                   block_size=t.plan.drafter.block_size, mask_token_id=t.plan.drafter.mask_token_id,
                   gamma=cfg.resolved_gamma(t.plan.drafter.block_size), hidden_size=t.plan.hidden_size,
                   row_layers=t.plan.target_layer_count, hidden_dtype=t.plan.hidden_dtype,
                   cache_layers=t.plan.cache_layers,
                   layer_columns=None if t.plan.layer_columns is None else tuple(t.plan.layer_columns),
                   topk=t.plan.topk, anchors_per_sample=cfg.anchors_per_sample or None,
                   label_offset=t.plan.drafter.label_offset)
    stream = RowStream(cfg.cache, samples.refs, samples.lengths, spec, spans, t.rank, t.world, t.plan.accum,
                       pad_rows=pad_rows, pieces=samples.pieces)
    if len(stream) == 0:  # nothing left to train (a resumed finished run): no processes to start
        return iter(())
    with spawning():  # loader processes start with the stop signals blocked, then ignore them
        return iter(make_loader(stream, cfg.loader_workers, cfg.prefetch, pin=t.cuda))


class Epochs:
    """A complete cache: the plan's epochs up to the run's last step, one loader for all of them
    (its processes and read-ahead carry over the epoch boundaries)."""

    def __init__(self, t: Trainer, step: int):
        cfg, plan = t.cfg, t.plan
        self.t = t
        self.stop = min(plan.total_steps, cfg.max_steps) if cfg.max_steps is not None else plan.total_steps
        self._segments = list(epoch_segments(plan, step, self.stop))
        self._rows = open_rows(t, plan.epochs, [seg_span(seg, step, self.stop) for seg in self._segments])

    def segments(self) -> list[Segment]:
        return self._segments

    def rows(self, seg: Segment, span) -> Iterator:
        return self._rows

    def segment_done(self, seg: Segment) -> None:
        pass

    def position(self, seg: Segment, in_seg: int, step: int) -> Place:
        spe = self.t.plan.epochs.steps_per_epoch
        return Place(epoch=step // spe, step_in_epoch=step % spe)

    def after_checkpoint(self, state: CheckpointState) -> None:
        pass

    def checkpoint_at_end(self, stopping: int | None) -> bool:
        return False  # the steps checkpoint the last step and the step a stop was agreed after

    def before_step(self, seg: Segment, s: int) -> None:
        pass

    def done_text(self, step: int, total: int) -> str:
        done = f"{step}/{total} steps"
        return done + f" (--max-steps {self.stop})" if self.stop < total else done

    def close(self) -> None:
        self._rows = None  # the loader processes stop here


class Windows:
    """--follow: windows of `follow_window` shards, each trained once all its shards are committed
    (follow.py); a loader per window, since a window's shards are known only then. The schedule
    runs over the plan's tokens, not over a step count known in advance, so this source gives each
    step's place to it (schedule.TokenSchedule); the run ends at the data's end (or --max-steps)."""

    def __init__(self, t: Trainer, st: LoopState, resumed: CheckpointState | None):
        cfg, plan = t.cfg, t.plan
        self.t, self.stop = t, cfg.max_steps
        start = resumed.follow if resumed is not None and resumed.follow is not None else FollowPosition()
        if t.rank == 0:  # windows from the resumed one on run again, and are recorded again
            truncate_jsonl(t.out / CONSUMED, lambda r: r["window"] < start.window)
            if resumed is not None:
                release_consumed(cfg, plan, start.window)  # a kill between checkpoint and release: finish it now
        self._segments = follow_segments(cfg, plan, t.rank, t.world, t.device, start, st)

    def segments(self) -> Iterator[Segment | Waiting | CheckpointDue]:
        return self._segments

    def rows(self, seg: Segment, span) -> Iterator:
        return open_rows(self.t, seg, [span], pad_rows=True)

    def segment_done(self, seg: Segment) -> None:
        if self.t.rank == 0:
            record_window(self.t.out, seg)

    def position(self, seg: Segment, in_seg: int, step: int) -> Place:
        done = in_seg >= seg.steps  # at a window's end the next window starts here
        at = FollowPosition(window=seg.key + 1 if done else seg.key, window_start=step if done else seg.base,
                            tokens_before=seg.tokens_before + (seg.tokens if done else 0))
        return Place(follow=at)

    def after_checkpoint(self, state: CheckpointState) -> None:
        release_consumed(self.t.cfg, self.t.plan, state.follow.window)

    def checkpoint_at_end(self, stopping: int | None) -> bool:
        # Stopped while waiting for shards, or the data ended between checkpoints.
        return bool(stopping) or self.t.cfg.final_checkpoint

    def before_step(self, seg: Segment, s: int) -> None:
        # This step's place is the middle of its share of the window's tokens.
        self.t.sched.at((seg.tokens_before + seg.tokens * (s + 0.5) / seg.steps) / self.t.plan.follow.plan_tokens)

    def done_text(self, step: int, total: int) -> str:
        return f"{step} steps (about {total} estimated)"

    def close(self) -> None:
        pass
