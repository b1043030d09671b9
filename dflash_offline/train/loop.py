"""A rank's training loop: build (trainer.py), resume from the last checkpoint, run the steps over
epochs or follow windows (follow.py), checkpoint, evaluate on the held-out cache, export at the end.

Every rank runs the same steps and calls the collectives at the same points: a checkpoint, a
held-out measurement and the stop check happen at the same step on all of them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from dflash_offline.train.config import TrainConfig
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.launch import TEARDOWN_S, RanksNotMet, exit_within, wait_for_ranks
from dflash_offline.runtime.logs import heartbeat
from dflash_offline.runtime.signals import Stopped, spawning
from dflash_offline.runs.checkpoint import (
    CHECKPOINT_PREFIX,
    list_checkpoints,
    remove_unfinished,
    resume_checkpoint,
    save_checkpoint,
)
from dflash_offline.train.follow import (
    FollowPosition,
    Segment,
    epoch_segments,
    follow_segments,
    record_window,
    release_consumed,
)
from dflash_offline.train.heldout import HeldOut
from dflash_offline.train.outcomes import agreed_stop, stopped_message
from dflash_offline.train.plan import EpochPlan, TrainPlan
from dflash_offline.runs.folder import BEST, CONSUMED, EXPORT, HELD_OUT_LOG, truncate_jsonl, truncate_metrics
from dflash_offline.train.step import StepLog, optimizer_step
from dflash_offline.train.trainer import LoopState, Trainer, build_trainer

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
    resumed_state: dict = {}
    if found:  # its settings were checked in preflight (check_resume)
        resumed_state = resume_checkpoint(out, st.step, t.drafter, t.opt, t.sched, device)
        log.info("resumed from %s (step %d of %d)", out / f"{CHECKPOINT_PREFIX}{st.step}", st.step, plan.total_steps)
    start_step = st.step
    if t.follow:
        # The schedule's length is an estimate; the data's end is the end (or --max-steps).
        stop = cfg.max_steps
    else:
        stop = min(plan.total_steps, cfg.max_steps) if cfg.max_steps is not None else plan.total_steps
    steplog = StepLog.open(t, st.step, stop)
    recompiles0 = masks.count_recompiles()
    t_run = time.perf_counter()
    prof = StepProfiler(out, rank, t.cuda, cfg.profile_steps, st.step) if cfg.profile_steps else None
    if prof is not None and rank == 0 and stop is not None and prof.begin + prof.steps - 1 > stop:
        log.warning("--profile-steps %d: the profile covers steps %d..%d (after %d warm-up steps), past this run's last "
                    "step %d: no profile will be written; raise --max-steps or lower --profile-steps", prof.steps,
                    prof.begin, prof.begin + prof.steps - 1, prof.begin - st.step - 1, stop)
    held_out = HeldOut(cfg, out, t.drafter, device, rank, world) if cfg.eval_cache else None
    if t.follow:
        start = FollowPosition(**resumed_state.get("follow", {}))
        if rank == 0:  # windows from the resumed one on run again, and are recorded again
            truncate_jsonl(out / CONSUMED, lambda r: r["window"] < start.window)
        if rank == 0 and found:
            release_consumed(cfg, plan, start.window)  # a kill between checkpoint and release: finish it now
        segments = follow_segments(cfg, plan, rank, world, device, start, lambda seg: checkpoint(t, st, seg, seg.steps),
                                   lambda: st.step, lambda: st.last_ckpt, lambda: _agree_stop(t, st))
        rows = None  # a loader per window: a window's shards are known only once committed
    else:
        segments = list(epoch_segments(plan, st.step, stop))
        # One loader for all the epochs: its processes and read-ahead carry over the boundaries.
        rows = _open_rows(t, plan.epochs, [_span(seg, st.step, stop) for seg in segments])
    try:
        last_seg = None
        for seg in segments:
            last_seg = seg
            if not _train_segment(t, st, seg, stop, steplog, prof, held_out, recompiles0, rows):
                break
        if st.stopping:
            if t.follow and last_seg is not None and st.last_ckpt != st.step:  # stopped while waiting for shards
                checkpoint(t, st, last_seg, st.step - last_seg.base)
        else:
            if t.follow and cfg.final_checkpoint and last_seg is not None and st.last_ckpt != st.step:
                checkpoint(t, st, last_seg, st.step - last_seg.base)
            elapsed = time.perf_counter() - t_run
            if rank == 0:
                steplog.close_bar()
                if cfg.final_checkpoint:
                    _export(t, st, held_out, stop, bool(found) and st.step == start_step, elapsed)
            log.info("rank %d done: data wait %.1f%% of %.1fs; recompiles %d", rank,
                     100 * st.wait_total / max(elapsed, 1e-9), elapsed, masks.count_recompiles() - recompiles0)
    finally:  # an error leaves the process group to the process's end: another rank may never reach a barrier
        del rows  # the loader processes stop here
        steplog.close()
    fault_point("train-end")
    if world > 1:
        _barrier(t, "the end of the run")  # no rank tears the group down while another still talks to it
        exit_within(TEARDOWN_S)  # a teardown that hangs in C++ must not keep a finished rank forever
        dist.destroy_process_group()
    if st.stopping:
        raise Stopped(st.stopping, stopped_message(st.stopping, out))


def _span(seg: Segment, step: int, stop: int | None):
    """The steps of `seg` from global step `step` up to `stop`, as a stream span."""
    from dflash_offline.blocks.stream import Span

    start = max(step - seg.base, 0)
    return Span(seg.key, start, seg.steps if stop is None else max(start, min(seg.steps, stop - seg.base)))


def _open_rows(t: Trainer, samples: EpochPlan | Segment, spans: list):
    """An iterator over this rank's micro-batches of `spans` over `samples` (refs, lengths, pieces:
    the cache's, the same every epoch, or a follow window's), read ahead by the loader processes."""
    from dflash_offline.blocks.stream import RowSpec, RowStream, make_loader

    cfg = t.cfg
    # The block size and mask token are the drafter's (plan.drafter, its config: their one owner
    # after the command line); the layers and widths the cache's.
    spec = RowSpec(seed=cfg.seed, seq_len=cfg.seq_len, num_anchors=cfg.num_anchors,
                   block_size=t.plan.drafter.block_size, mask_token_id=t.plan.drafter.mask_token_id,
                   gamma=cfg.resolved_gamma, hidden_size=t.plan.hidden_size,
                   row_layers=t.plan.target_layer_count, hidden_dtype=t.plan.hidden_dtype,
                   cache_layers=t.plan.cache_layers,
                   layer_columns=None if t.plan.layer_columns is None else tuple(t.plan.layer_columns),
                   topk=t.plan.topk, anchors_per_sample=cfg.anchors_per_sample or None,
                   label_offset=t.plan.drafter.label_offset)
    stream = RowStream(cfg.cache, samples.refs, samples.lengths, spec, spans, t.rank, t.world, t.plan.accum,
                       pad_rows=t.follow, pieces=samples.pieces)
    if len(stream) == 0:  # nothing left to train (a resumed finished run): no processes to start
        return iter(())
    with spawning():  # loader processes start with the stop signals blocked, then ignore them
        return iter(make_loader(stream, cfg.loader_workers, cfg.prefetch, pin=t.cuda))


def _train_segment(t: Trainer, st: LoopState, seg: Segment, stop: int | None, steplog: StepLog, prof,
                   held_out: HeldOut | None, recompiles0: int, rows=None) -> bool:
    """The steps of one epoch or window, up to `stop`; False when the run ends here (the last step
    or an agreed stop). `rows`: the run's loader when it spans the segments (epochs), else None
    (a loader for this segment alone)."""
    from dflash_offline.drafter import masks
    from dflash_offline.train.profiling import phase

    cfg, rank = t.cfg, t.rank
    if t.follow and seg.steps == 0:  # a window whose samples hold no trained token: no row to train
        if rank == 0:
            record_window(t.out, seg)
        return True
    span = _span(seg, st.step, stop)
    if span.end <= span.start:
        return False
    st.epoch = seg.key
    it = rows if rows is not None else _open_rows(t, seg, [span])
    for s in range(span.start, span.end):
        if prof is not None:
            prof.before(st.step + 1)
        result = optimizer_step(t, st, it, seg, s)
        st.step += 1
        fault_point("train-step")
        heartbeat(phase="train", step=st.step, total_steps=t.plan.total_steps)
        st.wait_total += result.t_data
        if rank == 0:
            steplog.record(t, st, result, stop, masks.count_recompiles() - recompiles0)
        if prof is not None:
            prof.after(st.step)
        if t.follow and rank == 0 and s + 1 == seg.steps:
            record_window(t.out, seg)
        if st.step % cfg.checkpoint_every == 0 or (st.step == stop and cfg.final_checkpoint):
            with phase("checkpoint"):
                checkpoint(t, st, seg, s + 1)
        if cfg.eval_cache and (st.step % (cfg.eval_every or cfg.checkpoint_every) == 0 or st.step == stop):
            with phase("held-out"):
                held_out.measure(st.step)
        finished = stop is not None and st.step >= stop  # the same on every rank
        if not finished and _agree_stop(t, st):  # a stop request on any rank: all stop after this step
            if st.last_ckpt != st.step:
                checkpoint(t, st, seg, s + 1)
            break
    del it
    return not (st.stopping or (stop is not None and st.step >= stop))


def _agree_stop(t: Trainer, st: LoopState) -> int | None:
    """The agreed stop signal (agreed_stop), kept once any rank has asked: every rank stops after the same step."""
    st.stopping = st.stopping or agreed_stop(t.ctrl, t.world)
    return st.stopping


def checkpoint(t: Trainer, st: LoopState, seg: Segment, in_seg: int) -> None:
    """All ranks call this at the same step (it has barriers); rank 0 writes. `in_seg`: the
    segment's steps done (with --follow, at a window's end the next window starts here)."""
    if t.world > 1:
        _barrier(t, f"checkpoint step-{st.step}")
    if t.rank == 0:
        state = {"step": st.step, "cache_fingerprint": t.plan.cache_fingerprint, "config": asdict(t.cfg),
                 "drafter": asdict(t.plan.drafter)}
        if t.follow:
            done = in_seg >= seg.steps
            at = FollowPosition(window=seg.key + 1 if done else seg.key, window_start=st.step if done else seg.base,
                                tokens_before=seg.tokens_before + (seg.tokens if done else 0))
            state["follow"] = asdict(at)
        else:
            spe = t.plan.epochs.steps_per_epoch
            state.update(epoch=st.step // spe, step_in_epoch=st.step % spe)
        save_checkpoint(t.out, st.step, t.drafter, t.opt, t.sched, state, t.cfg.keep_checkpoints)
        log.info("checkpoint step-%d saved", st.step)
        if t.follow:
            release_consumed(t.cfg, t.plan, at.window)
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


def _export(t: Trainer, st: LoopState, held_out: HeldOut | None, stop: int | None, nothing_trained: bool,
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
    done = f"{st.step} steps (about {total} estimated)" if t.follow else f"{st.step}/{total} steps"
    if not t.follow and stop < total:
        done += f" (--max-steps {stop})"
    if nothing_trained:
        # Resumed from the final checkpoint: nothing left to train (the export is written again).
        log.info("already complete at step-%d: nothing to train", st.step)
        print(f"already complete: {done}; checkpoints in {out}; export in {path}", flush=True)
    else:
        print(f"trained {done} in {elapsed:.1f}s; checkpoints in {out}; export in {path}", flush=True)
