"""Stage one: run the frozen target over the input and commit hidden states shard by shard.

Shape of a run:
  launcher (or each torchrun rank): log file -> preflight (no weights) -> manifest created/checked
  -> one worker *process* per device -> each worker: its shards, batch by batch:
       forward on its one thread (`worker.py`) -> async copy into shared, page-locked host slots
       -> a writer *process* (`sink.py`, `writer_process.py`: numpy and Zarr, no torch) writes
       whole chunks into the shard's Zarr group, and at the shard's end renames it into place and
       commits it in manifest.json under a lock (`cache/shards.py`).

This module is the launcher: preflight, the cache's locks and manifest, the worker processes and
their supervision, the summary. The plan (which rows make which shard, in which order) is a pure
function of the input and the options, never of the number of workers (`plan.py`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import NamedTuple

import numpy as np

from dflash_offline.options import where
from dflash_offline.cache.manifest import ManifestStore, binds_nothing, check_compatible, committed_names, new_manifest
from dflash_offline.cache.debris import refuse_foreign_shards
from dflash_offline.cache.location import Location
from dflash_offline.cache.shards import delete_released, shard_name
from dflash_offline.config import ExtractConfig
from dflash_offline.extract.messages import Paused, Progress
from dflash_offline.extract.plan import Job, bytes_per_token, pass_plan, reserved_bytes
from dflash_offline.extract.worker import log_folder, worker_entry, worker_run
from dflash_offline.rows.parts import chat_settings_of, check_made_for, check_part_folders, check_part_hashes
from dflash_offline.cache.evidence import DegenerateLayer
from dflash_offline.runtime.errors import UserError, no_room_reason
from dflash_offline.runtime.launch import (Launch, check_devices_exist, join_ranks, parse_devices,
                                           resolve_compute_dtype, torchrun_launch)
from dflash_offline.runtime.early_log import open_launcher_log
from dflash_offline.runtime.logs import claim_heartbeat, heartbeat, log_dir_refusal
from dflash_offline.runtime.paths import refuse_foreign_folder
from dflash_offline.runtime.signals import Stopped, install_stop_handlers, signal_name, stop_requested
from dflash_offline.runtime.supervise import run_workers, wait_for_other_ranks
from dflash_offline.runtime.units import human_bytes
from dflash_offline.targets import model as target
from dflash_offline.targets.folder import read_target

log = logging.getLogger("dflash.extract")
# What a cache location holds before its first manifest (a refused or killed first run): anything
# else there was not made by extract, and is never written into.
CACHE_OWN_ENTRIES = {"logs", "shards", ".run.lock", ".manifest.lock"}


def worker_device(devices: list[str], launch: Launch | None, rank: int) -> str:
    """The device of one worker: the listed one, or under torchrun cuda:LOCAL_RANK (cpu if all listed are cpu)."""
    if launch is None:
        return devices[rank]
    return "cpu" if all(d == "cpu" for d in devices) else f"cuda:{launch.local_rank}"


class Preflight(NamedTuple):
    """What preflight hands the launcher: the workers' job, the manifest this run wants, the
    devices, and the tokens still to extract (the bar's total)."""

    job: Job
    wanted: dict
    devices: list[str]
    todo_tokens: int


def preflight(cfg: ExtractConfig, loc, launch: Launch | None) -> Preflight:
    """All checks that need no weights. Raises UserError; writes nothing to the cache."""
    from dflash_offline.rows import reader as data

    cfg.validate()
    devices = parse_devices(cfg.devices, where(cfg, "devices"))
    info = read_target(cfg.target, where(cfg, "target"))
    layer_ids = target.resolve_layers(info, cfg)
    target.check_topk(info, cfg.topk, where(cfg, "topk"))
    if launch is None:
        check_devices_exist(devices, where(cfg, "devices"))
    if loc.remote and (len(devices) > 1 or (launch and launch.world_size > 1)):
        raise UserError(
            f"{where(cfg, 'cache')} {cfg.cache}: several workers need a lock to share one manifest, and URL caches "
            "(object stores) have none; use a local or shared file system path, or one device"
        )
    compute_dtype = resolve_compute_dtype(cfg.compute_dtype, devices, launch,
                                          (where(cfg, "devices"), where(cfg, "compute_dtype")))
    t0 = time.time()
    check_part_folders(cfg.data, where(cfg, "data"))
    source = data.scan(cfg.data, info.vocab_size, where(cfg, "data"))
    log.info("input: %d files, %d rows, %d tokens (scanned in %.1fs)", len(source.files), source.rows,
             int(source.lengths.sum()), time.time() - t0)
    data.require_trained(source, f"{where(cfg, 'data')} {' '.join(map(str, cfg.data))}")
    check_made_for(cfg.data, info, where(cfg, "data"), where(cfg, "target"))
    check_part_hashes(source, where(cfg, "data"))
    cut_away = _check_lengths(cfg, info, source)
    # After the options, devices and data (building the model on the meta device costs seconds, the
    # import of transformers: those refusals come first and fast), before the existing cache is
    # compared with this run (a broken target is the cause to name, not the mismatch it makes).
    target.check_weights(info, info.num_target_layers if cfg.topk > 0 else max(layer_ids) + 1, cfg.topk > 0)
    shards, tokens_of, wanted = _planned_manifest(cfg, info, source, layer_ids, compute_dtype)
    committed = _committed_before(cfg, loc, launch, wanted)
    todo_tokens = sum(t for j, t in enumerate(tokens_of) if shard_name(j) not in committed)
    bpt = bytes_per_token(len(layer_ids), info.hidden_size, cfg.topk, cfg.hidden_dtype)
    shard_bytes = _check_room(cfg, loc, tokens_of, todo_tokens, bpt)
    # Warnings only once the run is accepted: a refused run prints one line.
    truncated = int((source.lengths > cfg.max_len).sum())
    if truncated:
        log.warning("%d of %d samples are longer than --max-len %d and are truncated%s", truncated, source.rows,
                    cfg.max_len, f"; {cut_away} of them keep no token to train on (their completions start past it)"
                    if cut_away else "")
    warning = target.check_kernels(info, devices)
    if warning:
        log.warning(warning)
    log.info("plan: %d shards, %d tokens (%d to do), %.2f GB estimated (%d bytes/token), layers %s, topk %d",
             len(shards), sum(tokens_of), todo_tokens, sum(tokens_of) * bpt / 1e9, bpt, layer_ids, cfg.topk)
    job = Job(
        cfg=cfg, target_path=str(info.path), layer_ids=layer_ids, hidden_size=info.hidden_size,
        source=source.state(), shards=shards, compute_dtype=compute_dtype, shard_bytes=shard_bytes,
    )
    return Preflight(job, wanted, devices, todo_tokens)


def _check_lengths(cfg: ExtractConfig, info, source) -> int:
    """Refuses rows longer than the target's context that --max-len does not cut (the target never
    saw such positions: its states there are not what serving sees), and a --max-len that cuts every
    completion away. Returns how many rows with a completion keep none of it."""
    ctx = info.max_positions
    if ctx is not None and cfg.max_len > ctx:
        over = np.flatnonzero(source.lengths > ctx)
        if over.size:
            r = int(over[np.argmax(source.lengths[over])])
            fi, fr = source.file_of_row(r)
            raise UserError(f"{where(cfg, 'data')}: {over.size} rows are longer than the target's context ({ctx} positions, "
                            f"max_position_embeddings; the longest has {int(source.lengths[r])} tokens: "
                            f"{source.files[fi].path} row {fr}); give {where(cfg, 'max_len')} {ctx} (or less) to cut them "
                            "there")
    first = source.first_trained
    if first is None:
        return 0
    has = first < source.lengths  # rows with a completion
    kept = has & (first < cfg.max_len)
    if has.any() and not kept.any():
        raise UserError(f"{where(cfg, 'max_len')} {cfg.max_len} cuts every row's completion away (the earliest starts at "
                        f"position {int(first[has].min())}): nothing would be left to train on; raise "
                        f"{where(cfg, 'max_len')} past the prompts")
    return int((has & ~kept).sum())


def _planned_manifest(cfg: ExtractConfig, info, source, layer_ids: list[int], compute_dtype: str):
    """The shards (row lists, every pass after another), their tokens after --max-len, and the
    manifest this run wants."""
    # make_plan's passes, built once and kept apart for the manifest's shards_per_pass.
    per_pass = [pass_plan(source.lengths, cfg.max_len, cfg.shard_tokens, cfg.sort_window, p) for p in range(cfg.passes)]
    shards = [s for plan in per_pass for s in plan]
    tl = np.minimum(source.lengths, cfg.max_len)
    tokens_of = [int(tl[rows].sum()) for rows in shards]
    wanted = new_manifest(
        target=info.manifest_entry(),
        capture={"layer_ids": layer_ids, "topk": cfg.topk, "hidden_dtype": cfg.hidden_dtype, "max_len": cfg.max_len,
                 "compute_dtype": compute_dtype},
        source=source.manifest_entry(),
        plan={"shard_tokens": cfg.shard_tokens, "sort_window": cfg.sort_window, "num_shards": len(shards),
              "tokens": sum(tokens_of),
              **({"passes": cfg.passes, "shards_per_pass": [len(plan) for plan in per_pass]} if cfg.passes > 1 else {})},
    )
    chat = chat_settings_of([p for p in cfg.data if os.path.isdir(p)])
    if chat is not None:  # how the text was rendered (prepare's record): travels on to the export
        wanted["chat"] = {k: v for k, v in chat.items() if k != "template"}
    return shards, tokens_of, wanted


def _committed_before(cfg: ExtractConfig, loc, launch: Launch | None, wanted: dict) -> set[str]:
    """The shards an earlier run on this cache committed (none for a new cache, or for an earlier
    attempt that committed nothing under other settings, which this run replaces)."""
    existing = ManifestStore(loc).read()
    if existing is None:
        return set()
    try:
        check_compatible(existing, wanted, loc.url("manifest.json"))
    except UserError as e:
        if not binds_nothing(existing):
            raise
        if launch is not None:  # no run lock under torchrun: another job may be starting there
            raise UserError(f"{e}; no shard is committed there yet: delete {loc.url('manifest.json')} (an "
                            "earlier attempt's) to start anew with this run's settings") from None
        return set()  # an earlier attempt that committed nothing: replaced once the run lock is held
    return committed_names(existing)


def _check_room(cfg: ExtractConfig, loc, tokens_of: list[int], todo_tokens: int, bpt: int) -> list[int]:
    """Refuses a run whose shard cannot fit --max-bytes or whose data cannot fit the free space.
    Returns each shard's reserved bytes (the budget's unit)."""
    need, whole = todo_tokens * bpt, sum(tokens_of) * bpt
    shard_bytes = [reserved_bytes(t, bpt, cfg.chunk_tokens) for t in tokens_of]
    if cfg.max_bytes is not None:
        if max(shard_bytes) > cfg.max_bytes:
            j = int(np.argmax(shard_bytes))
            raise UserError(
                f"{where(cfg, 'max_bytes')} {human_bytes(cfg.max_bytes)} cannot hold one shard: {shard_name(j)} needs about "
                f"{human_bytes(shard_bytes[j])} ({tokens_of[j]} tokens x {bpt} bytes/token); raise "
                "--max-bytes, or lower --shard-tokens, --max-len, --topk or the number of layers")
        if whole > cfg.max_bytes:
            log.warning("the cache (%s) is larger than --max-bytes %s: workers pause whenever the budget is full, "
                        "until a consumer (`train --follow --stream`) releases shards", human_bytes(whole),
                        human_bytes(cfg.max_bytes))
    free = loc.free_bytes()
    room = need if cfg.max_bytes is None else min(need, cfg.max_bytes)
    if free is not None and room > free:
        raise UserError(
            f"the cache needs about {human_bytes(room)} more ({todo_tokens} tokens x {bpt} bytes/token"
            + ("" if cfg.max_bytes is None or need <= cfg.max_bytes else ", bounded by --max-bytes")
            + f") but {loc.path()} has {human_bytes(free)} free; free space or choose another --cache"
        )
    return shard_bytes


def run(cfg: ExtractConfig) -> dict:
    """The `extract` command. Returns the final manifest."""
    launch = torchrun_launch()
    cfg.validate()  # no log folder for a run that names no cache
    loc = Location(cfg.cache, where(cfg, "cache"))
    name = f"extract-rank{launch.rank}" if launch else "extract-launcher"
    why = loc.unwritable()
    if why:
        raise UserError(f"{where(cfg, 'cache')} {cfg.cache}: cannot write there ({why}); choose a writable location")
    if not loc.remote and not os.path.exists(loc.path("manifest.json")):  # before its log folder is made
        refuse_foreign_folder(loc.path(), where(cfg, "cache"), "a cache", "manifest.json", CACHE_OWN_ENTRIES,
                              ("manifest.json.tmp-",))
        # shards/ is ours only if it holds shard folders (a killed first run's debris), nothing else.
        refuse_foreign_folder(loc.path("shards"), where(cfg, "cache"), "a cache", "manifest.json", set(),
                              ("shard-", "tmp-shard-"))
        refuse_foreign_shards(loc.path(), where(cfg, "cache"))  # and those hold only what zarr writes
    try:  # CACHE/logs/ once the cache is held (claim_heartbeat): a refusal leaves no folder behind
        log_path = open_launcher_log(log_folder(cfg, loc), name)
    except OSError as e:  # before anything else: no log, no cache, one line
        if refusal := log_dir_refusal(cfg.log_dir, e, where(cfg, "log_dir")):
            raise refusal from None
        raise UserError(f"{where(cfg, 'cache')} {cfg.cache}: cannot write its log folder {log_folder(cfg, loc)} "
                        f"({e.strerror or e}); choose a writable location (or --log-dir)") from None
    # SIGTERM/SIGINT: stop at the next batch; the shards handed over whole commit, the one in progress goes
    install_stop_handlers(safe_point="the next batch (seconds): the shard in progress is dropped and written anew on "
                                     "resume, the shards before it commit")
    join_ranks(launch)  # a launch other than torchrun: every rank is there before any work
    t0 = time.time()
    heartbeat(phase="preflight")
    job, wanted, devices, todo_tokens = preflight(cfg, loc, launch)
    if stop_requested():
        raise Stopped(stop_requested(), f"stopped on {signal_name(stop_requested())} before any work; "
                      "nothing changed; run the same command again to start")

    if launch is None:
        try:
            run_lock = loc.try_run_lock()  # held until this process exits
        except OSError as e:
            raise UserError(f"{where(cfg, 'cache')} {cfg.cache}: cannot write there ({e.strerror or e}); choose a writable "
                            "location") from None
        if run_lock is None:
            raise UserError(f"{where(cfg, 'cache')} {cfg.cache}: another extract is running on this cache (it holds "
                            f"{loc.path('.run.lock')}); wait for it or stop it, then run again")
    claim_heartbeat()  # this process holds the cache now: a refused rerun never wrote its heartbeat
    store = ManifestStore(loc)
    if launch is None:
        differs = store.replace_unbound(wanted)
        if differs is not None:
            log.warning("an earlier attempt on this cache committed no shard (%s): its manifest is replaced by this "
                        "run's settings", differs)
    store.init_or_check(wanted)
    if launch is None or launch.rank == 0:
        store.set_budget(cfg.max_bytes, max(job.shard_bytes))
        _finish_releases(store)
    if launch is None:
        # Before any worker starts: a killed run's reservations would let a later shard be admitted
        # ahead of an earlier one (each torchrun rank drops its own instead).
        store.drop_reservations(set((store.read().get("reserved") or {})))
    loc.makedirs("shards")
    if launch is not None:
        device = worker_device(devices, launch, launch.rank)
        worker_run(launch.rank, launch.world_size, device, job, progress=None,
                   show_bar=cfg.progress and launch.rank == 0, todo_tokens=todo_tokens)
        if launch.rank == 0 and not stop_requested():
            wait_for_other_ranks(store.read,
                                 lambda m: f"{len(committed_names(m))}/{m['plan']['num_shards']} shards committed")
        stopped = stop_requested()
    else:
        stopped = _launch_workers(job, devices, todo_tokens, cfg.progress, log_folder(cfg, loc))
    manifest = store.read()
    if stopped and manifest["status"] != "complete":  # a request that came after the last shard: done
        done = len(committed_names(manifest))
        raise Stopped(stopped, f"stopped on {signal_name(stopped)}: {done}/{manifest['plan']['num_shards']} shards "
                      "committed, none half-written (a shard in progress is written anew); run the same command "
                      "again to resume")
    _summary(manifest, time.time() - t0, log_path, launch)
    return manifest


def _finish_releases(store) -> None:
    """Released shards whose data a killed trainer did not delete: deleted now (so the budget gets
    the space back even if that trainer is never restarted)."""
    left = store.read().get("releasing", [])
    delete_released(store, left)
    if left:
        log.info("deleted %d released shards a consumer had left on storage", len(left))


def _launch_workers(job: Job, devices: list[str], todo_tokens: int, progress: bool, log_dir: str) -> int | None:
    """Run one worker process per device to the end. Returns the signal number if the run was
    stopped on request (the workers stopped at a batch boundary, dropping the shards in progress,
    and exited), else None."""
    from tqdm import tqdm

    bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True,
               desc="extract", smoothing=0.05)
    written = done = 0  # counted here: a disabled bar (--no-progress) never advances

    def on_message(msg) -> None:
        nonlocal written, done
        if isinstance(msg, Paused):  # a worker waits for budget, or goes on
            bar.set_postfix_str(f"paused: {msg.why}" if msg.paused else f"{written / 1e9:.2f} GB written")
            return
        if not isinstance(msg, Progress):
            raise TypeError(f"unexpected message from an extract worker: {msg!r}")
        bar.update(msg.tokens)
        written += msg.nbytes
        done += msg.tokens
        bar.set_postfix_str(f"{written / 1e9:.2f} GB written")
        heartbeat(phase="extract", tokens_done=done, tokens_todo=todo_tokens, bytes_written=written)

    try:
        ended = run_workers(worker_entry, devices, job, "extract", on_message)
    finally:
        bar.close()
    if ended.failed is not None:
        raise RuntimeError(_worker_failure(job, ended.failed, devices[ended.failed], ended.exitcode, ended.error,
                                           os.path.join(log_dir, f"extract-rank{ended.failed}.log")))
    return ended.stopped


def _worker_failure(job: Job, rank: int, device: str, code: int, error: str | None, log_path: str) -> str:
    """The launcher's one line for a failed worker: its own error, and for a full device what to do."""
    reason = no_room_reason(error) if error else None
    if reason:
        error = error.split("; see ")[0]  # the worker's pointer to its logs and its advice: said below
        loc = Location(job.cfg.cache)
        m = ManifestStore(loc).read() or {"shards": [], "released": []}
        done = len(committed_names(m))
        # A file-size limit is not a full device: say which, so the fix offered is the right one.
        head, fix = ((f"a file-size limit (ulimit -f) stopped a write in {loc.path()}", "raise the limit")
                     if error and "ulimit" in reason else
                     (f"no space left on the device of {loc.path()}", "free space (or raise the quota)"))
        return (f"{head}: {done}/{len(job.shards)} shards committed, none half-written; {fix}, then run the "
                f"same command again to resume (worker {rank}: {error})")
    if error and error.startswith(f"{DegenerateLayer.__name__}: "):  # the target's output refused: running again
        return f"extract: {error.split(': ', 1)[1]} (worker {rank}, {device}; {log_path})"  # would not change it
    what = error or f"exited with code {code}"
    return f"worker {rank} ({device}) failed: {what}; see {log_path}. Run the same command again to resume."


def _summary(manifest: dict, elapsed: float, log_path, launch) -> None:
    t = manifest["totals"]
    released = len(manifest.get("released", []))
    lines = [
        f"cache: {manifest['status']}, {len(manifest['shards']) + released}/{manifest['plan']['num_shards']} shards"
        + (f" ({released} consumed and released)" if released else "")
        + f", on storage {t['samples']} samples, {t['tokens']} tokens, {t['bytes'] / 1e9:.3f} GB",
        f"time: {elapsed:.1f} s" + ("" if launch else f" (logs: {os.path.dirname(log_path)})"),
    ]
    for line in lines:
        log.info(line)
        if launch is None or launch.rank == 0:
            print(line, flush=True)


# ----------------------------------------------------------------------------------------------
# Worker












