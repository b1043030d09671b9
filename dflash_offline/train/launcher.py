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
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_offline.config import TrainConfig
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.launch import join_ranks, torchrun_launch
from dflash_offline.runtime.logs import claim_heartbeat, heartbeat, open_process_log
from dflash_offline.runtime.paths import refuse_foreign_folder
from dflash_offline.runtime.signals import Stopped, install_stop_handlers, signal_name, spawning, stop_requested
from dflash_offline.runtime.units import human_count
from dflash_offline.train.checkpoint import CHECKPOINT_PREFIX, damaged_checkpoint, list_checkpoints, save_checkpoint

log = logging.getLogger("dflash.train")

EXPORT = "export"
# What a run folder holds before its first checkpoint (a refused, failed or killed first run): anything
# else there was not made by train, and is never written into.
RUN_OWN_ENTRIES = {"logs", ".run.lock", "metrics.jsonl", "heldout.jsonl", "consumed.jsonl", "tensorboard", "profile",
                   EXPORT, "best", "best.json", "best.json.tmp"}


# ----------------------------------------------------------------------------------------------
# Preflight (no torch.distributed, no model)


def preflight(cfg: TrainConfig) -> dict:
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.drafter.model import DrafterConfig, check_export_dest, read_layer_tensors
    from dflash_offline.train.packing import accumulation, manifest_fingerprint, pack_rows, epoch_order, steps_per_epoch
    from dflash_offline.runtime.launch import check_devices_exist, parse_devices
    from dflash_offline.runtime.paths import require_kind

    cfg.validate()
    require_kind(cfg.cache, "--cache", True, "the cache folder extract wrote (the one with manifest.json)")
    require_kind(cfg.eval_cache, "--eval-cache", True, "a held-out cache folder (the one with manifest.json)")
    for dest in (EXPORT, BEST):  # the run ends writing them: refused now, not after the training
        check_export_dest(Path(cfg.out).absolute() / dest)
    devices = parse_devices(cfg.devices)
    if torchrun_launch() is None:
        check_devices_exist(devices)
    if cfg.follow:
        return _preflight_follow(cfg, devices)
    reader = CacheReader(cfg.cache)
    m = reader.manifest
    if m["status"] != "complete":
        raise UserError(f"--cache {cfg.cache}: extraction is not complete ({len(m['shards'])}/{m['plan']['num_shards']} "
                        "shards); finish it by running the extract command again, or train with --follow --epochs 1")
    _check_cache_target(cfg, m)
    if m.get("released"):
        raise UserError(f"--cache {cfg.cache}: {len(m['released'])} of its shards were consumed and deleted by a "
                        "streaming trainer (train --follow --stream), so it no longer holds all its samples; "
                        "extract a new cache")
    t0 = time.time()
    refs, lengths = [], []
    scored = False
    for name in reader.shard_names:
        if not reader.loc.exists(f"shards/{name}.zarr"):
            raise UserError(f"--cache {cfg.cache}: shard {name} is listed in manifest.json but missing on storage; "
                            "re-extract it (delete its entry from a copy of the manifest) or restore it")
        try:
            sh = reader.shard(name)
        except Exception as e:
            raise UserError(f"--cache {cfg.cache}: shard {name} does not open ({type(e).__name__}: {e})") from None
        if cfg.verify == "full":
            try:
                ok = sh.compute_checksum() == sh.entry["checksum"]
            except Exception:  # a chunk's CRC32C failed while reading
                ok = False
            if not ok:
                raise UserError(f"--cache {cfg.cache}: shard {name} does not match its checksum (corrupted data); "
                                "re-extract it")
        # A cache whose loss masks are all zero trains nothing: read them until one token is scored
        # (the first shard, for any real data: one byte per token).
        scored = scored or bool(sh.group["loss_mask"][:].any())
        offs = sh.offsets
        lengths.extend((offs[1:] - offs[:-1]).tolist())
        refs.extend((name, k, int(offs[k])) for k in range(len(sh)))  # (shard, sample, first token)
    log.info("cache: %d shards, %d samples checked (%s) in %.1fs", len(reader.shard_names), len(refs), cfg.verify,
             time.time() - t0)
    if not scored:
        raise UserError(f"--cache {cfg.cache}: every loss_mask value is 0, so no token would be trained on; extract "
                        "data whose loss_mask marks the tokens to learn (e.g. 1 on the completions)")
    import numpy as np

    lengths = np.asarray(lengths, np.int64)
    layer_ids, columns = layer_choice(cfg, m)
    _check_row_memory(cfg, len(layer_ids) * m["target"]["hidden_size"])
    topk = _check_soft_targets(cfg, m)
    dcfg = DrafterConfig.from_target(cfg.target, layer_ids, block_size=cfg.block_size,
                                     num_layers=cfg.num_layers, mask_token_id=cfg.mask_token_id)
    if cfg.init_layers:
        read_layer_tensors(cfg.target, cfg.init_layers, cfg=dcfg)  # shapes only: one line if they do not fit
    world = _world(devices)
    accum = accumulation(cfg.global_batch_tokens, cfg.seq_len, world)
    # Rows per epoch vary a little with the order; every epoch runs as many steps as the
    # shortest one has, so a step never meets a missing row.
    rows = min(len(pack_rows(lengths, epoch_order(len(refs), cfg.seed, e), cfg.seq_len)) for e in range(cfg.epochs))
    spe = steps_per_epoch(rows, world, accum)
    if spe == 0:
        raise UserError(f"the cache packs into {rows} rows of {cfg.seq_len} tokens, fewer than one step needs "
                        f"({world} ranks x {accum} micro-batches); lower --global-batch-tokens or --seq-len")
    plan = {
        "devices": devices, "world": world, "accum": accum, "rows_per_epoch": rows, "steps_per_epoch": spe,
        "total_steps": spe * cfg.epochs, "refs": refs, "lengths": lengths, "drafter": asdict(dcfg),
        "cache_fingerprint": manifest_fingerprint(m), "hidden_size": m["target"]["hidden_size"],
        "num_layers_captured": len(layer_ids), "cache_layers": len(m["capture"]["layer_ids"]),
        "layer_columns": columns, "topk": topk, "hidden_dtype": m["capture"]["hidden_dtype"],
        "lr": cfg.resolved_lr(m["target"]["hidden_size"]),
    }
    log.info("plan: %d rows/epoch, %d ranks x %d micro-batches of %d tokens per step, %d steps/epoch, %d steps total",
             rows, world, accum, cfg.seq_len, spe, plan["total_steps"])
    log.info("recipe: layers %s of the cache's %s, lr %.3g%s, %d anchors per row, %s per sample, kd weight %g",
             layer_ids, m["capture"]["layer_ids"], plan["lr"], " (auto)" if cfg.lr is None else "", cfg.num_anchors,
             cfg.anchors_per_sample or "one draw", cfg.kd_weight)
    if cfg.eval_cache:
        _check_eval_cache(cfg, layer_ids, m)
    check_resume(cfg, plan)
    return plan


def window_misfit(cfg: TrainConfig, m: dict) -> str | None:
    """Why a follow window can never be on storage at once under the cache's budget, or None.
    A window is up to follow_window shards of at most the plan's largest shard (extract records
    both); fewer than that would leave extraction paused and the trainer waiting, forever."""
    budget, biggest = m.get("budget_bytes"), m.get("max_shard_bytes")
    if budget and biggest and cfg.follow_window * biggest > budget:
        return (f"--follow-window {cfg.follow_window} shards of up to {biggest / 1e6:.1f} MB do not fit the cache's "
                f"budget ({budget / 1e6:.1f} MB, extract --max-bytes): extraction would pause and the trainer wait "
                f"forever; lower --follow-window to {max(1, budget // biggest)} or raise the budget")
    return None


def _available_memory() -> int | None:
    """MemAvailable of this host in bytes (Linux), None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _check_row_memory(cfg: TrainConfig, features: int) -> None:
    """One row's hidden states (bf16, seq_len x captured layers x hidden) must fit in host memory
    with room for the rows read ahead: a --seq-len that cannot is refused before any allocation."""
    row = cfg.seq_len * features * 2
    avail = _available_memory()
    if avail is not None and row * 2 > avail:
        raise UserError(f"--seq-len {cfg.seq_len}: one row of hidden states needs {row / 1e9:.1f} GB of host memory "
                        f"({features} features a token in bf16), more than half of the {avail / 1e9:.1f} GB available; "
                        "lower --seq-len")


def _check_cache_target(cfg: TrainConfig, m: dict) -> None:
    from dflash_offline.target.folder import read_target

    info = read_target(cfg.target)
    for key, mine in (("weights_fingerprint", info.weights_fingerprint), ("config_sha256", info.config_sha256)):
        if m["target"].get(key) != mine:
            raise UserError(f"--cache {cfg.cache} was extracted from another target (target.{key} differs from "
                            f"--target {cfg.target}); extract a cache with this target or pass the one it was made from")
    if m["capture"]["hidden_dtype"] not in ("bfloat16", "float8_e4m3fn"):
        raise UserError(f"--cache {cfg.cache} stores hidden states as {m['capture']['hidden_dtype']!r}, which this "
                        "version cannot read (bfloat16, float8_e4m3fn); re-extract with --hidden-dtype bfloat16 or fp8")


def layer_choice(cfg: TrainConfig, m: dict) -> tuple[list[int], list[int] | None]:
    """(layer ids the drafter reads, their columns in the cache's rows, or None for all of them).
    `--layers` picks a subset of the captured layers by id; the drafter reads them in the cache's
    order, as a cache holding only those layers would store them."""
    captured = list(m["capture"]["layer_ids"])
    if cfg.layers is None:
        return captured, None
    missing = [i for i in cfg.layers if i not in captured]
    if missing:
        raise UserError(f"--layers {','.join(map(str, cfg.layers))}: the cache {cfg.cache} holds layers {captured}, not "
                        f"{missing}; choose among those, or extract a cache with --layers that include them")
    cols = [k for k, i in enumerate(captured) if i in cfg.layers]
    return [captured[k] for k in cols], cols


def _check_soft_targets(cfg: TrainConfig, m: dict) -> int:
    """Top-k entries the loss reads: 0 without --kd-weight; the cache must hold them with it."""
    if cfg.kd_weight == 0:
        return 0
    k = int(m["capture"].get("topk") or 0)
    if k == 0:
        raise UserError(f"--kd-weight {cfg.kd_weight}: the cache {cfg.cache} holds no top-k log-probabilities "
                        "(extracted with --topk 0); extract with --topk 32, or train with --kd-weight 0")
    return k


def _world(devices: list[str]) -> int:
    launch = torchrun_launch()
    return launch.world_size if launch is not None else len(devices)


def _preflight_follow(cfg: TrainConfig, devices: list[str]) -> dict:
    """--follow: the cache may still be empty or missing; what is fixed now is its identity (target,
    capture, plan), the schedule (from the plan's token count) and the window rule. Which rows a
    step trains on is fixed once its window's shards are committed (`follow_window_rows`)."""
    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, committed_names
    from dflash_offline.drafter.model import DrafterConfig, read_layer_tensors
    from dflash_offline.train.packing import accumulation, follow_fingerprint

    store = ManifestStore(Location(cfg.cache))
    t0 = last = time.time()
    while (m := store.read()) is None:
        if time.time() - last > 30:
            log.info("waiting for %s/manifest.json (no extraction has started there yet) for %.0fs", cfg.cache,
                     time.time() - t0)
            last = time.time()
        heartbeat(phase="waiting for the cache", cache=cfg.cache)
        time.sleep(0.5)
    _check_cache_target(cfg, m)
    tokens = m["plan"].get("tokens")
    if tokens is None:
        raise UserError(f"--cache {cfg.cache} was made by an older version (its plan has no token count), so --follow "
                        "cannot size the schedule; train without --follow once extraction is complete")
    problem = window_misfit(cfg, m)
    if problem:
        raise UserError(problem)
    mine = str(Path(cfg.out).resolve())
    others = sorted(c for c in (m.get("consumers") or {}) if c != mine)
    if m.get("released") and mine not in (m.get("consumers") or {}):
        raise UserError(f"--cache {cfg.cache}: {len(m['released'])} shards were already consumed and deleted by "
                        f"another trainer ({', '.join(others)}); this run would miss them; extract a new cache")
    budget, biggest = m.get("budget_bytes"), m.get("max_shard_bytes")
    if budget and biggest and not cfg.stream and m["plan"]["num_shards"] * biggest > budget:
        raise UserError(f"--cache {cfg.cache} has a budget ({budget / 1e6:.1f} MB) that holds about "
                        f"{budget // biggest} of its {m['plan']['num_shards']} shards; without --stream nothing is "
                        "released and both stages would wait forever: add --stream")
    layer_ids, columns = layer_choice(cfg, m)
    topk = _check_soft_targets(cfg, m)
    dcfg = DrafterConfig.from_target(cfg.target, layer_ids, block_size=cfg.block_size,
                                     num_layers=cfg.num_layers, mask_token_id=cfg.mask_token_id)
    if cfg.init_layers:
        read_layer_tensors(cfg.target, cfg.init_layers, cfg=dcfg)  # shapes only: one line if they do not fit
    if cfg.eval_cache:
        _check_eval_cache(cfg, layer_ids, m)
    world = _world(devices)
    accum = accumulation(cfg.global_batch_tokens, cfg.seq_len, world)
    # An estimate for the progress bar and the log: windows pack separately and fill their last
    # step with empty rows, so a run takes more steps. The learning rate follows the tokens
    # trained, not this count (`_lr_at`).
    total = max(1, math.ceil(tokens / (cfg.seq_len * world * accum)))
    plan = {
        "devices": devices, "world": world, "accum": accum, "total_steps": total, "follow": True,
        "num_shards": m["plan"]["num_shards"], "drafter": asdict(dcfg), "cache_fingerprint": follow_fingerprint(m),
        "hidden_size": m["target"]["hidden_size"], "num_layers_captured": len(layer_ids),
        "cache_layers": len(m["capture"]["layer_ids"]), "layer_columns": columns, "topk": topk,
        "hidden_dtype": m["capture"]["hidden_dtype"], "consumer": mine, "plan_tokens": int(tokens),
        "lr": cfg.resolved_lr(m["target"]["hidden_size"]),
    }
    log.info("plan (follow%s): %d shards planned, %d committed so far, %d tokens; windows of %d shards; %d ranks x %d "
             "micro-batches of %d tokens per step; about %d steps", ", stream" if cfg.stream else "",
             m["plan"]["num_shards"], len(committed_names(m)), tokens, cfg.follow_window, world, accum, cfg.seq_len,
             total)
    check_resume(cfg, plan)
    # Last, under the manifest's lock: two trainers started at once cannot both pass as the only one.
    store.register_consumer(mine, cfg.stream)
    return plan


def _check_eval_cache(cfg: TrainConfig, layer_ids: list[int], m: dict) -> None:
    """--eval-cache, before any process starts: complete, from the same target, with the layers."""
    from dflash_offline.cache.manifest import ManifestStore
    from dflash_offline.cache.location import Location

    try:
        held = ManifestStore(Location(cfg.eval_cache)).read()
    except Exception as e:
        raise UserError(f"--eval-cache {cfg.eval_cache}: unreadable manifest ({type(e).__name__}: {e})") from None
    if held is None:
        raise UserError(f"--eval-cache {cfg.eval_cache}: no cache there (no manifest.json); extract the held-out "
                        "completions into it first")
    if held["status"] != "complete":
        raise UserError(f"--eval-cache {cfg.eval_cache}: extraction is not complete; finish it first")
    if held["target"].get("weights_fingerprint") != m["target"].get("weights_fingerprint"):
        raise UserError(f"--eval-cache {cfg.eval_cache} was extracted from another target than --cache {cfg.cache}")
    missing = [i for i in layer_ids if i not in held["capture"]["layer_ids"]]
    if missing:
        raise UserError(f"--eval-cache {cfg.eval_cache} holds layers {held['capture']['layer_ids']}, not {missing} "
                        "that the drafter reads; extract it with the training cache's layers")


# Settings a resumed run must share with its checkpoint: they decide the numbers of every step.
RESUME_KEYS = ("seq_len", "num_anchors", "anchors_per_sample", "layers", "kd_weight", "block_size", "gamma", "seed", "global_batch_tokens", "epochs", "num_layers",
               "lr", "warmup_ratio", "weight_decay", "clip", "mask_token_id", "precision", "loss_chunk_tokens",
               "follow", "follow_window")


def check_resume(cfg: TrainConfig, plan: dict) -> None:
    """Refuse, before any process starts, to resume a checkpoint made on another cache or with
    other settings (a changed lr would be silently overridden by the saved optimizer state)."""
    out = Path(cfg.out)
    found = list_checkpoints(out)
    if not found:
        return
    ck = out / f"{CHECKPOINT_PREFIX}{found[-1]}"
    from dflash_offline.train.checkpoint import checkpoint_damage

    what = checkpoint_damage(ck)  # headers and sizes only: a damaged file is named before any rank starts
    if what:
        raise UserError(damaged_checkpoint(out, found[-1], what))
    state = json.loads((ck / "state.json").read_text())
    if state["cache_fingerprint"] != plan["cache_fingerprint"]:
        raise UserError(f"{ck} was trained on another cache (its fingerprint differs); use a new --out")
    defaults = TrainConfig()
    for key in RESUME_KEYS:
        theirs = state["config"].get(key, getattr(defaults, key))  # a key newer than the checkpoint: its default
        if theirs != getattr(cfg, key):
            raise UserError(f"{ck} was made with {key} = {theirs}, this run has {getattr(cfg, key)}; "
                            "use the same settings to resume, or a new --out")


# ----------------------------------------------------------------------------------------------
# Launch


def run(cfg: TrainConfig) -> None:
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
        dev = "cpu" if all(d == "cpu" for d in plan["devices"]) else f"cuda:{launch.local_rank}"
        train_worker(launch.rank, launch.world_size, dev, cfg, plan)
        return
    import multiprocessing as mp

    devices = plan["devices"]
    if len(devices) == 1:
        # One device: train in this process (no process group needed), still one compute thread.
        train_worker(0, 1, devices[0], cfg, plan)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from dflash_offline.runtime.signals import STOP_CODES, request_stop
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


def refuse_foreign_run(out: Path) -> None:
    """--out is a run folder (it holds a checkpoint), or holds nothing but what a first run makes."""
    if not list_checkpoints(out):
        refuse_foreign_folder(out, "--out", "a training run", "step-N/ checkpoint", RUN_OWN_ENTRIES,
                              (".tmp-", f".{EXPORT}.", f".{BEST}."))
        # Names this stage makes are ours only if they hold what it writes: a run truncates its
        # metrics on a restart, which would rewrite someone else's file of that name.
        for name in ("metrics.jsonl", HELD_OUT_LOG):
            if (out / name).is_file() and not _our_jsonl(out / name):
                raise UserError(f"--out {out}: its {name} was not written by `train` (not a file of JSON lines "
                                "with a step); choose a new or empty folder (nothing was changed)")


def _our_jsonl(path: Path) -> bool:
    """A file of JSON objects with a `step` each (a last line cut by a kill aside)."""
    try:
        lines = [ln for ln in path.read_bytes().split(b"\n") if ln.strip(b" \t\r\0")]
    except OSError:
        return False
    for k, ln in enumerate(lines):
        try:
            rec = json.loads(ln)
        except ValueError:
            if k == len(lines) - 1:
                continue
            return False
        if not isinstance(rec, dict) or "step" not in rec:
            return False
    return True


def _spawned(rank: int, world: int, device: str, cfg: TrainConfig, plan: dict, port: int, errq) -> None:
    from dflash_offline.runtime.supervise import die_with_parent

    die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    open_process_log(Path(cfg.out) / "logs", f"train-rank{rank}", claim=True)
    install_stop_handlers(launched=True)
    from dflash_offline.runtime.logs import worker_outcome

    with worker_outcome(on_error=lambda line: errq.put((rank, (time.time(), line)))):
        train_worker(rank, world, device, cfg, plan)


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm: the run stops before that step's update, exports nothing."""


def diverged_message(loss_flags, gnorm: float, step: int, out: Path, last_ckpt: int) -> str:
    """One line: what was not finite, at which step and on which rank(s), and where to go on from."""
    ranks = [r for r, f in enumerate(loss_flags) if f]
    if ranks:
        what = f"the loss is not finite on rank {', '.join(map(str, ranks))}"
    else:  # DDP averages the gradients: every rank holds the same norm
        what = f"the gradient norm is {gnorm} on every rank ({len(loss_flags)} rank(s)), with a finite loss"
    last = (f"the last good checkpoint is {out / f'{CHECKPOINT_PREFIX}{last_ckpt}'}" if last_ckpt
            else "there is no checkpoint yet")
    return (f"training stopped at step {step}: {what}; the step was not applied and no export was written; {last}; "
            "train into a new --out with a lower --lr or --clip (a resume must keep them), or check the cache with "
            "dflash-offline verify")


def stopped_message(signum: int, out: Path) -> str:
    steps = list_checkpoints(out)
    if not steps:
        return (f"stopped on {signal_name(signum)} before the first checkpoint: nothing to resume from; "
                "run the same command again to start over")
    return (f"stopped on {signal_name(signum)}: checkpoint step-{steps[-1]} saved in {out}; "
            "run the same command again to resume")


def _agreed_stop(group, world: int) -> int | None:
    """The stop signal if any rank has one (every rank calls this at the same point), else None.
    One tiny all-reduce on a gloo group: a host-side collective, no GPU sync."""
    sig = stop_requested() or 0
    if world > 1:
        import torch
        import torch.distributed as dist

        t = torch.tensor([sig], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        sig = int(t.item())
    return sig or None


# ----------------------------------------------------------------------------------------------
# Checkpoints








def _lr_at(progress: float, warmup_ratio: float) -> float:
    """Warm-up then cosine over the fraction of the plan's tokens trained (train --follow)."""
    if progress < warmup_ratio:
        return progress / warmup_ratio
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup_ratio) / max(1e-12, 1.0 - warmup_ratio))))


def _lr_lambda(total: int, warmup: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return f


# ----------------------------------------------------------------------------------------------
# What the steps run over: epochs of a complete cache, or windows of a cache being filled


@dataclass
class Segment:
    """A run of steps over one sample order: an epoch, or a follow window of shards."""

    key: int  # epoch, or window index: seeds the order and the anchors
    refs: list  # (shard, sample, first token)
    lengths: object  # np.ndarray of sample lengths
    base: int  # global step at the segment's first step
    steps: int
    shards: list = field(default_factory=list)
    sample_ids: list = field(default_factory=list)  # follow: ids of the samples the rows hold
    tokens: int = 0  # follow: the window's tokens, and those of all windows before it (the schedule)
    tokens_before: int = 0


def _epoch_segments(plan: dict, step: int, stop: int):
    spe = plan["steps_per_epoch"]
    for e in range(step // spe, -(-stop // spe)):
        yield Segment(e, plan["refs"], plan["lengths"], e * spe, spe)


def follow_window_rows(cfg: TrainConfig, plan: dict, window: int, names: list[str]):
    """A committed window's refs, lengths, the ids of the samples its rows hold, and its number of
    steps: the rows are packed in the order epoch_order(window), and the last step is filled with
    empty rows (no sample dropped)."""
    import numpy as np

    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.train.packing import epoch_order, pack_rows

    reader = CacheReader(cfg.cache)
    refs, lengths, ids = [], [], []
    for name in names:
        sh = reader.shard(name)
        offs = sh.offsets
        lengths.extend((offs[1:] - offs[:-1]).tolist())
        refs.extend((name, k, int(offs[k])) for k in range(len(offs) - 1))
        ids.extend(int(i) for i in sh.ids)
    lengths = np.asarray(lengths, np.int64)
    rows = pack_rows(lengths, epoch_order(len(refs), cfg.seed, window), cfg.seq_len)
    trained = [ids[smp] for row in rows for smp, _ in row]
    return refs, lengths, trained, -(-len(rows) // (plan["world"] * plan["accum"]))


def _follow_segments(cfg: TrainConfig, plan: dict, rank: int, world: int, device: str, fstate: dict,
                     checkpoint_now, current_step, last_checkpoint, agreed_stop):
    """Windows of `follow_window` shards in plan order, each yielded once all its shards are
    committed. Rank 0 watches the manifest and tells the others (a broadcast per poll), so every
    rank waits, checkpoints and goes on at the same moment. With `--stream`, when extraction is
    paused for space while the trainer waits, a checkpoint releases the windows already trained."""
    import torch
    import torch.distributed as dist

    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, committed_names, occupancy, shard_name

    G, N = cfg.follow_window, plan["num_shards"]
    window, base, tokens_before = fstate["window"], fstate["window_start"], fstate.get("tokens_before", 0)
    store = ManifestStore(Location(cfg.cache))
    flag = torch.zeros(1, dtype=torch.int64, device=device if device.startswith("cuda") else "cpu")
    prev = None
    while window * G < N:
        names = [shard_name(i) for i in range(window * G, min((window + 1) * G, N))]
        t0, last_log = time.time(), 0.0
        while True:
            if rank == 0:
                m = store.read()
                problem = window_misfit(cfg, m)  # a budget set (or changed) after this run started
                if problem:
                    raise UserError(problem)
                have = committed_names(m)
                missing = [n for n in names if n not in have]
                budget, biggest = m.get("budget_bytes"), m.get("max_shard_bytes") or 0
                blocked = (budget is not None and missing[:1] and missing[0] not in (m.get("reserved") or {})
                           and occupancy(m) + biggest > budget)
                if not missing:
                    code = 1
                elif cfg.stream and blocked and prev is not None and last_checkpoint() < current_step():
                    code = 2  # extraction waits for space that trained windows hold: checkpoint, release them
                else:
                    code = 0
                    if time.time() - last_log > 30:
                        log.info("waiting for %s (window %d: %d of %d shards committed; the cache has %d of %d%s)",
                                 missing[0], window, len(names) - len(missing), len(names), len(have), N,
                                 "; extraction is paused for space" if blocked else "")
                        last_log = time.time()
                flag.fill_(code)
            if world > 1:
                dist.broadcast(flag, 0)
            code = int(flag.item())
            if code == 1:
                break
            if code == 2:
                checkpoint_now(prev)
                continue
            if agreed_stop():
                return
            heartbeat(phase="waiting for shards", step=current_step(), window=window, first_shard=names[0])
            fault_point("train-waiting")
            time.sleep(0.5)
        if time.time() - t0 > 1 and rank == 0:
            log.info("window %d ready after %.1fs waiting", window, time.time() - t0)
        refs, lengths, trained, steps = follow_window_rows(cfg, plan, window, names)
        prev = Segment(window, refs, lengths, base, steps, names, trained, int(lengths.sum()), tokens_before)
        yield prev
        base += steps
        tokens_before += prev.tokens
        window += 1


CONSUMED = "consumed.jsonl"


def _record_window(out: Path, seg: Segment) -> None:
    """One line per trained window: its shards and the ids of the samples its rows held (a
    multi-pass cache holds each id once per pass). Lines past the resumed checkpoint go on resume."""
    with open(out / CONSUMED, "a") as f:
        f.write(json.dumps({"window": seg.key, "first_step": seg.base, "steps": seg.steps, "shards": seg.shards,
                            "sample_ids": seg.sample_ids}) + "\n")


def _truncate_jsonl(path: Path, keep) -> None:
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = []
    for ln in lines:
        try:
            if keep(json.loads(ln)):
                kept.append(ln)
        except json.JSONDecodeError:  # a line cut by a kill
            pass
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)


def _consumed(cfg: TrainConfig, plan: dict, window: int) -> None:
    """Rank 0, after a checkpoint whose next window is `window`: the shards of all earlier windows
    are finished for good. Recorded in the manifest first; with --stream their data is deleted
    after (a kill in between leaves folders that the next call deletes)."""
    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, shard_name

    n = min(window * cfg.follow_window, plan["num_shards"])
    if n == 0:
        return
    loc = Location(cfg.cache)
    finished = [shard_name(i) for i in range(n)]
    store = ManifestStore(loc)
    pending = store.record_consumed(plan["consumer"], finished, release=cfg.stream)
    fault_point("train-released")
    for name in pending:
        loc.rmtree(f"shards/{name}.zarr")
    if pending:
        store.deleted(pending)
        log.info("released %d shards (%s .. %s)", len(pending), pending[0], pending[-1])


# ----------------------------------------------------------------------------------------------
# The rank's loop


def train_worker(rank: int, world: int, device: str, cfg: TrainConfig, plan: dict) -> None:
    heartbeat(phase="import")  # torch and the model code: a broken install fails here
    import numpy as np
    import torch
    import torch.distributed as dist

    from dflash_offline.drafter import masks
    from dflash_offline.drafter.model import DFlashDrafter, DrafterConfig, export_drafter
    from dflash_offline.train.loss import block_loss, block_metrics
    from dflash_offline.train.profiling import StepProfiler, phase
    from dflash_offline.runtime.launch import single_thread_compute
    from dflash_offline.train.stream import RowStream, device_hidden, make_loader

    single_thread_compute()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    ctrl = None  # the group that agrees on stopping: gloo, so the check never syncs with the GPU
    if world > 1:
        from dflash_offline.runtime.launch import rendezvous_store

        # A launch other than torchrun met its ranks on a store (join_ranks); torchrun's and our
        # launcher's ranks meet through MASTER_ADDR/MASTER_PORT.
        store = rendezvous_store()
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                **({"store": store} if store is not None else {}))
        ctrl = dist.new_group(backend="gloo") if cuda else None
    stopping: list[int | None] = [None]

    def agreed_stop() -> int | None:
        stopping[0] = stopping[0] or _agreed_stop(ctrl, world)
        return stopping[0]

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dcfg = DrafterConfig(**plan["drafter"])
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    # Built on the device: initialising a 27B-shaped drafter's ~1.8B parameters on one CPU thread
    # takes minutes; on the GPU it takes a moment. (GPU and CPU draw different initial weights.)
    t_build = time.perf_counter()
    heartbeat(phase="build drafter")
    with torch.device(device):
        drafter = DFlashDrafter(dcfg)
    heartbeat(phase="load weights")
    fault_point("load-weights")
    drafter.load_frozen_from_target(cfg.target)
    if cfg.init_layers:
        drafter.init_layers_from_target(cfg.target, cfg.init_layers)
    drafter.to(device)
    if cfg.compile_layers if cfg.compile_layers is not None else cuda:
        drafter.compile_layers()
    loss_chunk = cfg.resolved_loss_chunk(dcfg.vocab_size)
    log.info("drafter: %s trainable parameters on %s, built and frozen parts loaded in %.1fs",
             human_count(sum(p.numel() for p in drafter.trainable_parameters())), device, time.perf_counter() - t_build)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and cuda)
    model = drafter
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        import warnings

        with warnings.catch_warnings():  # torch's advice applies to rank-local buffers; the drafter has none
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            model = DDP(drafter, device_ids=[device] if cuda else None, broadcast_buffers=False)
    params = drafter.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=plan["lr"], weight_decay=cfg.weight_decay, fused=cuda)
    total = plan["total_steps"]
    warmup = max(1, math.ceil(cfg.warmup_ratio * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total, warmup))

    step = 0
    resumed_state: dict = {}
    found = list_checkpoints(out)
    if rank == 0:
        # Steps after the last checkpoint run again: their metrics go, as do half-written checkpoints.
        _truncate_metrics(out / "metrics.jsonl", found[-1] if found else 0)
        _truncate_metrics(out / HELD_OUT_LOG, found[-1] if found else 0)
        for debris in out.glob(f".tmp-{CHECKPOINT_PREFIX}*"):
            shutil.rmtree(debris, ignore_errors=True)
    if found:
        step = found[-1]
        ck = out / f"{CHECKPOINT_PREFIX}{step}"  # its settings were checked in preflight (check_resume)
        from safetensors.torch import load_file

        reading = "drafter.safetensors"
        try:  # preflight checked the files' headers and sizes; what can still fail is named the same way
            sd = load_file(str(ck / reading))
            missing = drafter.load_state_dict(sd, strict=False)
            if missing.unexpected_keys or any(k in sd for k in missing.missing_keys):
                raise ValueError(f"weights that do not fit the drafter ({missing.unexpected_keys[:3]})")
            reading = "trainer.pt"
            tr = torch.load(ck / reading, map_location=device, weights_only=False)
            opt.load_state_dict(tr["optimizer"])
            sched.load_state_dict(tr["scheduler"])
            torch.set_rng_state(tr["rng_cpu"])
            reading = "state.json"
            resumed_state = json.loads((ck / reading).read_text())
        except (MemoryError, torch.OutOfMemoryError):  # not the file's fault
            raise
        except Exception as e:
            raise RuntimeError(damaged_checkpoint(out, step, f"{reading}: {type(e).__name__}: "
                                                  f"{str(e).splitlines()[0] if str(e) else ''}")) from None
        log.info("resumed from %s (step %d of %d)", ck, step, total)
    start_step = step
    follow = bool(plan.get("follow"))
    if follow:
        # The schedule's length is an estimate; the data's end is the end (or --max-steps).
        stop = cfg.max_steps if cfg.max_steps is not None else None
    else:
        stop = min(total, cfg.max_steps) if cfg.max_steps is not None else total
    spe = plan.get("steps_per_epoch")
    spec = {"seed": cfg.seed, "seq_len": cfg.seq_len, "num_anchors": cfg.num_anchors, "block_size": cfg.block_size,
            "mask_token_id": dcfg.mask_token_id, "gamma": cfg.resolved_gamma, "hidden_size": plan["hidden_size"],
            "num_layers": plan["num_layers_captured"], "hidden_dtype": plan["hidden_dtype"],
            "cache_layers": plan["cache_layers"], "layer_columns": plan["layer_columns"], "topk": plan["topk"],
            "anchors_per_sample": cfg.anchors_per_sample or None}
    accum = plan["accum"]
    B = cfg.block_size
    metrics_file = open(out / "metrics.jsonl", "a") if rank == 0 else None
    tb = _tensorboard(out) if rank == 0 else None
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=stop if stop is not None else total, initial=step, unit="step", desc="train",
                   dynamic_ncols=True)
    recompiles0 = masks.count_recompiles()
    tokens_per_step = cfg.seq_len * accum * world
    wait_total = 0.0
    t_run = time.perf_counter()
    acc = None
    first_micro = True
    last_ckpt = [found[-1] if found else 0]  # the same on every rank: they all call checkpoint() together
    prof = StepProfiler(out, rank, cuda, cfg.profile_steps, step) if cfg.profile_steps else None

    def checkpoint(seg: Segment, in_seg: int) -> None:
        """All ranks call this at the same step (it has barriers); rank 0 writes."""
        if world > 1:
            dist.barrier()
        if rank == 0:
            state = {"step": step, "cache_fingerprint": plan["cache_fingerprint"], "config": asdict(cfg),
                     "drafter": plan["drafter"]}
            if follow:
                done = in_seg >= seg.steps  # at a window's end the next window starts here
                state["follow"] = {"window": seg.key + 1 if done else seg.key, "window_start": step if done else seg.base,
                                   "tokens_before": seg.tokens_before + (seg.tokens if done else 0)}
            else:
                state.update(epoch=step // spe, step_in_epoch=step % spe)
            save_checkpoint(out, step, drafter, opt, sched, state, cfg.keep_checkpoints)
            log.info("checkpoint step-%d saved", step)
            if follow:
                _consumed(cfg, plan, state["follow"]["window"])
        last_ckpt[0] = step
        if world > 1:
            dist.barrier()

    held_out = HeldOut(cfg, out, drafter, device, rank, world) if cfg.eval_cache else None
    if follow:
        fstate = resumed_state.get("follow", {"window": 0, "window_start": 0})
        if rank == 0:  # windows from the resumed one on run again, and are recorded again
            _truncate_jsonl(out / CONSUMED, lambda r: r["window"] < fstate["window"])
        if rank == 0 and found:
            _consumed(cfg, plan, fstate["window"])  # a kill between checkpoint and release: finish it now
        segments = _follow_segments(cfg, plan, rank, world, device, fstate, lambda seg: checkpoint(seg, seg.steps),
                                    lambda: step, lambda: last_ckpt[0], agreed_stop)
    else:
        segments = _epoch_segments(plan, step, stop)
    last_seg = None
    for seg in segments:
        last_seg = seg
        in_seg0 = step - seg.base
        end = seg.steps if stop is None else min(seg.steps, in_seg0 + (stop - step))
        if end <= in_seg0:
            break
        epoch = seg.key
        stream = RowStream(cfg.cache, seg.refs, seg.lengths, spec, seg.key, rank, world, accum, in_seg0, end,
                           pad_rows=follow)
        with spawning():  # loader processes start with the stop signals blocked, then ignore them
            it = iter(make_loader(stream, cfg.loader_workers, cfg.prefetch, pin=cuda))
        for s in range(in_seg0, end):
            if prof is not None:
                prof.before(step + 1)
            t0 = time.perf_counter()
            with phase("data"):
                micro = [next(it) for _ in range(accum)]  # all micro-batches first: the step's weight sum
            t_data = time.perf_counter() - t0
            with phase("to-device"):
                micro = [device_hidden({k: v.to(device, non_blocking=True) for k, v in mb.items()}) for mb in micro]
                wsum = torch.stack([mb["weights"].sum() for mb in micro]).sum().double()
            if world > 1:
                dist.all_reduce(wsum)
            # Each rank's loss is scaled so DDP's gradient average equals the global weighted mean.
            scale = world / wsum.clamp_min(1e-12)
            step_m = None
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            for i, mb in enumerate(micro):
                last = i == accum - 1
                ctx = model.no_sync() if (world > 1 and not last) else _null()
                # The process's first micro-batch compiles the flex kernels (forward, backward):
                # its phases are timed (with GPU syncs, this once) so a slow start says where it is.
                phases = _PhaseTimer(cuda, log, rank) if first_micro else None
                if first_micro:
                    heartbeat(phase="first step: compile" if cuda and cfg.attention != "sdpa" else "first step")
                    fault_point("compile")  # the first micro-batch compiles the flex kernels (GPU)
                first_micro = False
                with ctx:
                    with phase("mask"):
                        if cuda and cfg.attention != "sdpa":
                            mask = masks.flex_block_mask(mb["doc_ids"], mb["anchors"], mb["anchor_valid"], B)
                        else:
                            mask = masks.dense_mask(mb["doc_ids"], mb["anchors"], mb["anchor_valid"], B)
                    _mark(phases, "mask")
                    with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=bf16):
                        with phase("forward"):
                            h = model(mb["target_hidden"], mb["block_ids"], mb["ctx_positions"], mb["block_positions"],
                                      mask)
                        _mark(phases, "forward")
                        with phase("loss"):
                            ls, correct = block_loss(h, drafter.lm_head.weight, mb["labels"], mb["weights"],
                                                     loss_chunk, cfg.loss_impl, soft_ids=mb.get("soft_ids"),
                                                     soft_logprobs=mb.get("soft_logprobs"), soft_weight=cfg.kd_weight)
                        _mark(phases, "loss")
                    with phase("backward"):
                        (ls.double() * scale).float().backward()
                    _mark(phases, "backward")
                if phases is not None:
                    phases.report()
                with phase("metrics"):
                    loss_sum += ls.detach().double()
                    mm = block_metrics(correct, mb["weights"], mb["anchor_valid"], B)
                    step_m = mm if step_m is None else {k: step_m[k] + mm[k] for k in mm}
            with phase("optimizer"):
                gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
                # Metrics and the finiteness check: one all-reduce of a small vector, one sync with the GPU a
                # step on every rank, before the optimizer step: a non-finite loss or gradient is never applied.
                flags = torch.zeros(world + 1, dtype=torch.float64, device=device)
                flags[rank] = (~torch.isfinite(loss_sum)).double()  # whose loss (summed: every rank sees all)
                flags[world] = (~torch.isfinite(gnorm)).double()  # the gradient, averaged over ranks
                vec = torch.cat([loss_sum.view(1), step_m["slot_correct"], step_m["slot_count"],
                                 step_m["tau_sum"].view(1), step_m["blocks"].view(1), flags])
                if world > 1:
                    dist.all_reduce(vec)
                v = vec.cpu().numpy()
                if v[-(world + 1):].any():  # the same on every rank: all stop here, none waits for another
                    raise TrainingDiverged(diverged_message(v[-(world + 1):-1], float(gnorm), step + 1, out,
                                                            last_ckpt[0]))
                if follow:
                    # The schedule runs over the plan's tokens, not over a step count known in advance:
                    # this step's place is the middle of its share of the window's tokens.
                    lr_now = plan["lr"] * _lr_at(min(1.0, (seg.tokens_before + seg.tokens * (s + 0.5) / seg.steps)
                                                 / plan["plan_tokens"]), cfg.warmup_ratio)
                    for group in opt.param_groups:
                        group["lr"] = lr_now
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            step += 1
            fault_point("train-step")
            heartbeat(phase="train", step=step, total_steps=total)
            wait_total += t_data
            if rank == 0:
                loss = float(v[0] / max(wsum.item(), 1e-12))  # a step without scored tokens logs 0, not nan
                sc, cnt = v[1:1 + B], v[1 + B:1 + 2 * B]
                acc = np.where(cnt > 0, sc / np.maximum(cnt, 1), 0.0)
                tau = float(v[1 + 2 * B] / max(v[2 + 2 * B], 1))
                t_step = time.perf_counter() - t0
                rec = {"step": step, "epoch": epoch, "loss": loss, "acc_slot1": float(acc[1]), "tau": tau,
                       "lr": lr_now if follow else sched.get_last_lr()[0], "grad_norm": float(gnorm), "step_time": t_step,
                       "data_wait": t_data / t_step,
                       "acc": [round(float(a), 5) for a in acc[1:]], "tokens": step * tokens_per_step,
                       "recompiles": masks.count_recompiles() - recompiles0}
                if cuda:
                    rec["max_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
                if tb is not None:
                    for k in ("loss", "acc_slot1", "tau", "lr", "grad_norm", "data_wait"):
                        tb.add_scalar(f"train/{k}", rec[k], step)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"loss {loss:.3f} acc1 {acc[1]:.3f} tau {tau:.2f} "
                                        f"{tokens_per_step * bar.format_dict['rate'] if bar.format_dict.get('rate') else 0:.0f} tok/s")
                heartbeat(phase="train", step=step, total_steps=total, stop_step=stop, loss=loss, tau=tau)
                if step == 1 or step % cfg.log_every == 0 or step == stop:
                    log.info("step %d/%d loss %.4f acc1 %.3f tau %.2f lr %.2e step %.3fs data-wait %.1f%% recompiles %d",
                             step, total, loss, acc[1], tau, rec["lr"], t_step, 100 * rec["data_wait"], rec["recompiles"])
            if prof is not None:
                prof.after(step)
            if follow and rank == 0 and s + 1 == seg.steps:
                _record_window(out, seg)
            if step % cfg.checkpoint_every == 0 or (step == stop and cfg.final_checkpoint):
                with phase("checkpoint"):
                    checkpoint(seg, s + 1)
            if cfg.eval_cache and (step % (cfg.eval_every or cfg.checkpoint_every) == 0 or step == stop):
                with phase("held-out"):
                    held_out.measure(step)
            finished = stop is not None and step >= stop  # the same on every rank
            if not finished and agreed_stop():  # a stop request on any rank: all stop after this step
                if last_ckpt[0] != step:
                    checkpoint(seg, s + 1)
                break
        del it
        if stopping[0] or (stop is not None and step >= stop):
            break
    if stopping[0]:
        if follow and last_seg is not None and last_ckpt[0] != step:  # stopped while waiting for shards
            checkpoint(last_seg, step - last_seg.base)
        if bar is not None:
            bar.close()
        if metrics_file:
            metrics_file.close()
        if tb is not None:
            tb.close()
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
        raise Stopped(stopping[0], stopped_message(stopping[0], out))
    if follow and cfg.final_checkpoint and last_seg is not None and last_ckpt[0] != step:
        checkpoint(last_seg, step - last_seg.base)
    elapsed = time.perf_counter() - t_run
    if rank == 0:
        if bar is not None:
            bar.close()
        if cfg.final_checkpoint:
            path = export_drafter(drafter, str(out / EXPORT))
            log.info("exported drafter to %s", path)
            if held_out is not None and held_out.best is not None:
                b = held_out.best
                print(f"best held-out drafter: step {b['step']}, walk tau {b['tau_pooled']:.3f} pooled / "
                      f"{b['tau_per_prompt_mean']:.3f} per-prompt mean, in {out / BEST}", flush=True)
            done = f"{step} steps (about {total} estimated)" if follow else f"{step}/{total} steps"
            if not follow and stop < total:
                done += f" (--max-steps {stop})"
            if found and step == start_step:
                # Resumed from the final checkpoint: nothing left to train (the export is written again).
                log.info("already complete at step-%d: nothing to train", step)
                print(f"already complete: {done}; checkpoints in {out}; export in {path}", flush=True)
            else:
                print(f"trained {done} in {elapsed:.1f}s; checkpoints in {out}; export in {path}", flush=True)
        if metrics_file:
            metrics_file.close()
        if tb is not None:
            tb.close()
    log.info("rank %d done: data wait %.1f%% of %.1fs; recompiles %d", rank, 100 * wait_total / max(elapsed, 1e-9),
             elapsed, masks.count_recompiles() - recompiles0)
    if world > 1:
        dist.barrier()  # no rank tears the group down while another still talks to it
        dist.destroy_process_group()


HELD_OUT_LOG = "heldout.jsonl"
BEST = "best"


class HeldOut:
    """The walk estimate of decoding tau on a held-out cache (evaluate.walk_acceptance), measured
    by rank 0 while the other ranks wait; the best drafter so far is exported to OUT/best/ and
    described in OUT/best.json (written after the export: a best.json always names a complete
    best/). Every measurement is a line of OUT/heldout.jsonl."""

    def __init__(self, cfg: TrainConfig, out: Path, drafter, device: str, rank: int, world: int):
        self.cfg, self.out, self.drafter, self.device, self.rank, self.world = cfg, out, drafter, device, rank, world
        self.best = None
        self.t0 = time.perf_counter()  # the curve of tau against training time
        f = out / "best.json"
        if rank == 0 and f.is_file() and (out / BEST).is_dir():
            try:
                self.best = json.loads(f.read_text())
            except json.JSONDecodeError:  # cut by a kill: the next measurement rewrites it
                self.best = None

    def measure(self, step: int) -> None:
        import torch.distributed as dist

        if self.world > 1:
            dist.barrier()
        if self.rank == 0:
            from dflash_offline.drafter.model import export_drafter
            from dflash_offline.evaluate.run import walk_acceptance

            heartbeat(phase="held-out evaluation", step=step)
            t0 = time.perf_counter()
            est = walk_acceptance(self.cfg.eval_cache, self.drafter, self.device, max_samples=self.cfg.eval_samples)
            rec = {"step": step, "tau_pooled": est["tau_pooled"], "tau_per_prompt_mean": est["tau_per_prompt_mean"],
                   "tau_all_anchors": est["tau_all_anchors"], "rounds": est["rounds"], "samples": est["samples"],
                   "seconds": time.perf_counter() - t0, "train_s": t0 - self.t0}
            better = self.best is None or rec["tau_pooled"] > self.best["tau_pooled"]
            if better:
                export_drafter(self.drafter, str(self.out / BEST))
                tmp = self.out / "best.json.tmp"
                tmp.write_text(json.dumps(rec, indent=1) + "\n")
                os.replace(tmp, self.out / "best.json")
                self.best = rec
            with open(self.out / HELD_OUT_LOG, "a") as f:
                f.write(json.dumps({**rec, "best": better}) + "\n")
            log.info("held-out walk estimate at step %d: tau %.3f pooled, %.3f per-prompt mean (random anchors %.3f), "
                     "%d samples in %.1fs%s", step, rec["tau_pooled"], rec["tau_per_prompt_mean"],
                     rec["tau_all_anchors"], rec["samples"], rec["seconds"], "; best so far -> best/" if better else "")
        if self.world > 1:
            dist.barrier()


class _PhaseTimer:
    """Wall time of the phases of one micro-batch, each closed by a device sync."""

    def __init__(self, cuda: bool, logger, rank: int):
        import torch

        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.log, self.rank = logger, rank
        self.t = time.perf_counter()
        self.times: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.times.append((name, now - self.t))
        self.t = now
        heartbeat(phase=f"first step: {name} done")

    def report(self) -> None:
        import torch

        parts = ", ".join(f"{n} {t:.1f}s" for n, t in self.times)
        self.log.info("rank %d first micro-batch (compiles the flex kernels): %s", self.rank, parts)
        try:  # dynamo's own account: which frames compiled and how long each took
            self.log.info("compile times:\n%s", torch._dynamo.utils.compile_times(repr="str"))
        except Exception as e:  # a private API: its absence must not stop training
            self.log.info("compile times unavailable (%s)", e)


def _mark(phases: _PhaseTimer | None, name: str) -> None:
    if phases is not None:
        phases.mark(name)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records past the checkpoint we resume from: those steps run again."""
    _truncate_jsonl(path, lambda r: r["step"] <= step)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:
        log.info("tensorboard not installed: metrics go to metrics.jsonl only (pip install tensorboard)")
        return None
    return SummaryWriter(str(out / "tensorboard"))
