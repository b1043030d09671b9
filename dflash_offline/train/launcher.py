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
import time
from pathlib import Path

from dflash_offline.config import TrainConfig
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.launch import join_ranks, torchrun_launch
from dflash_offline.runtime.logs import claim_heartbeat, heartbeat, open_process_log
from dflash_offline.runtime.signals import (
    STOP_CODES,
    Stopped,
    install_stop_handlers,
    request_stop,
    signal_name,
    spawning,
    stop_requested,
)
from dflash_offline.train.loop import train_worker
from dflash_offline.train.outcomes import TrainingDiverged, stopped_message
from dflash_offline.train.plan import TrainPlan
from dflash_offline.train.preflight import preflight
from dflash_offline.train.run_folder import refuse_foreign_run


def run(cfg: TrainConfig) -> None:
    """`dflash-offline train`: the launcher, or one rank of a torchrun launch."""
    launch = torchrun_launch()
    cfg.validate()  # options first: a run that names no --out has no folder to check
    out = Path(cfg.out)
    name = f"train-rank{launch.rank}" if launch else "train-launcher"
    refuse_foreign_run(out)  # before its log folder is made
    try:
        open_process_log(out / "logs", name)
    except OSError as e:  # before anything else: no log, no run folder, one line
        raise UserError(f"--out {cfg.out}: cannot write its log folder {out / 'logs'} ({e.strerror or e}); "
                        "choose a writable run folder") from None
    install_stop_handlers()  # SIGTERM/SIGINT: finish the step, checkpoint, exit
    join_ranks(launch)  # a launch other than torchrun: every rank is there before any work
    heartbeat(phase="preflight")
    plan = preflight(cfg)
    if stop_requested():
        raise Stopped(stop_requested(), f"stopped on {signal_name(stop_requested())} before training started; "
                      "nothing changed; run the same command again to start")
    if launch is None or launch.rank == 0:
        from dflash_offline.cache.location import Location

        run_lock = Location(str(out)).try_run_lock()  # held until this process exits
        if run_lock is None:
            raise UserError(f"--out {cfg.out}: another training run is using this folder (it holds "
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


def _spawn_ranks(cfg: TrainConfig, plan: TrainPlan, out: Path) -> None:
    """One process per device, supervised to the end: a stop request is passed on to every rank,
    a rank stopped on its own stops the others, a failed rank stops the others and the run fails
    with the first rank's error (the others' broken collectives follow from it)."""
    import multiprocessing as mp

    devices = plan.devices
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from dflash_offline.runtime.supervise import failed_process, forward_stop, stop_processes

    ctx = mp.get_context("spawn")
    procs = []
    errq = ctx.Queue()  # each failing rank's error line (its log may sit on a full disk)
    install_stop_handlers(forward=lambda signum: forward_stop(procs))
    with spawning():  # a request that comes meanwhile is forwarded once all are started
        for rank, dev in enumerate(devices):
            p = ctx.Process(target=_spawned, args=(rank, len(devices), dev, cfg, plan, port, errq),
                            name=f"train-rank{rank}")
            p.start()
            procs.append(p)
    failed = None
    try:
        while any(p.is_alive() for p in procs) and failed is None:
            heartbeat(phase="stopping" if stop_requested() else "train", ranks=[p.pid for p in procs])
            time.sleep(0.5)
            failed = failed_process(procs, allow=STOP_CODES)
            if not stop_requested() and any(p.exitcode in STOP_CODES for p in procs):
                request_stop(next(p.exitcode for p in procs if p.exitcode in STOP_CODES) - 128)
    except BaseException:  # a second signal (stop now), or an error in this loop
        stop_processes(procs, failed, abandon=True)
        raise
    stop_processes(procs, failed)
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0 and not (stop_requested() and p.exitcode in STOP_CODES)]
    if not bad and stop_requested():
        raise Stopped(stop_requested(), stopped_message(stop_requested(), out))
    if bad:
        errors = {}
        while True:
            try:
                r, line = errq.get(timeout=0.2)
            except Exception:  # queue.Empty
                break
            errors[r] = line
        # The first rank to fail is the cause; the others' errors (a broken collective) follow from it.
        first = min(errors, key=lambda r: errors[r][0]) if errors else bad[0]
        what = errors[first][1] if errors else f"exited with code {procs[first].exitcode}"
        diverged = f"{TrainingDiverged.__name__}: "
        if what.startswith(diverged):  # every rank stopped at the same step: the line says what to do
            raise TrainingDiverged(what[len(diverged):])
        raise RuntimeError(f"training rank {first} failed: {what}; see {out / 'logs' / f'train-rank{first}.log'}. "
                           "Run the same command again to resume.")


def _spawned(rank: int, world: int, device: str, cfg: TrainConfig, plan: TrainPlan, port: int, errq) -> None:
    """A spawned rank: its own log, the launcher's rendezvous, its error line on `errq` if it fails."""
    from dflash_offline.runtime.supervise import die_with_parent

    die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    open_process_log(Path(cfg.out) / "logs", f"train-rank{rank}", claim=True)
    install_stop_handlers(launched=True)
    from dflash_offline.runtime.logs import worker_outcome

    with worker_outcome(on_error=lambda line: errq.put((rank, (time.time(), line)))):
        train_worker(rank, world, device, cfg, plan)
