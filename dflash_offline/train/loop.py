"""A rank's training loop: build (trainer.py), resume from the last checkpoint, run the steps over
epochs or follow windows (follow.py), checkpoint, evaluate on the held-out cache, export at the end.

Every rank runs the same steps and calls the collectives at the same points: a checkpoint, a
held-out measurement and the stop check happen at the same step on all of them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, NamedTuple

from dflash_offline.train.config import TrainConfig
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.launch import TEARDOWN_S, RanksNotMet, exit_within, wait_for_ranks
from dflash_offline.runtime.logs import heartbeat
from dflash_offline.runtime.signals import Stopped
from dflash_offline.runs.checkpoint import (
    CHECKPOINT_PREFIX,
    CheckpointState,
    list_checkpoints,
    remove_unfinished,
    resume_checkpoint,
    save_checkpoint,
)
from dflash_offline.train.follow import CheckpointDue, Segment, Waiting
from dflash_offline.train.heldout import HeldOut
from dflash_offline.train.outcomes import agreed_stop, stopped_message
from dflash_offline.train.plan import TrainPlan
from dflash_offline.runs.folder import BEST, EXPORT, HELD_OUT_LOG, truncate_metrics
from dflash_offline.train.step import StepLog, optimizer_step
from dflash_offline.train.sources import Epochs, Source, Windows, seg_span
from dflash_offline.train.trainer import LoopState, Trainer, build_trainer

if TYPE_CHECKING:
    from dflash_offline.train.profiling import StepProfiler

log = logging.getLogger("dflash.train")


def train_worker(rank: int, world: int, device: str, cfg: TrainConfig, plan: TrainPlan) -> None:
    heartbeat(phase="import")  # torch and the model code: a broken install fails here
    import torch.distributed as dist

    from dflash_offline.drafter import masks
    from dflash_offline.train.profiling import StepProfiler

    t = build_trainer(rank, world, device, cfg, plan)
    out = t.out
    found = list_checkpoints(out)
    if rank == 0:
        # Steps after the last checkpoint run again: their metrics go, as do half-written checkpoints.
        truncate_metrics(out / "metrics.jsonl", found[-1] if found else 0)
        truncate_metrics(out / HELD_OUT_LOG, found[-1] if found else 0)
        remove_unfinished(out)
    st = LoopState(step=found[-1] if found else 0, last_ckpt=found[-1] if found else 0)
    resumed_state: CheckpointState | None = None
    if found:  # its settings were checked in preflight (check_resume)
        resumed_state = resume_checkpoint(out, st.step, t.drafter, t.opt, t.sched, device)
        log.info("resumed from %s (step %d of %d)", out / f"{CHECKPOINT_PREFIX}{st.step}", st.step, plan.total_steps)
    start_step = st.step
    held_out = HeldOut(cfg, out, t.drafter, device, rank, world) if cfg.eval_cache else None
    if t.follow:
        source: Source = Windows(t, st, resumed_state)
    else:
        source = Epochs(t, st.step)
    stop = source.stop
    steplog = StepLog.open(t, st.step, stop)
    recompiles0 = masks.count_recompiles()
    t_run = time.perf_counter()
    prof = StepProfiler(out, rank, t.cuda, cfg.profile_steps, st.step) if cfg.profile_steps else None
    if prof is not None and rank == 0 and stop is not None and prof.begin + prof.steps - 1 > stop:
        log.warning("--profile-steps %d: the profile covers steps %d..%d (after %d warm-up steps), past this run's last "
                    "step %d: no profile will be written; raise --max-steps or lower --profile-steps", prof.steps,
                    prof.begin, prof.begin + prof.steps - 1, prof.begin - st.step - 1, stop)
    run = _Run(t, st, source, steplog, prof, held_out, recompiles0)
    try:
        last_seg = None
        for item in source.segments():
            if isinstance(item, CheckpointDue):  # --stream: trained windows hold the space extraction waits for
                checkpoint(t, st, source, item.seg, item.seg.steps)
                continue
            if isinstance(item, Waiting):  # --follow waits for shards: every rank checks for a stop here
                if _agree_stop(t, st):
                    break
                continue
            last_seg = item
            if not _train_segment(run, item):
                break
        if last_seg is not None and st.last_ckpt != st.step and source.checkpoint_at_end(st.stopping):
            checkpoint(t, st, source, last_seg, st.step - last_seg.base)
        if not st.stopping:
            elapsed = time.perf_counter() - t_run
            if rank == 0:
                steplog.close_bar()
                if cfg.final_checkpoint:
                    _export(t, st, source, held_out, bool(found) and st.step == start_step, elapsed)
            log.info("rank %d done: data wait %.1f%% of %.1fs; recompiles %d", rank,
                     100 * st.wait_total / max(elapsed, 1e-9), elapsed, masks.count_recompiles() - recompiles0)
    finally:  # an error leaves the process group to the process's end: another rank may never reach a barrier
        source.close()  # the loader processes stop here
        steplog.close()
    fault_point("train-end")
    if world > 1:
        _barrier(t, "the end of the run")  # no rank tears the group down while another still talks to it
        exit_within(TEARDOWN_S)  # a teardown that hangs in C++ must not keep a finished rank forever
        dist.destroy_process_group()
    if st.stopping:
        raise Stopped(st.stopping, stopped_message(st.stopping, out))


class _Run(NamedTuple):
    """The parts of one run the steps use: built once in train_worker."""

    t: Trainer
    st: LoopState
    source: Source
    steplog: StepLog
    prof: StepProfiler | None
    held_out: HeldOut | None
    recompiles0: int


def _train_segment(run: _Run, seg: Segment) -> bool:
    """The steps of one epoch or window, up to the run's stop: step, log, checkpoint, held-out
    estimate, stop check. False when the run ends here (the last step or an agreed stop)."""
    from dflash_offline.drafter import masks
    from dflash_offline.train.profiling import phase

    t, st, source, prof, stop = run.t, run.st, run.source, run.prof, run.source.stop
    cfg = t.cfg
    if seg.steps == 0:  # a window whose samples hold no trained token: no row to train
        source.segment_done(seg)
        return True
    span = seg_span(seg, st.step, stop)
    if span.end <= span.start:
        return False
    st.epoch = seg.key
    it = source.rows(seg, span)
    for s in range(span.start, span.end):
        if prof is not None:
            prof.before(st.step + 1)
        source.before_step(seg, s)
        result = optimizer_step(t, st, it)
        st.step += 1
        fault_point("train-step")
        heartbeat(phase="train", step=st.step, total_steps=t.plan.total_steps)
        st.wait_total += result.t_data
        if t.rank == 0:
            run.steplog.record(t, st, result, stop, masks.count_recompiles() - run.recompiles0)
        if prof is not None:
            prof.after(st.step)
        if s + 1 == seg.steps:
            source.segment_done(seg)
        if st.step % cfg.checkpoint_every == 0 or (st.step == stop and cfg.final_checkpoint):
            with phase("checkpoint"):
                checkpoint(t, st, source, seg, s + 1)
        if cfg.eval_cache and (st.step % (cfg.eval_every or cfg.checkpoint_every) == 0 or st.step == stop):
            with phase("held-out"):
                run.held_out.measure(st.step)
        finished = stop is not None and st.step >= stop  # the same on every rank
        if not finished and _agree_stop(t, st):  # a stop request on any rank: all stop after this step
            if st.last_ckpt != st.step:
                checkpoint(t, st, source, seg, s + 1)
            break
    del it
    return not (st.stopping or (stop is not None and st.step >= stop))


def _agree_stop(t: Trainer, st: LoopState) -> int | None:
    """The agreed stop signal (agreed_stop), kept once any rank has asked: every rank stops after the same step."""
    st.stopping = st.stopping or agreed_stop(t.ctrl, t.world)
    return st.stopping


def checkpoint(t: Trainer, st: LoopState, source: Source, seg: Segment, in_seg: int) -> None:
    """All ranks call this at the same step (it has barriers); rank 0 writes. `in_seg`: the
    segment's steps done; the source says what the checkpoint records of where the run goes on."""
    if t.world > 1:
        _barrier(t, f"checkpoint step-{st.step}")
    if t.rank == 0:
        position = source.position(seg, in_seg, st.step)
        state = CheckpointState(step=st.step, cache_fingerprint=t.plan.cache_fingerprint, config=asdict(t.cfg),
                                drafter=asdict(t.plan.drafter), **position._asdict())
        save_checkpoint(t.out, st.step, t.drafter, t.opt, t.sched, state, t.cfg.keep_checkpoints)
        log.info("checkpoint step-%d saved", st.step)
        source.after_checkpoint(state)
    st.last_ckpt = st.step
    if t.world > 1:
        _barrier(t, f"checkpoint step-{st.step}")


def _barrier(t: Trainer, what: str) -> None:
    """dist.barrier() that a stop request can end (wait_for_ranks): a rank whose peers are stuck
    or gone stops with the line of a stopped run (the checkpoint to resume from), not in a wait
    that no signal but SIGKILL ends."""
    import torch.distributed as dist

    try:
        wait_for_ranks(dist.barrier(async_op=True), what)
    except RanksNotMet as e:
        exit_within(TEARDOWN_S)  # the group it gave up on stays blocked: nothing may keep this process
        raise Stopped(e.signum, f"{stopped_message(e.signum, t.out)}; rank {t.rank} stopped without the other ranks: "
                                f"{e}") from None


def _export(t: Trainer, st: LoopState, source: Source, held_out: HeldOut | None, nothing_trained: bool,
            elapsed: float) -> None:
    """Rank 0 at the end: the drafter to OUT/export/, and the lines that say what the run did."""
    from dflash_offline.drafter.export import export_drafter

    out, total = t.out, t.plan.total_steps
    path = export_drafter(t.drafter, str(out / EXPORT))
    log.info("exported drafter to %s", path)
    if held_out is not None and held_out.best is not None:
        b = held_out.best
        print(f"best held-out drafter: step {b['step']}, walk tau {b['tau_pooled']:.3f} pooled / "
              f"{b['tau_per_prompt_mean']:.3f} per-prompt mean, in {out / BEST}", flush=True)
    done = source.done_text(st.step, total)
    if nothing_trained:
        # Resumed from the final checkpoint: nothing left to train (the export is written again).
        log.info("already complete at step-%d: nothing to train", st.step)
        print(f"already complete: {done}; checkpoints in {out}; export in {path}", flush=True)
    else:
        print(f"trained {done} in {elapsed:.1f}s; checkpoints in {out}; export in {path}", flush=True)
