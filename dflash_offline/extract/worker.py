"""An extract worker: its shards of the plan, batch by batch, from the target's forward to the writers.

Runs as a spawned process of the launcher (`worker_entry`) or in a torchrun rank's own process
(`worker_run`). The worker's one thread runs the forward (`run_shards`); the device-to-host copies
land in shared slots that the shard writer processes (`sink.py`) write and commit. Before a shard
starts, a budgeted run (--max-bytes) waits until the manifest admits it (`wait_for_budget`).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from dflash_offline.cache.location import Location
from dflash_offline.cache.manifest import ManifestStore, committed_names
from dflash_offline.cache.shards import ShardShape, shard_name, shard_rel, tmp_shard_rel
from dflash_offline.config import ExtractConfig
from dflash_offline.extract.messages import Paused, Progress
from dflash_offline.extract.plan import Job, make_batches
from dflash_offline.runtime.faults import corrupted, corrupted_topk, fault_point
from dflash_offline.runtime.launch import single_thread_compute
from dflash_offline.runtime.logs import heartbeat, open_process_log, worker_outcome
from dflash_offline.runtime.supervise import WorkerError, die_with_parent
from dflash_offline.runtime.signals import Stopped, install_stop_handlers, signal_name, stop_requested
from dflash_offline.runtime.units import human_bytes
from dflash_offline.targets.folder import read_target
from dflash_offline.targets.model import LayerCapture, forward_batch, load_target

log = logging.getLogger("dflash.extract")


def log_folder(cfg: ExtractConfig, loc) -> str:
    """Where the run's process logs go: --log-dir, else the cache's logs/ (a local folder for a URL cache)."""
    if cfg.log_dir:
        return cfg.log_dir
    return "dflash-logs" if loc.remote else loc.path("logs")


def worker_entry(rank: int, world: int, device: str, job: Job, q) -> None:
    """Spawned process: log file first, then torch, then the work."""
    die_with_parent()
    loc = Location(job.cfg.cache)
    open_process_log(log_folder(job.cfg, loc), f"extract-rank{rank}", console=True, claim=True)
    install_stop_handlers(launched=True)
    # ("error", rank, line) is run_workers' own message: it keeps the line for the failure report.
    with worker_outcome(on_error=lambda line: q.put(WorkerError(rank, line))):
        left = worker_run(rank, world, device, job, progress=q, show_bar=False, todo_tokens=0)
        if left:
            raise Stopped(stop_requested(), f"worker {rank}: stopped on {signal_name(stop_requested())} at a batch "
                          "boundary, the shards handed over whole committed")


def worker_run(rank: int, world: int, device: str, job: Job, progress, show_bar: bool, todo_tokens: int) -> int:
    """Write this worker's shards. Returns how many it left unstarted (a stop was requested)."""
    heartbeat(phase="import")  # torch and the model code: a broken install fails here
    from dflash_offline.rows.reader import RowReader, Source

    import torch

    single_thread_compute()
    cfg = job.cfg
    loc = Location(cfg.cache)
    store = ManifestStore(loc)
    committed = committed_names(store.read())
    mine = [j for j in range(len(job.shards)) if j % world == rank and shard_name(j) not in committed]
    for j in mine:  # debris of an interrupted run: this worker's uncommitted shard folders, finished or not
        loc.rmtree(tmp_shard_rel(shard_name(j)))
        loc.rmtree(shard_rel(shard_name(j)))
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
    keep = info.num_target_layers if need_head else max(job.layer_ids) + 1
    t0 = time.time()
    heartbeat(phase="load target")
    fault_point("load-target")
    model = load_target(info, device, job.compute_dtype, keep, need_head)
    heartbeat(phase="extract")
    log.info("loaded target in %.1fs", time.time() - t0)
    capture = LayerCapture(model, job.layer_ids)
    n, H, k = len(job.layer_ids), job.hidden_size, cfg.topk
    cuda = device.startswith("cuda")

    own = sum(int(np.minimum(job.source["lengths"][job.shards[j]], cfg.max_len).sum()) for j in mine)
    shown = _Shown(progress, show_bar, own, f"extract (rank {rank} of {world})")
    sink = make_sink(cfg, ShardShape(cache_layers=n, hidden_size=H, topk=k, chunk_tokens=cfg.chunk_tokens,
                                     layer_ids=job.layer_ids, hidden_dtype=cfg.hidden_dtype), cuda,
                     log_folder(cfg, loc), f"extract-rank{rank}", shown.on_progress)
    on_pause = shown.on_pause
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
        shown.close()
    if stats["dropped"] is not None:
        log.info("stop requested: %s dropped at a batch boundary (written anew on resume)", stats["dropped"])
        left[0] = len(mine) - sum(1 for j in mine if shard_name(j) in committed_names(store.read()))
    dt = time.time() - t_start
    log.info("worker %d done: %d tokens in %.1fs (%.0f tokens/s); padding %.1f%% of the %d tokens the forward ran; "
             "writers busy %.0f%% of the time", rank, stats["tokens"], dt, stats["tokens"] / max(dt, 1e-9),
             100 * stats["padding_fraction"], stats["forward_tokens"],
             100 * sink.stats["writer_busy_s"] / max(dt * len(sink.procs), 1e-9))
    return left[0]


class _Shown:
    """Where a worker's progress goes: the launcher's queue, and this process's own bar under
    torchrun (rank 0: no launcher draws one)."""

    def __init__(self, queue, show_bar: bool, tokens: int, desc: str):
        self.queue, self.written, self.bar = queue, 0, None
        if show_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=tokens, unit="tok", unit_scale=True, desc=desc, dynamic_ncols=True)

    def on_progress(self, tokens: int, nbytes: int) -> None:
        if self.queue is not None:
            self.queue.put(Progress(tokens, nbytes))
        if self.bar is not None:
            self.written += nbytes
            self.bar.update(tokens)
            self.bar.set_postfix_str(f"{self.written / 1e9:.2f} GB written")

    def on_pause(self, paused: bool, used: int, why: str) -> None:
        if self.queue is not None:
            self.queue.put(Paused(paused, used, why))
        if self.bar is not None:
            self.bar.set_postfix_str(f"paused: {why}" if paused else f"{self.written / 1e9:.2f} GB written")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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


def make_sink(cfg: ExtractConfig, shape: ShardShape, cuda: bool, log_dir: str, log_name: str, on_progress,
              discard: bool = False):
    """The writer processes and their shared slots: W + 2 on CUDA (one being filled by the copy,
    one queued, W being written), W + 1 on CPU (the copy is synchronous there)."""
    from dflash_offline.extract.sink import ShardSink

    return ShardSink(cfg.cache, shape, batch_tokens=cfg.batch_tokens, writers=cfg.writers,
                     slots=cfg.writers + (2 if cuda else 1), pin=cuda, log_dir=log_dir, log_name=log_name,
                     on_progress=on_progress, discard=discard)


def run_shards(model, capture, cfg: ExtractConfig, shards, sink, device: str) -> dict:
    """The hot loop: forward each batch on this thread, copy its outputs into a shared slot
    (asynchronously, on a copy stream, on CUDA) and hand the slot to the shard's writer process.

    `shards` yields (j, samples). A stop request lands at the next batch: the shard in progress is
    dropped (its writer removes what it wrote; resume writes it anew), the shards handed over whole
    before it are finished, and the loop ends, within one batch's time. Returns {tokens,
    forward_tokens, padding_fraction, dropped (the shard's name, or None)}. Closes `sink` (aborts
    it on error).
    """
    import torch

    from dflash_offline.cache.fp8 import DTYPE_NAME as FP8
    from dflash_offline.cache.fp8 import quantize as quantize_fp8
    from dflash_offline.extract.evidence import batch_evidence  # torch: imported with the work, not the module

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
    dropped = None
    try:
        for j, samples in shards:
            sink.begin(j, sum(s[1].shape[0] for s in samples))
            for a, b in make_batches([s[1].shape[0] for s in samples], cfg.batch_tokens):
                if stop_requested():  # within one batch: a shard on a CPU may take minutes
                    dropped = shard_name(j)
                    sink.drop(j)
                    break
                batch = samples[a:b]
                input_ids, attn, index = _batch_tensors(batch, device)
                B, S = input_ids.shape
                hidden, tids, tlp = forward_batch(model, capture, input_ids, attn, index, k, cfg.logits_chunk_tokens)
                tids, tlp = corrupted_topk(model, hidden, tids, tlp)
                with torch.inference_mode():  # what the writer checks before the shard commits (cache/evidence.py)
                    embeddings = model.get_input_embeddings()(input_ids).view(B * S, -1).index_select(0, index)
                    evidence = batch_evidence(corrupted(hidden, embeddings), embeddings)
                scale = None
                if fp8:  # quantised here, on the device: the host and the writer see 8-bit values only
                    bits, scale = quantize_fp8(hidden)
                else:
                    bits = hidden.to(torch.bfloat16).view(torch.uint16)
                N = hidden.shape[0]
                slot, seq = sink.acquire()  # blocks while the writers hold every slot
                _to_host(sink.views(slot), seq, bits, scale, tids, tlp, evidence, copy_stream, dev_flag)
                sink.batch(slot, batch, N, seq)
                tokens_done += N
                forward_tokens += B * S
                heartbeat(phase="extract", shard=shard_name(j), tokens_done=tokens_done)
                fault_point("batch-done")
            if dropped is not None:
                break
            sink.end(j)
        sink.close()
    except BaseException:
        sink.abort()
        raise
    return {"tokens": tokens_done, "forward_tokens": forward_tokens,
            "padding_fraction": 1 - tokens_done / max(forward_tokens, 1), "dropped": dropped}


def _batch_tensors(batch, device: str):
    """A batch's ids and attention mask, right-padded to its longest sample, and the flat index of
    its real positions (row * S + t), on the device."""
    import torch

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
    return (torch.from_numpy(ids_np).to(device, non_blocking=True),
            torch.from_numpy(mask_np).to(device, non_blocking=True),
            torch.from_numpy(flat).to(device, non_blocking=True))


def _to_host(host: dict, seq: int, bits, scale, tids, tlp, evidence, copy_stream, dev_flag) -> None:
    """A batch's outputs (and its evidence table) into its shared host slot, then the slot's flag
    set to `seq` (the writer starts once it reads it). On CUDA the copies run on `copy_stream` and
    overlap the next forward."""
    import torch

    N = bits.shape[0]
    outputs = [("hidden", bits), ("scale", scale), ("ids", tids), ("lp", tlp)]
    if copy_stream is None:
        for name, t in outputs:
            if t is not None:
                host[name][:N].copy_(t)
        host["evidence"].copy_(evidence)
        host["flag"][0] = seq
        return
    copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):
        for name, t in outputs:
            if t is not None:
                host[name][:N].copy_(t, non_blocking=True)
        host["evidence"].copy_(evidence, non_blocking=True)
        # Last on the same stream: the writer starts once it reads seq here.
        dev_flag.fill_(seq)
        host["flag"].copy_(dev_flag, non_blocking=True)
    for _, t in [*outputs, ("evidence", evidence)]:
        if t is not None:  # not reused by the allocator before the copy stream is done
            t.record_stream(copy_stream)
