"""Stage one: run the frozen target over the input and commit hidden states shard by shard.

Shape of a run:
  launcher (or each torchrun rank): log file -> preflight (no weights) -> manifest created/checked
  -> one worker *process* per device -> each worker: its shards, batch by batch:
       forward on its one thread -> async copy into shared, page-locked host slots -> a writer
       *process* (`sink.py`: numpy and Zarr, no torch) writes whole chunks into the shard's Zarr
       group, and at the shard's end renames it into place and commits it in manifest.json
       under a lock.

The plan (which rows make which shard, in which order) is a pure function of the input and the
options, never of the number of workers: shard j belongs to worker j % W, so one worker, two
workers, or a resumed run all write the same shards with the same contents.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from dflash_offline.cache.manifest import committed_names, shard_name
from dflash_offline.config import ExtractConfig
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.launch import Launch, join_ranks, torchrun_launch
from dflash_offline.runtime.logs import claim_heartbeat, heartbeat, open_process_log
from dflash_offline.runtime.paths import refuse_foreign_folder
from dflash_offline.runtime.signals import Stopped, install_stop_handlers, signal_name, stop_requested
from dflash_offline.runtime.supervise import wait_for_other_ranks
from dflash_offline.runtime.units import human_bytes

log = logging.getLogger("dflash.extract")
# What a cache location holds before its first manifest (a refused or killed first run): anything
# else there was not made by extract, and is never written into.
CACHE_OWN_ENTRIES = {"logs", "shards", ".run.lock", ".manifest.lock"}


def tmp_shard_rel(j: int) -> str:
    return f"shards/tmp-{shard_name(j)}.zarr"


# ----------------------------------------------------------------------------------------------
# Plan


@dataclass
class Job:
    """Everything a worker needs, as plain data (it crosses a process spawn before the log opens)."""

    cfg: dict
    target_path: str
    layer_ids: list[int]
    hidden_size: int
    source: dict  # data.Source as plain fields
    shards: list[np.ndarray]  # global rows of each shard, in write order
    compute_dtype: str  # resolved: bfloat16 / float16 / float32
    shard_bytes: list[int]  # planned bytes of each shard on storage (the budget's reservation)


def pass_order(num_rows: int, p: int) -> np.ndarray:
    """The order in which pass p visits the input rows: the input order for pass 0, a fixed
    permutation of it for each later pass (extract --passes), so every pass is shuffled anew."""
    if p == 0:
        return np.arange(num_rows)
    return np.random.default_rng([p, 0x9A55]).permutation(num_rows)


def make_plan(lengths: np.ndarray, max_len: int, shard_tokens: int, sort_window: int,
              passes: int = 1) -> list[np.ndarray]:
    """Rows -> shards. Within each window of `sort_window` rows (in the pass's order), rows are
    ordered longest first (ties by row), then cut into shards of at most `shard_tokens` tokens (a
    single longer sample makes a shard of its own). Longest first: the first batch is the largest,
    so a batch that does not fit in memory fails in the first seconds, not hours in. With several
    passes the shards of pass p follow those of pass p - 1."""
    if passes > 1:
        return [s for p in range(passes) for s in _pass_plan(lengths, max_len, shard_tokens, sort_window, p)]
    return _pass_plan(lengths, max_len, shard_tokens, sort_window, 0)


def _pass_plan(lengths: np.ndarray, max_len: int, shard_tokens: int, sort_window: int, p: int) -> list[np.ndarray]:
    tl = np.minimum(lengths, max_len)
    order = pass_order(tl.shape[0], p)
    shards: list[np.ndarray] = []
    cur: list[int] = []
    cur_tokens = 0
    for w in range(0, tl.shape[0], sort_window):
        rows = order[w:w + sort_window]
        rows = rows[np.lexsort((np.arange(rows.shape[0]), -tl[rows]))]  # ties keep the pass's order
        for r in rows:
            t = int(tl[r])
            if cur and cur_tokens + t > shard_tokens:
                shards.append(np.asarray(cur, np.int64))
                cur, cur_tokens = [], 0
            cur.append(int(r))
            cur_tokens += t
    if cur:
        shards.append(np.asarray(cur, np.int64))
    return shards


def make_batches(lengths: list[int], batch_tokens: int) -> list[tuple[int, int]]:
    """Consecutive samples -> [start, end) batches with rows x longest row <= batch_tokens."""
    out, a = [], 0
    while a < len(lengths):
        b, longest = a, 0
        while b < len(lengths) and max(longest, lengths[b]) * (b - a + 1) <= batch_tokens:
            longest = max(longest, lengths[b])
            b += 1
        b = max(b, a + 1)
        out.append((a, b))
        a = b
    return out


def reserved_bytes(tokens: int, bpt: int, chunk_tokens: int) -> int:
    """What a shard of `tokens` tokens may take on storage: whole chunks (the last one is written
    full size) plus a little metadata. The budget reserves this before the shard starts."""
    return -(-tokens // chunk_tokens) * chunk_tokens * bpt + 64 * 1024


def bytes_per_token(num_layers: int, hidden_size: int, topk: int, hidden_dtype: str = "bfloat16") -> int:
    """hidden (bf16: 2 bytes a value; fp8: 1 byte a value + a float32 scale a layer) + top-k ids
    (int32) and log-probs (fp16) + input_ids (int32) + loss_mask (uint8)."""
    hidden = num_layers * hidden_size * 2 if hidden_dtype == "bfloat16" else num_layers * (hidden_size + 4)
    return hidden + topk * 6 + 5


# ----------------------------------------------------------------------------------------------
# Launcher


def _log_dir(cfg: ExtractConfig, loc) -> str:
    if cfg.log_dir:
        return cfg.log_dir
    return "dflash-logs" if loc.remote else loc.path("logs")


def worker_device(devices: list[str], launch: Launch | None, rank: int) -> str:
    """The device of one worker: the listed one, or under torchrun cuda:LOCAL_RANK (cpu if all listed are cpu)."""
    if launch is None:
        return devices[rank]
    return "cpu" if all(d == "cpu" for d in devices) else f"cuda:{launch.local_rank}"


def resolve_compute_dtype(name: str, devices: list[str], launch: Launch | None) -> str:
    """`auto` -> bfloat16 on GPUs, float32 on CPUs; one dtype per cache, so no mixing of the two."""
    kinds = {"cpu" if d == "cpu" else "cuda" for d in devices}
    if launch is not None:
        kinds = {"cpu"} if kinds == {"cpu"} else {"cuda"}
    if name != "auto":
        return name
    if len(kinds) > 1:
        raise UserError("--devices mixes CPU and GPU workers with --compute-dtype auto (bf16 on GPU, fp32 on CPU); "
                        "choose one kind of device or set --compute-dtype")
    return "bfloat16" if kinds == {"cuda"} else "float32"


def preflight(cfg: ExtractConfig, loc, launch: Launch | None):
    """All checks that need no weights. Raises UserError; writes nothing to the cache."""
    from dflash_offline.extract import data
    from dflash_offline.target import model as target
    from dflash_offline.target.folder import read_target
    from dflash_offline.cache.manifest import ManifestStore, check_compatible, committed_names, new_manifest
    from dflash_offline.runtime.launch import check_devices_exist, parse_devices

    cfg.validate()
    devices = parse_devices(cfg.devices)
    info = read_target(cfg.target)
    layer_ids = target.resolve_layers(info, cfg.layers, cfg.num_layers)
    target.check_topk(info, cfg.topk)
    target.check_weights(info, info.num_layers if cfg.topk > 0 else max(layer_ids) + 1, cfg.topk > 0)
    if launch is None:
        check_devices_exist(devices)
    if loc.remote and (len(devices) > 1 or (launch and launch.world_size > 1)):
        raise UserError(
            f"--cache {cfg.cache}: several workers need a lock to share one manifest, and URL caches "
            "(object stores) have none; use a local or shared file system path, or one device"
        )
    compute_dtype = resolve_compute_dtype(cfg.compute_dtype, devices, launch)
    t0 = time.time()
    source = data.scan(cfg.data, info.vocab_size)
    log.info("input: %d files, %d rows, %d tokens (scanned in %.1fs)", len(source.files), source.rows,
             int(source.lengths.sum()), time.time() - t0)
    # make_plan's passes, built once and kept apart for the manifest's shards_per_pass.
    per_pass = [_pass_plan(source.lengths, cfg.max_len, cfg.shard_tokens, cfg.sort_window, p) for p in range(cfg.passes)]
    shards = [s for plan in per_pass for s in plan]
    tl = np.minimum(source.lengths, cfg.max_len)
    tokens_of = [int(tl[rows].sum()) for rows in shards]
    total_tokens = sum(tokens_of)
    truncated = int((source.lengths > cfg.max_len).sum())
    wanted = new_manifest(
        target=info.manifest_entry(),
        capture={"layer_ids": layer_ids, "topk": cfg.topk, "hidden_dtype": cfg.hidden_dtype, "max_len": cfg.max_len,
                 "compute_dtype": compute_dtype},
        source=source.manifest_entry(),
        plan={"shard_tokens": cfg.shard_tokens, "sort_window": cfg.sort_window, "num_shards": len(shards),
              "tokens": total_tokens,
              **({"passes": cfg.passes, "shards_per_pass": [len(plan) for plan in per_pass]} if cfg.passes > 1 else {})},
    )
    existing = ManifestStore(loc).read()
    if existing is not None:
        try:
            check_compatible(existing, wanted, loc.url("manifest.json"))
        except UserError as e:
            if not binds_nothing(existing):
                raise
            if launch is not None:  # no run lock under torchrun: another job may be starting there
                raise UserError(f"{e}; no shard is committed there yet: delete {loc.url('manifest.json')} (an "
                                "earlier attempt's) to start anew with this run's settings") from None
            existing = None  # an earlier attempt that committed nothing: replaced once the run lock is held
    committed = committed_names(existing) if existing else set()
    todo_tokens = sum(t for j, t in enumerate(tokens_of) if shard_name(j) not in committed)
    bpt = bytes_per_token(len(layer_ids), info.hidden_size, cfg.topk, cfg.hidden_dtype)
    need, whole = todo_tokens * bpt, total_tokens * bpt
    shard_bytes = [reserved_bytes(t, bpt, cfg.chunk_tokens) for t in tokens_of]
    if cfg.max_bytes is not None:
        if max(shard_bytes) > cfg.max_bytes:
            j = int(np.argmax(shard_bytes))
            raise UserError(
                f"--max-bytes {human_bytes(cfg.max_bytes)} cannot hold one shard: {shard_name(j)} needs about "
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
    # Warnings only once the run is accepted: a refused run prints one line.
    if truncated:
        log.warning("%d of %d samples are longer than --max-len %d and are truncated", truncated, source.rows, cfg.max_len)
    warning = target.check_kernels(info, devices)
    if warning:
        log.warning(warning)
    log.info("plan: %d shards, %d tokens (%d to do), %.2f GB estimated (%d bytes/token), layers %s, topk %d",
             len(shards), total_tokens, todo_tokens, whole / 1e9, bpt, layer_ids, cfg.topk)
    job = Job(
        cfg=asdict(cfg), target_path=str(info.path), layer_ids=layer_ids, hidden_size=info.hidden_size,
        source=source.state(), shards=shards, compute_dtype=compute_dtype, shard_bytes=shard_bytes,
    )
    return job, wanted, devices, todo_tokens


def run(cfg: ExtractConfig) -> dict:
    """The `extract` command. Returns the final manifest."""
    from dflash_offline.cache.location import Location

    launch = torchrun_launch()
    cfg.validate()  # no log folder for a run that names no cache
    loc = Location(cfg.cache)
    name = f"extract-rank{launch.rank}" if launch else "extract-launcher"
    why = loc.unwritable()
    if why:
        raise UserError(f"--cache {cfg.cache}: cannot write there ({why}); choose a writable location")
    if not loc.remote and not os.path.exists(loc.path("manifest.json")):  # before its log folder is made
        refuse_foreign_folder(loc.path(), "--cache", "a cache", "manifest.json", CACHE_OWN_ENTRIES,
                              ("manifest.json.tmp-",))
        # shards/ is ours only if it holds shard folders (a killed first run's debris), nothing else.
        refuse_foreign_folder(loc.path("shards"), "--cache", "a cache", "manifest.json", set(),
                              ("shard-", "tmp-shard-"))
    try:
        log_path = open_process_log(_log_dir(cfg, loc), name)
    except OSError as e:  # before anything else: no log, no cache, one line
        raise UserError(f"--cache {cfg.cache}: cannot write its log folder {_log_dir(cfg, loc)} "
                        f"({e.strerror or e}); choose a writable location (or --log-dir)") from None
    install_stop_handlers()  # SIGTERM/SIGINT: finish the shards being written, commit them, exit
    join_ranks(launch)  # a launch other than torchrun: every rank is there before any work
    t0 = time.time()
    heartbeat(phase="preflight")
    job, wanted, devices, todo_tokens = preflight(cfg, loc, launch)
    if stop_requested():
        raise Stopped(stop_requested(), f"stopped on {signal_name(stop_requested())} before any work; "
                      "nothing changed; run the same command again to start")

    from dflash_offline.cache.manifest import ManifestStore, committed_names

    if launch is None:
        try:
            run_lock = loc.try_run_lock()  # held until this process exits
        except OSError as e:
            raise UserError(f"--cache {cfg.cache}: cannot write there ({e.strerror or e}); choose a writable "
                            "location") from None
        if run_lock is None:
            raise UserError(f"--cache {cfg.cache}: another extract is running on this cache (it holds "
                            f"{loc.path('.run.lock')}); wait for it or stop it, then run again")
    claim_heartbeat()  # this process holds the cache now: a refused rerun never wrote its heartbeat
    store = ManifestStore(loc)
    if launch is None:
        replace_unbound_manifest(store, wanted)
    store.init_or_check(wanted)
    if launch is None or launch.rank == 0:
        store.set_budget(cfg.max_bytes, max(job.shard_bytes))
        _finish_releases(store, loc)
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
        stopped = _launch_workers(job, devices, todo_tokens, cfg.progress, _log_dir(cfg, loc))
    manifest = store.read()
    if stopped and manifest["status"] != "complete":  # a request that came after the last shard: done
        done = len(committed_names(manifest))
        raise Stopped(stopped, f"stopped on {signal_name(stopped)}: {done}/{manifest['plan']['num_shards']} shards "
                      "committed, none half-written; run the same command again to resume")
    _summary(manifest, time.time() - t0, log_path, launch)
    return manifest


def binds_nothing(m: dict) -> bool:
    """A manifest that holds no work: no shard committed (or consumed and released) and no trainer
    following it, as an earlier attempt leaves that failed before its first commit (a bad row or
    option found in a worker, a target that does not load). Its settings do not bind the cache."""
    return not committed_names(m) and not m.get("consumers") and not m.get("releasing")


def replace_unbound_manifest(store, wanted: dict) -> None:
    """Under the manifest lock, with the run lock held: a manifest that binds nothing and was made
    with other settings is replaced by this run's, and its shard debris removed (nothing there is
    committed); the rerun a failed first attempt advises is then not refused."""
    from dflash_offline.cache.manifest import MANIFEST, check_compatible

    loc = store.loc
    with loc.lock():
        m = store.read()
        if m is None or not binds_nothing(m):
            return
        try:
            check_compatible(m, wanted, loc.url(MANIFEST))
            return
        except UserError as e:
            differs = str(e).split(": ", 1)[-1].split("; ")[0]
        loc.rmtree("shards")
        loc.write_json_atomic(MANIFEST, wanted)
    log.warning("an earlier attempt on this cache committed no shard (%s): its manifest is replaced by this run's "
                "settings", differs)


def _finish_releases(store, loc) -> None:
    """Released shards whose data a killed trainer did not delete: deleted now (so the budget gets
    the space back even if that trainer is never restarted)."""
    left = store.read().get("releasing", [])
    for name in left:
        loc.rmtree(f"shards/{name}.zarr")
    if left:
        store.deleted(left)
        log.info("deleted %d released shards a consumer had left on storage", len(left))


def _launch_workers(job: Job, devices: list[str], todo_tokens: int, progress: bool, log_dir: str) -> int | None:
    """Run one worker process per device to the end. Returns the signal number if the run was
    stopped on request (the workers finished their shards in progress and exited), else None."""
    from tqdm import tqdm

    from dflash_offline.runtime.supervise import run_workers

    bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True,
               desc="extract", smoothing=0.05)
    written = done = 0  # counted here: a disabled bar (--no-progress) never advances

    def on_message(msg) -> None:
        nonlocal written, done
        kind, tokens, nbytes = msg
        if kind in ("paused", "resumed"):  # (kind, occupancy, why): a worker waits for budget
            bar.set_postfix_str(f"paused: {nbytes}" if kind == "paused" else f"{written / 1e9:.2f} GB written")
            return
        bar.update(tokens)
        written += nbytes
        done += tokens
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
    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, committed_names
    from dflash_offline.runtime.errors import is_no_space

    if error and is_no_space(error):
        error = error.split("; see ")[0]  # the worker's pointer to its logs and its advice: said below
        loc = Location(job.cfg["cache"])
        m = ManifestStore(loc).read() or {"shards": [], "released": []}
        done = len(committed_names(m))
        return (f"no space left on the device of {loc.path()}: {done}/{len(job.shards)} shards committed, none "
                f"half-written; free space (or raise the quota), then run the same command again to resume "
                f"(worker {rank}: {error})")
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


def worker_entry(rank: int, world: int, device: str, job: Job, q) -> None:
    """Spawned process: log file first, then torch, then the work."""
    from dflash_offline.cache.location import Location

    from dflash_offline.runtime.supervise import die_with_parent

    die_with_parent()
    loc = Location(job.cfg["cache"])
    open_process_log(_log_dir(ExtractConfig(**job.cfg), loc), f"extract-rank{rank}", console=True, claim=True)
    install_stop_handlers(launched=True)
    from dflash_offline.runtime.logs import worker_outcome

    with worker_outcome(on_error=lambda line: q.put(("error", rank, line))):
        left = worker_run(rank, world, device, job, progress=q, show_bar=False, todo_tokens=0)
        if left:
            raise Stopped(stop_requested(), f"worker {rank}: stopped on {signal_name(stop_requested())} "
                          "after committing its shards in progress")


def worker_run(rank: int, world: int, device: str, job: Job, progress, show_bar: bool, todo_tokens: int) -> int:
    """Write this worker's shards. Returns how many it left unstarted (a stop was requested)."""
    heartbeat(phase="import")  # torch and the model code: a broken install fails here
    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, committed_names
    from dflash_offline.extract.data import RowReader, Source
    from dflash_offline.runtime.launch import single_thread_compute
    from dflash_offline.target.model import LayerCapture, load_target
    from dflash_offline.target.folder import read_target

    import torch

    single_thread_compute()
    cfg = ExtractConfig(**job.cfg)
    loc = Location(cfg.cache)
    store = ManifestStore(loc)
    committed = committed_names(store.read())
    mine = [j for j in range(len(job.shards)) if j % world == rank and shard_name(j) not in committed]
    # Debris of an interrupted run: this worker's uncommitted shard folders, finished or not.
    for j in range(rank, len(job.shards), world):
        if shard_name(j) not in committed:
            loc.rmtree(tmp_shard_rel(j))
            loc.rmtree(f"shards/{shard_name(j)}.zarr")
    # Reservations this worker made before it was killed (their debris is gone now): rewritten anew.
    store.drop_reservations({shard_name(j) for j in mine})
    log.info("worker %d/%d on %s: %d shards to write (%d already committed in all)", rank, world, device,
             len(mine), len(committed))
    if not mine or stop_requested():
        return len(mine)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    src = Source.from_state(job.source)
    reader = RowReader(src)
    info = read_target(job.target_path)
    need_head = cfg.topk > 0
    keep = info.num_layers if need_head else max(job.layer_ids) + 1
    t0 = time.time()
    heartbeat(phase="load target")
    fault_point("load-target")
    model = load_target(info, device, job.compute_dtype, keep, need_head)
    heartbeat(phase="extract")
    log.info("loaded target in %.1fs", time.time() - t0)
    capture = LayerCapture(model, job.layer_ids)
    n, H, k = len(job.layer_ids), job.hidden_size, cfg.topk
    cuda = device.startswith("cuda")

    bar = None
    if show_bar:
        from tqdm import tqdm

        own = sum(int(np.minimum(job.source["lengths"][job.shards[j]], cfg.max_len).sum()) for j in mine)
        bar = tqdm(total=own, unit="tok", unit_scale=True, desc=f"extract (rank {rank} of {world})", dynamic_ncols=True)
    written = [0]

    def on_progress(tokens: int, nbytes: int) -> None:
        if progress is not None:
            progress.put(("progress", tokens, nbytes))
        if bar is not None:
            written[0] += nbytes
            bar.update(tokens)
            bar.set_postfix_str(f"{written[0] / 1e9:.2f} GB written")

    sink = make_sink(cfg, dict(num_layers=n, hidden_size=H, topk=k, chunk_tokens=cfg.chunk_tokens,
                               layer_ids=job.layer_ids, hidden_dtype=cfg.hidden_dtype), cuda,
                     _log_dir(cfg, loc), f"extract-rank{rank}", on_progress)
    def on_pause(paused: bool, used: int, why: str) -> None:
        if progress is not None:
            progress.put(("paused" if paused else "resumed", used, why))
        if bar is not None:
            bar.set_postfix_str(f"paused: {why}" if paused else f"{written[0] / 1e9:.2f} GB written")

    left = [0]

    def admitted():
        for i, j in enumerate(mine):
            # A stop request ends the run between shards: the one being written is finished first.
            if stop_requested() or (cfg.max_bytes is not None and
                                    not wait_for_budget(store, j, job.shard_bytes[j], cfg.max_bytes, on_pause)):
                log.info("stop requested: %d of this worker's shards not started (%s first)", len(mine) - i,
                         shard_name(j))
                left[0] = len(mine) - i
                return
            yield j, _shard_samples(job, j, src, reader, cfg.max_len)

    t_start = time.time()
    try:
        stats = run_shards(model, capture, cfg, admitted(), sink, device)
    finally:
        if bar is not None:
            bar.close()
    dt = time.time() - t_start
    log.info("worker %d done: %d tokens in %.1fs (%.0f tokens/s); padding %.1f%% of the %d tokens the forward ran; "
             "writers busy %.0f%% of the time", rank, stats["tokens"], dt, stats["tokens"] / max(dt, 1e-9),
             100 * stats["padding_fraction"], stats["forward_tokens"],
             100 * sink.stats["writer_busy_s"] / max(dt * len(sink.procs), 1e-9))
    return left[0]


def wait_for_budget(store, j: int, nbytes: int, budget: int, on_pause, poll_s: float = 0.5) -> bool:
    """Block until shard j is admitted under the budget (ManifestStore.reserve): the shards before
    it must have started, and the unconsumed cache must leave room for it. Pausing is not an
    error: a streaming trainer releases shards as it finishes them. False: a stop was requested
    while waiting (the shard is not admitted)."""
    before = [shard_name(i) for i in range(j)]
    t0 = last = None
    while True:
        ok, used = store.reserve(shard_name(j), nbytes, budget, before)
        if ok:
            if t0 is not None:
                log.info("resumed %s after %.1fs paused", shard_name(j), time.time() - t0)
                on_pause(False, used, "")
            return True
        if stop_requested():
            return False
        full = used + nbytes > budget
        why = (f"cache full ({human_bytes(used)} of {human_bytes(budget)} budget; {shard_name(j)} needs "
               f"{human_bytes(nbytes)})" if full else f"waiting for the shards before {shard_name(j)} to start")
        now = time.time()
        if t0 is None:
            t0 = now
            on_pause(True, used, why)
        if last is None or now - last > 30:
            log.info("paused: %s; waiting for a consumer to release shards" if full else "paused: %s", why)
            last = now
        heartbeat(phase="paused", why=why, occupancy_bytes=used, budget_bytes=budget)
        fault_point("extract-paused")
        time.sleep(poll_s)


def _shard_samples(job: Job, j: int, src, reader, max_len: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(id, input_ids, loss_mask) of shard j's samples in write order, truncated to max_len."""
    rows = job.shards[j]
    fetched = {int(r): reader.row(int(r)) for r in sorted(rows.tolist())}  # file order: one read per row group
    out = []
    for r in rows.tolist():
        ids, mask = fetched[r]
        out.append((int(src.ids[r]), ids[:max_len], mask[:max_len]))
    return out


def make_sink(cfg: ExtractConfig, layout_kw: dict, cuda: bool, log_dir: str, log_name: str, on_progress,
              discard: bool = False):
    """The writer processes and their shared slots: W + 2 on CUDA (one being filled by the copy,
    one queued, W being written), W + 1 on CPU (the copy is synchronous there)."""
    from dflash_offline.extract.sink import ShardSink

    return ShardSink(cfg.cache, layout_kw, batch_tokens=cfg.batch_tokens, writers=cfg.writers,
                     slots=cfg.writers + (2 if cuda else 1), pin=cuda, log_dir=log_dir, log_name=log_name,
                     on_progress=on_progress, discard=discard)


def run_shards(model, capture, cfg: ExtractConfig, shards, sink, device: str) -> dict:
    """The hot loop: forward each batch on this thread, copy its outputs into a shared slot
    (asynchronously, on a copy stream, on CUDA) and hand the slot to the shard's writer process.

    `shards` yields (j, samples). Returns {tokens, forward_tokens, padding_fraction}. Closes
    `sink` (aborts it on error).
    """
    import torch

    from dflash_offline.cache.fp8 import DTYPE_NAME as FP8
    from dflash_offline.cache.fp8 import quantize as quantize_fp8
    from dflash_offline.target.model import forward_batch

    cuda = device.startswith("cuda")
    k = cfg.topk
    fp8 = cfg.hidden_dtype == FP8
    # A second stream for the device-to-host copies: they overlap the next batch's forward
    # instead of queueing behind it on the compute stream.
    copy_stream = torch.cuda.Stream(device=device) if cuda else None
    dev_flag = torch.zeros(1, dtype=torch.int64, device=device) if cuda else None
    if cuda:
        sink.poll = copy_stream.query
    tokens_done = forward_tokens = 0
    try:
        for j, samples in shards:
            sink.begin(j, sum(s[1].shape[0] for s in samples))
            for a, b in make_batches([s[1].shape[0] for s in samples], cfg.batch_tokens):
                batch = samples[a:b]
                lens = [s[1].shape[0] for s in batch]
                S, B = max(lens), len(batch)
                ids_np = np.zeros((B, S), np.int64)
                mask_np = np.zeros((B, S), np.int64)
                flat = np.concatenate([r * S + np.arange(t) for r, t in enumerate(lens)])
                for r, (_, ids, _) in enumerate(batch):
                    ids_np[r, : ids.shape[0]] = ids
                    mask_np[r, : ids.shape[0]] = 1
                # Right padding: causal attention and the causal conv / delta-rule recurrence of
                # Gated DeltaNet never let a padded position influence an earlier real one.
                input_ids = torch.from_numpy(ids_np).to(device, non_blocking=True)
                attn = torch.from_numpy(mask_np).to(device, non_blocking=True)
                index = torch.from_numpy(flat).to(device, non_blocking=True)
                hidden, tids, tlp = forward_batch(model, capture, input_ids, attn, index, k, cfg.logits_chunk_tokens)
                scale = None
                if fp8:  # quantised here, on the device: the host and the writer see 8-bit values only
                    bits, scale = quantize_fp8(hidden)
                else:
                    bits = hidden.to(torch.bfloat16).view(torch.uint16)
                N = hidden.shape[0]
                slot, seq = sink.acquire()  # blocks while the writers hold every slot
                host = sink.views(slot)
                if cuda:
                    copy_stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(copy_stream):
                        host["hidden"][:N].copy_(bits, non_blocking=True)
                        if scale is not None:
                            host["scale"][:N].copy_(scale, non_blocking=True)
                        if k > 0:
                            host["ids"][:N].copy_(tids, non_blocking=True)
                            host["lp"][:N].copy_(tlp, non_blocking=True)
                        # Last on the same stream: the writer starts once it reads seq here.
                        dev_flag.fill_(seq)
                        host["flag"].copy_(dev_flag, non_blocking=True)
                    for t in (bits, scale, tids, tlp):
                        if t is not None:  # not reused by the allocator before the copy stream is done
                            t.record_stream(copy_stream)
                else:
                    host["hidden"][:N].copy_(bits)
                    if scale is not None:
                        host["scale"][:N].copy_(scale)
                    if k > 0:
                        host["ids"][:N].copy_(tids)
                        host["lp"][:N].copy_(tlp)
                    host["flag"][0] = seq
                del host
                sink.batch(slot, batch, N, seq)
                tokens_done += N
                forward_tokens += B * S
                heartbeat(phase="extract", shard=shard_name(j), tokens_done=tokens_done)
                fault_point("batch-done")
            sink.end(j)
        sink.close()
    except BaseException:
        sink.abort()
        raise
    return {"tokens": tokens_done, "forward_tokens": forward_tokens,
            "padding_fraction": 1 - tokens_done / max(forward_tokens, 1)}
