"""Train's preflight: every check before any work (cache complete and intact, made from this target,
layers, soft targets, memory, held-out cache, resume settings), and the plan it hands to each rank.

Runs in the launcher (or each torchrun rank) with no torch.distributed and no model: a run that
cannot work is refused in one line before any process starts.
"""

from __future__ import annotations

import dataclasses

import logging
import math
import time
from pathlib import Path

from dflash_offline.cache.location import Location
from dflash_offline.cache.manifest import ManifestStore, committed_names
from dflash_offline.options import also, where
from dflash_offline.cache.view import ManifestView
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.warm_start import plan_start
from dflash_offline.train.config import TrainConfig
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.launch import check_devices_exist, parse_devices, torchrun_launch
from dflash_offline.runtime.logs import heartbeat
from dflash_offline.train.resume import check_resume
from dflash_offline.train.follow import window_misfit
from dflash_offline.train.plan import EpochPlan, FollowPlan, TrainPlan
from dflash_offline.runs.folder import BEST, EXPORT
from dflash_offline.runtime.paths import require_kind
from dflash_offline.targets.folder import read_target

log = logging.getLogger("dflash.train")


def step_accumulation(cfg: TrainConfig, world: int, warnings: list[str]) -> int:
    """Micro-batches per rank and step; a line for `warnings` when that rounds --global-batch-tokens
    (a step is whole rows of --seq-len on every rank)."""
    from dflash_offline.blocks.packing import accumulation

    accum = accumulation(cfg.global_batch_tokens, cfg.seq_len, world)
    if accum * world * cfg.seq_len != cfg.global_batch_tokens:
        warnings.append(f"{where(cfg, 'global_batch_tokens')} {cfg.global_batch_tokens} is not a multiple of {world} "
                        f"rank(s) x {also(cfg, 'seq_len')} {cfg.seq_len}: each step takes "
                        f"{accum * world * cfg.seq_len} tokens ({accum} micro-batches per rank)")
    return accum


def _say(warnings: list[str]) -> None:
    """The preflight's warnings, once every refusal has had its turn: a refused run prints one line."""
    for line in warnings:
        log.warning("%s", line)


def preflight(cfg: TrainConfig) -> TrainPlan:
    from dflash_offline.cache.reader import cache_reader, checked_shards
    from dflash_offline.drafter.export import check_export_dest
    from dflash_offline.blocks.packing import manifest_fingerprint, epoch_order, steps_per_epoch
    from dflash_offline.blocks.pieces import pack_pieces, scan_samples

    cfg.validate()
    require_kind(cfg.cache, where(cfg, "cache"), True, "the cache folder extract wrote (the one with manifest.json)")
    require_kind(cfg.eval_cache, where(cfg, "eval_cache"), True, "a held-out cache folder (the one with manifest.json)")
    if cfg.eval_cache and Path(cfg.eval_cache).resolve() == Path(cfg.cache).resolve():
        _refuse_training_cache_as_held_out(cfg)  # the same folder: before its shards are read (a copy: below)
    for dest in (EXPORT, BEST):  # the run ends writing them: refused now, not after the training
        check_export_dest(Path(cfg.out).absolute() / dest)
    devices = parse_devices(cfg.devices, where(cfg, "devices"))
    if torchrun_launch() is None:
        check_devices_exist(devices, where(cfg, "devices"))
    if cfg.follow:
        return _preflight_follow(cfg, devices)
    reader = cache_reader(cfg.cache, where(cfg, "cache"))
    m = reader.manifest
    v = ManifestView.of(m)
    if v.status != "complete":
        if Location(cfg.cache).run_lock_held():  # its extract still runs: running it again would meet the lock
            raise UserError(f"{where(cfg, 'cache')} {cfg.cache}: an extract is still writing it ({v.shards_committed}/"
                            f"{v.num_shards} shards committed); wait for it to end, or train alongside it with "
                            f"--follow --epochs 1")
        raise UserError(f"{where(cfg, 'cache')} {cfg.cache}: extraction is not complete ({v.shards_committed}/{v.num_shards} "
                        "shards); finish it by running the extract command again, or train with --follow --epochs 1")
    _check_cache_target(cfg, v)
    if v.released:
        raise UserError(f"{where(cfg, 'cache')} {cfg.cache}: {v.released} of its shards were consumed and deleted by a "
                        "streaming trainer (train --follow --stream), so it no longer holds all its samples; "
                        "extract a new cache")
    t0 = time.time()
    shards = list(checked_shards(reader, f"{where(cfg, 'cache')} {cfg.cache}", cfg.verify))
    table = scan_samples(shards, cfg.seq_len, cfg.long_samples)
    refs = table.refs
    # A cache whose loss masks are all zero trains nothing (counted already when a sample is long;
    # else read until one token is scored: the first shard, for any real data, one byte a token).
    scored = table.long.trained > 0 or any(sh.group["loss_mask"][:].any() for _, sh in shards)
    log.info("cache: %d shards, %d samples checked (%s) in %.1fs", len(reader.shard_names), len(refs), cfg.verify,
             time.time() - t0)
    if not scored:
        raise UserError(f"{where(cfg, 'cache')} {cfg.cache}: every loss_mask value is 0, so no token would be trained on; extract "
                        "data whose loss_mask marks the tokens to learn (e.g. 1 on the completions)")
    target_layers, layer_columns = layer_choice(cfg, v)
    _check_row_memory(cfg, len(target_layers) * v.hidden_size)
    warnings: list[str] = []
    topk = _check_soft_targets(cfg, v, warnings)
    dcfg = _drafter_config(cfg, target_layers, v)
    world = _world(devices)
    accum = step_accumulation(cfg, world, warnings)
    # Rows per epoch vary a little with the order; every epoch runs as many steps as the
    # shortest one has, so a step never meets a missing row.
    rows = min(len(pack_pieces(table.pieces, epoch_order(len(refs), cfg.seed, e), cfg.seq_len)) for e in range(cfg.epochs))
    spe = steps_per_epoch(rows, world, accum)
    if spe == 0:
        raise UserError(f"the cache packs into {rows} rows of {cfg.seq_len} tokens, fewer than one step needs "
                        f"({world} ranks x {accum} micro-batches); lower --global-batch-tokens or --seq-len")
    plan = TrainPlan(
        devices=devices, world=world, accum=accum, total_steps=spe * cfg.epochs, drafter=dcfg,
        cache_fingerprint=manifest_fingerprint(m), hidden_size=v.hidden_size,
        target_layer_count=len(target_layers), cache_layers=len(v.layer_ids), layer_columns=layer_columns,
        topk=topk, hidden_dtype=v.hidden_dtype, lr=cfg.resolved_lr(v.hidden_size),
        epochs=EpochPlan(refs=refs, lengths=table.lengths, pieces=table.pieces, rows_per_epoch=rows,
                         steps_per_epoch=spe),
    )
    log.info("plan: %d rows/epoch, %d ranks x %d micro-batches of %d tokens per step, %d steps/epoch, %d steps total",
             rows, world, accum, cfg.seq_len, spe, plan.total_steps)
    log.info("recipe: layers %s of the cache's %s, lr %.3g%s, %d anchors per row, %s per sample, kd weight %g",
             target_layers, list(v.layer_ids), plan.lr, " (auto)" if cfg.lr is None else "", cfg.num_anchors,
             cfg.anchors_per_sample or "one draw", cfg.kd_weight)
    if cfg.eval_cache:
        _check_eval_cache(cfg, target_layers, v, m, warnings)
    # Every sample fits: split and truncate make the same rows, so either resumes the other.
    check_resume(cfg, plan.cache_fingerprint, moot=() if table.long.long else ("long_samples",))
    long_line = table.long.line(where(cfg, "seq_len"), also(cfg, "seq_len"), also(cfg, "long_samples"))
    _say(warnings + ([long_line] if long_line else []))  # after the refusals: a warning never precedes an error line
    return plan



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
        raise UserError(f"{where(cfg, 'seq_len')} {cfg.seq_len}: one row of hidden states needs {row / 1e9:.1f} GB of host memory "
                        f"({features} features a token in bf16), more than half of the {avail / 1e9:.1f} GB available; "
                        "lower --seq-len")


def _check_cache_target(cfg: TrainConfig, v: ManifestView) -> None:
    info = read_target(cfg.target, where(cfg, "target"))
    # The shapes too: a hand-edited manifest keeps the fingerprints but not the rows' widths.
    for key, theirs, mine in (("hidden_size", v.hidden_size, info.hidden_size),
                              ("vocab_size", v.vocab_size, info.vocab_size),
                              ("num_layers", v.num_target_layers, info.num_target_layers)):
        if theirs != mine:
            raise UserError(f"{where(cfg, 'cache')} {cfg.cache} was made from another target (its manifest says "
                            f"target.{key} {theirs}, from {v.target_path}), but {also(cfg, 'target')} {cfg.target} has "
                            f"{mine}: give the target the cache was made from, or extract a cache with this one")
    for key, theirs, mine in (("weights_fingerprint", v.weights_fingerprint, info.weights_fingerprint),
                              ("config_sha256", v.config_sha256, info.config_sha256)):
        if theirs != mine:
            raise UserError(f"{where(cfg, 'cache')} {cfg.cache} was extracted from another target (target.{key} differs from "
                            f"{where(cfg, 'target')} {cfg.target}); extract a cache with this target or pass the one it was made from")
    if v.hidden_dtype not in ("bfloat16", "float8_e4m3fn"):
        raise UserError(f"{where(cfg, 'cache')} {cfg.cache} stores hidden states as {v.hidden_dtype!r}, which this "
                        "version cannot read (bfloat16, float8_e4m3fn); re-extract with --hidden-dtype bfloat16 or fp8")


def _drafter_config(cfg: TrainConfig, target_layers: list[int], v: ManifestView):
    """The drafter's config (DrafterConfig) from the target and the options (its mask token and the
    --init-layers start checked against the target: shapes only, no tensor loaded), with the
    cache's chat settings."""
    dcfg = DrafterConfig.from_target(cfg.target, target_layers, block_size=cfg.block_size,
                                     drafter_layers=cfg.drafter_layers, mask_token_id=cfg.mask_token_id,
                                     mask_flag=where(cfg, "mask_token_id"))
    dcfg.chat = v.chat  # how the training text was rendered: carried into the export
    if cfg.method == "dspark":
        dcfg = dataclasses.replace(dcfg, method="dspark", markov_rank=cfg.markov_rank,
                                   markov_head_type=cfg.markov_head, confidence_head=cfg.confidence_head)
    if cfg.init_layers:
        plan_start(cfg.target, cfg.init_layers, dcfg,  # headers only: one line if they do not fit
                   flags=(where(cfg, "init_layers"), where(cfg, "drafter_layers")))
    return dcfg


def layer_choice(cfg: TrainConfig, v: ManifestView) -> tuple[list[int], list[int] | None]:
    """(layer ids the drafter reads, their columns in the cache's rows, or None for all of them).
    `--target-layers` picks a subset of the captured layers by id; the drafter reads them in the
    cache's order, as a cache holding only those layers would store them."""
    captured = list(v.layer_ids)
    if cfg.target_layers is None:
        return captured, None
    missing = v.missing_layers(cfg.target_layers)
    if missing:
        raise UserError(f"{where(cfg, 'target_layers')} {','.join(map(str, cfg.target_layers))}: the cache {cfg.cache} "
                        f"holds layers {captured}, not {missing}; choose among those, or extract a cache with "
                        "--capture-layers that include them")
    chosen = [i for i in captured if i in cfg.target_layers]
    return chosen, v.layer_columns(chosen)


def _check_soft_targets(cfg: TrainConfig, v: ManifestView, warnings: list[str]) -> int:
    """Top-k entries the loss reads: 0 without --kd-weight; the cache must hold them with it.
    DSpark reads them for p_target where the cache has them (without: one-hot, with a warning)."""
    if cfg.distribution_loss:
        if v.topk == 0 and cfg.resolved_tv_weight:
            warnings.append(f"the cache {cfg.cache} holds no top-k (extracted with --topk 0): the L1 term compares the "
                            "drafter with the data token alone (p_target one-hot); extract with --topk 32 for the "
                            "target's distribution")
        return v.topk
    if cfg.kd_weight == 0:
        return 0
    k = v.topk
    if k == 0:
        raise UserError(f"{where(cfg, 'kd_weight')} {cfg.kd_weight}: the cache {cfg.cache} holds no top-k log-probabilities "
                        "(extracted with --topk 0); extract with --topk 32, or train with --kd-weight 0")
    return k


def _world(devices: list[str]) -> int:
    launch = torchrun_launch()
    return launch.world_size if launch is not None else len(devices)


def _preflight_follow(cfg: TrainConfig, devices: list[str]) -> TrainPlan:
    """--follow: the cache may still be empty or missing; what is fixed now is its identity (target,
    capture, plan), the schedule (from the plan's token count) and the window rule. Which rows a
    step trains on is fixed once its window's shards are committed (`follow_window_rows`)."""
    from dflash_offline.blocks.packing import follow_fingerprint

    store = ManifestStore(Location(cfg.cache, where(cfg, "cache")))
    t0 = last = time.time()
    while (m := store.read()) is None:
        if time.time() - last > 30:
            log.info("waiting for %s/manifest.json (no extraction has started there yet) for %.0fs", cfg.cache,
                     time.time() - t0)
            last = time.time()
        heartbeat(phase="waiting for the cache", cache=cfg.cache)
        time.sleep(0.5)
    v = ManifestView.of(m)
    _check_cache_target(cfg, v)
    tokens = v.plan_tokens
    if tokens is None:
        raise UserError(f"{where(cfg, 'cache')} {cfg.cache} was made by an older version (its plan has no token count), so --follow "
                        "cannot size the schedule; train without --follow once extraction is complete")
    problem = window_misfit(cfg, m)
    if problem:
        raise UserError(problem)
    mine = str(Path(cfg.out).resolve())
    others = sorted(c for c in v.consumers if c != mine)
    if v.released and mine not in v.consumers:
        raise UserError(f"{where(cfg, 'cache')} {cfg.cache}: {v.released} shards were already consumed and deleted by "
                        f"another trainer ({', '.join(others)}); this run would miss them; extract a new cache")
    budget, biggest = v.budget_bytes, v.max_shard_bytes
    if budget and biggest and not cfg.stream and v.num_shards * biggest > budget:
        raise UserError(f"{where(cfg, 'cache')} {cfg.cache} has a budget ({budget / 1e6:.1f} MB) that holds about "
                        f"{budget // biggest} of its {v.num_shards} shards; without --stream nothing is "
                        "released and both stages would wait forever: add --stream")
    target_layers, layer_columns = layer_choice(cfg, v)
    warnings: list[str] = []
    topk = _check_soft_targets(cfg, v, warnings)
    dcfg = _drafter_config(cfg, target_layers, v)
    if cfg.eval_cache:
        _check_eval_cache(cfg, target_layers, v, m, warnings)
    world = _world(devices)
    accum = step_accumulation(cfg, world, warnings)
    # An estimate for the progress bar and the log: windows pack separately and fill their last
    # step with empty rows, so a run takes more steps. The learning rate follows the tokens
    # trained, not this count (`schedule.lr_at`).
    total = max(1, math.ceil(tokens / (cfg.seq_len * world * accum)))
    plan = TrainPlan(
        devices=devices, world=world, accum=accum, total_steps=total, drafter=dcfg,
        cache_fingerprint=follow_fingerprint(m), hidden_size=v.hidden_size,
        target_layer_count=len(target_layers), cache_layers=len(v.layer_ids), layer_columns=layer_columns,
        topk=topk, hidden_dtype=v.hidden_dtype, lr=cfg.resolved_lr(v.hidden_size),
        follow=FollowPlan(num_shards=v.num_shards, consumer=mine, plan_tokens=int(tokens)),
    )
    log.info("plan (follow%s): %d shards planned, %d committed so far, %d tokens; windows of %d shards; %d ranks x %d "
             "micro-batches of %d tokens per step; about %d steps", ", stream" if cfg.stream else "",
             v.num_shards, len(committed_names(m)), tokens, cfg.follow_window, world, accum, cfg.seq_len,
             total)
    # Extract cut every sample to capture.max_len tokens: when that fits a row, split and truncate
    # make the same rows. Otherwise each window says what it splits (or cuts) as it comes.
    fits = v.max_len is not None and v.max_len <= cfg.seq_len
    check_resume(cfg, plan.cache_fingerprint, moot=("long_samples",) if fits else ())
    # Last, under the manifest's lock: two trainers started at once cannot both pass as the only one.
    store.register_consumer(mine, cfg.stream)
    _say(warnings)
    return plan


def _check_eval_cache(cfg: TrainConfig, target_layers: list[int], v: ManifestView, m: dict, warnings: list[str]) -> None:
    """--eval-cache, before any process starts: complete, from the same target, with the layers,
    and not the training cache (a line for `warnings` when it was extracted from the same input)."""
    from dflash_offline.cache.reader import cache_reader, check_shards

    try:
        held = ManifestStore(Location(cfg.eval_cache, where(cfg, "eval_cache"))).read_committed()  # an edited one: before training
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{where(cfg, 'eval_cache')} {cfg.eval_cache}: unreadable manifest ({type(e).__name__}: {e})") from None
    if held is None:
        raise UserError(f"{where(cfg, 'eval_cache')} {cfg.eval_cache}: no cache there (no manifest.json); extract the held-out "
                        "completions into it first")
    held_v = ManifestView.of(held)
    if held_v.status != "complete":
        raise UserError(f"{where(cfg, 'eval_cache')} {cfg.eval_cache}: extraction is not complete; finish it first")
    if held_v.weights_fingerprint != v.weights_fingerprint:
        raise UserError(f"{where(cfg, 'eval_cache')} {cfg.eval_cache} was extracted from another target than "
                        f"{also(cfg, 'cache')} {cfg.cache}")
    if (held_v.hidden_size, held_v.vocab_size) != (v.hidden_size, v.vocab_size):
        raise UserError(f"{where(cfg, 'eval_cache')} {cfg.eval_cache}: its manifest says hidden_size {held_v.hidden_size} "
                        f"and vocab_size {held_v.vocab_size}, the target's are {v.hidden_size} and {v.vocab_size}; the "
                        "manifest is damaged: re-extract the held-out cache")
    missing = [i for i in target_layers if i not in held_v.layer_ids]
    if missing:
        raise UserError(f"{where(cfg, 'eval_cache')} {cfg.eval_cache} holds layers {list(held_v.layer_ids)}, not {missing} "
                        "that the drafter reads; extract it with the training cache's layers")
    # Its shards now, not at the first held-out evaluation hours into the run.
    check_shards(cache_reader(cfg.eval_cache, where(cfg, "eval_cache")), f"{where(cfg, 'eval_cache')} {cfg.eval_cache}",
                 cfg.verify)
    same_input = held.get("source") == m.get("source")
    if same_input and held.get("capture") == m.get("capture"):  # a copy of the training cache
        _refuse_training_cache_as_held_out(cfg)
    if same_input:
        warnings.append(f"{where(cfg, 'eval_cache')} {cfg.eval_cache} was extracted from the same input as "
                        f"{also(cfg, 'cache')} {cfg.cache}: its estimate measures the training data, not held-out data")


def _refuse_training_cache_as_held_out(cfg: TrainConfig) -> None:
    raise UserError(f"{where(cfg, 'eval_cache')} {cfg.eval_cache} is the training cache ({also(cfg, 'cache')} "
                    f"{cfg.cache}): the held-out estimate and best/ would be chosen on training data; extract the "
                    "target's completions of held-out prompts into a cache of their own")
