"""Stage two: train a DFlash drafter from a committed cache, data parallel, resumable to the step.

Shape of a run:
  launcher (or each torchrun rank): log file -> preflight (cache complete and intact, made from
  this target; mask token; shapes) -> one process per device, torch.distributed (NCCL on GPUs,
  gloo on CPU) -> each rank: one compute thread; rows stream from loader processes; per step
  `accum` micro-batches, one all-reduce of the step's loss weight, DDP gradient all-reduce on the
  last micro-batch, clip, AdamW, warm-up + cosine -> checkpoints `OUT/step-N/` (complete or absent)
  -> export at the end.

Everything that decides a step's numbers (sample order, rows, anchors, schedule) is a function of
(seed, epoch, manifest, options), so a resumed run repeats the uninterrupted one.

This module: the run as a whole (log, preflight, run lock) and the ranks it spawns and supervises.
The checks are preflight.py's, a rank's loop is loop.py's (its step: step.py).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import NamedTuple

from dflash_offline.cache.location import Location
from dflash_offline.options import where
from dflash_offline.train.config import TrainConfig
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.launch import join_ranks, torchrun_launch
from dflash_offline.runtime.early_log import open_launcher_log
from dflash_offline.runtime.logs import claim_heartbeat, heartbeat, open_process_log, worker_outcome
from dflash_offline.runtime.signals import (
    Stopped,
    install_stop_handlers,
    signal_name,
    stop_requested,
)
from dflash_offline.train.loop import train_worker
from dflash_offline.train.outcomes import TrainingDiverged, stopped_message
from dflash_offline.train.plan import TrainPlan
from dflash_offline.train.preflight import preflight
from dflash_offline.runs.folder import refuse_foreign_run
from dflash_offline.runtime.supervise import WorkerError, die_with_parent, run_workers


def run(cfg: TrainConfig) -> None:
    """`dflash-offline train`: the launcher, or one rank of a torchrun launch."""
    launch = torchrun_launch()
    cfg.validate()  # options first: a run that names no --out has no folder to check
    out = Path(cfg.out)
    name = f"train-rank{launch.rank}" if launch else "train-launcher"
    refuse_foreign_run(out, where(cfg, "out"))  # before its log folder is made
    try:  # OUT/logs/ once the run is held (claim_heartbeat): a refusal leaves no folder behind
        open_launcher_log(out / "logs", name)
    except OSError as e:  # before anything else: no log, no run folder, one line
        raise UserError(f"{where(cfg, 'out')} {cfg.out}: cannot write its log folder {out / 'logs'} ({e.strerror or e}); "
                        "choose a writable run folder") from None
    install_stop_handlers(safe_point="the end of the training step in progress, which is checkpointed")
    join_ranks(launch)  # a launch other than torchrun: every rank is there before any work
    heartbeat(phase="preflight")
    plan = preflight(cfg)
    if stop_requested():
        raise Stopped(stop_requested(), f"stopped on {signal_name(stop_requested())} before training started; "
                      "nothing changed; run the same command again to start")
    if launch is None or launch.rank == 0:
        run_lock = Location(str(out)).try_run_lock()  # held until this process exits
        if run_lock is None:
            raise UserError(f"{where(cfg, 'out')} {cfg.out}: another training run is using this folder (it holds "
                            f"{out / '.run.lock'}); wait for it or stop it, then run again")
    claim_heartbeat()  # this process holds the run now: a refused rerun never wrote its heartbeat
    if launch is not None:
        dev = "cpu" if all(d == "cpu" for d in plan.devices) else f"cuda:{launch.local_rank}"
        train_worker(launch.rank, launch.world_size, dev, cfg, plan)
        return
    devices = plan.devices
    if len(devices) == 1:
        # One device: train in this process (no process group needed), still one compute thread.
        train_worker(0, 1, devices[0], cfg, plan)
        return
    _spawn_ranks(cfg, plan, out)


class RankJob(NamedTuple):
    """What a spawned rank is given: the run's options, preflight's plan, the rendezvous port."""

    cfg: TrainConfig
    plan: TrainPlan
    port: int


def _spawn_ranks(cfg: TrainConfig, plan: TrainPlan, out: Path) -> None:
    """One process per device, supervised to the end by the same supervisor as extract's workers
    (runtime/supervise.py): a stop request is passed on to every rank, a rank stopped on its own
    stops the others, a failed rank stops the others and the run fails with the error of the rank
    that failed first (the others' broken collectives follow from it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def on_message(msg) -> None:  # ranks send nothing but their error lines
        raise TypeError(f"unexpected message from a training rank: {msg!r}")

    ended = run_workers(_spawned, plan.devices, RankJob(cfg, plan, port), "train", on_message)
    if ended.failed is None:
        if ended.stopped:
            raise Stopped(ended.stopped, stopped_message(ended.stopped, out))
        return
    what = ended.error or f"exited with code {ended.exitcode}"
    diverged = f"{TrainingDiverged.__name__}: "
    if what.startswith(diverged):  # every rank stopped at the same step: the line says what to do
        raise TrainingDiverged(what[len(diverged):])
    raise RuntimeError(f"training rank {ended.failed} failed: {what}; see "
                       f"{out / 'logs' / f'train-rank{ended.failed}.log'}. Run the same command again to resume.")


def _spawned(rank: int, world: int, device: str, job: RankJob, q) -> None:
    """A spawned rank: its own log, the launcher's rendezvous, its error line on `q` if it fails."""
    die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    open_process_log(Path(job.cfg.out) / "logs", f"train-rank{rank}", claim=True)
    install_stop_handlers(launched=True)
    with worker_outcome(on_error=lambda line: q.put(WorkerError(rank, line))):
        train_worker(rank, world, device, job.cfg, job.plan)
