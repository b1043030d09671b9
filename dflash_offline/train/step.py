"""One optimizer step of a rank (its `accum` micro-batches, the one all-reduce of the step's loss
weight and metrics, the finiteness check, clip, AdamW) and rank 0's record of it (metrics.jsonl,
TensorBoard, the progress bar, the log)."""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, NamedTuple

from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.logs import heartbeat
from dflash_offline.train.outcomes import TrainingDiverged, diverged_message
from dflash_offline.train.trainer import LoopState, Trainer

if TYPE_CHECKING:  # the types only: torch is imported where a step runs (the command starts without it)
    import numpy as np
    import torch
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

log = logging.getLogger("dflash.train")


class StepSums(NamedTuple):
    """A step's sums over its micro-batches and all ranks. They travel as one float64 vector (one
    all-reduce a step); `pack` and `unpack` are the only places that know its layout."""

    loss_sum: float
    slot_correct: np.ndarray  # [B]: top-1 hits per block slot
    slot_count: np.ndarray  # [B]: scored positions per block slot
    tau_sum: float  # acceptance length the blocks imply, summed over blocks
    blocks: float
    nonfinite_loss: np.ndarray  # [world]: 1 where that rank's loss was not finite
    nonfinite_grad: float  # > 0: the averaged gradient was not finite

    @staticmethod
    def pack(loss_sum, metrics: dict, nonfinite_loss, nonfinite_grad):
        import torch

        return torch.cat([loss_sum.view(1), metrics["slot_correct"], metrics["slot_count"],
                          metrics["tau_sum"].view(1), metrics["blocks"].view(1), nonfinite_loss,
                          nonfinite_grad.view(1)])

    @classmethod
    def unpack(cls, v, block_size: int, world: int) -> "StepSums":
        B = block_size
        return cls(float(v[0]), v[1:1 + B], v[1 + B:1 + 2 * B], float(v[1 + 2 * B]), float(v[2 + 2 * B]),
                   v[3 + 2 * B:3 + 2 * B + world], float(v[3 + 2 * B + world]))

    @property
    def diverged(self) -> bool:
        return bool(self.nonfinite_loss.any() or self.nonfinite_grad)


class StepResult(NamedTuple):
    """What a step measured, the same on every rank (`sums` are all-reduced)."""

    sums: StepSums
    wsum: torch.Tensor  # the step's loss weight over all ranks
    gnorm: torch.Tensor  # the gradient norm before clipping
    trained_tokens: torch.Tensor  # context tokens with loss mask 1 in the step's rows, all ranks
    lr: float  # the learning rate the step applied
    t0: float  # perf_counter at the step's start
    t_data: float  # seconds it waited for its micro-batches


def optimizer_step(t: Trainer, st: LoopState, it) -> StepResult:
    """Step `st.step + 1` over the next micro-batches of `it`, at the schedule's rate (`t.sched`):
    raises TrainingDiverged (on every rank at once) instead of applying a non-finite loss or
    gradient."""
    import torch
    import torch.distributed as dist

    from dflash_offline.blocks.loss import block_metrics
    from dflash_offline.train.profiling import phase

    world, device = t.world, t.device
    accum, B = t.plan.accum, t.plan.drafter.block_size  # the drafter config owns the block size
    first_slot = 1 - t.drafter.cfg.label_offset  # the first drafted slot: DFlash's 1, DSpark's 0
    t0 = time.perf_counter()
    with phase("data"):
        micro = [next(it) for _ in range(accum)]  # all micro-batches first: the step's weight sum
    t_data = time.perf_counter() - t0
    with phase("to-device"):
        micro = [mb.on(device, non_blocking=True) for mb in micro]
        # The step's loss weight and its trained tokens (the rows' loss-mask tokens), one all-reduce.
        head = torch.stack([torch.stack([mb.weights.sum() for mb in micro]).sum().double(),
                            torch.stack([mb.trained.sum() for mb in micro]).sum().double()])
    if world > 1:
        dist.all_reduce(head)
    wsum = head[0]
    # Each rank's loss is scaled so DDP's gradient average equals the global weighted mean.
    scale = world / wsum.clamp_min(1e-12)
    step_m = None
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, mb in enumerate(micro):
        # DDP all-reduces the gradients once, on the step's last micro-batch.
        sync = world == 1 or i == accum - 1
        with (nullcontext() if sync else t.model.no_sync()):
            ls, correct = _forward_backward(t, st, mb, scale)
        with phase("metrics"):
            loss_sum += ls.detach().double()
            mm = block_metrics(correct, mb.weights, mb.anchor_valid, B, first_slot=first_slot)
            step_m = mm if step_m is None else {k: step_m[k] + mm[k] for k in mm}
    with phase("optimizer"):
        sums, gnorm = _checked_update(t, st, loss_sum, step_m)
    return StepResult(sums=sums, wsum=wsum, gnorm=gnorm, trained_tokens=head[1], lr=t.sched.get_last_lr()[0],
                      t0=t0, t_data=t_data)


def _forward_backward(t: Trainer, st: LoopState, mb, scale):
    """One micro-batch: mask, forward, loss, backward. Returns its loss (weighted sum) and its
    per-position top-1 hits."""
    import torch

    from dflash_offline.drafter import masks
    from dflash_offline.blocks.loss import block_loss
    from dflash_offline.train.profiling import phase

    cfg, cuda, B = t.cfg, t.cuda, t.plan.drafter.block_size
    # The process's first micro-batch compiles the flex kernels (forward, backward):
    # its phases are timed (with GPU syncs, this once) so a slow start says where it is.
    phases = _PhaseTimer(cuda, log, t.rank) if st.first_micro else None
    if st.first_micro:
        heartbeat(phase="first step: compile" if cuda and cfg.attention != "sdpa" else "first step")
        fault_point("compile")  # the first micro-batch compiles the flex kernels (GPU)
    st.first_micro = False
    with phase("mask"):
        if cuda and cfg.attention != "sdpa":
            mask = masks.flex_block_mask(mb.doc_ids, mb.anchors, mb.anchor_valid, B)
        else:
            mask = masks.dense_mask(mb.doc_ids, mb.anchors, mb.anchor_valid, B)
    _mark(phases, "mask")
    with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=t.bf16):
        with phase("forward"):
            h = t.model(mb.target_hidden, mb.block_ids, mb.ctx_positions, mb.block_positions, mask)
        _mark(phases, "forward")
        with phase("loss"):
            if t.cfg.distribution_loss:  # DSpark's three terms (for DFlash: --tv-weight above 0)
                ls, correct = _dspark_loss(t, h, mb, B)
            else:
                ls, correct = block_loss(h, t.drafter.lm_head.weight, mb.labels, mb.weights,
                                         t.loss_chunk, cfg.loss_impl, soft_ids=mb.soft_ids,
                                         soft_logprobs=mb.soft_logprobs, soft_weight=cfg.kd_weight,
                                         dpace_alpha=cfg.dpace_alpha if cfg.loss_weights == "dpace" else None,
                                         block_size=B, compiled=t.compile_loss and cfg.loss_impl == "fused")
        _mark(phases, "loss")
    with phase("backward"):
        (ls.double() * scale).float().backward()
    _mark(phases, "backward")
    if phases is not None:
        phases.report()
    return ls, correct


def _checked_update(t: Trainer, st: LoopState, loss_sum, step_m: dict):
    """Clip, the step's one all-reduce of metrics and finiteness, then AdamW and the schedule.
    Returns the step's sums over ranks and the gradient norm before clipping."""
    import torch
    import torch.distributed as dist

    world, rank, device = t.world, t.rank, t.device
    gnorm = torch.nn.utils.clip_grad_norm_(t.params, t.cfg.clip)
    # Metrics and the finiteness check: one all-reduce of a small vector, one sync with the GPU a
    # step on every rank, before the optimizer step: a non-finite loss or gradient is never applied.
    bad_loss = torch.zeros(world, dtype=torch.float64, device=device)
    bad_loss[rank] = (~torch.isfinite(loss_sum)).double()  # whose loss (summed: every rank sees all)
    bad_grad = (~torch.isfinite(gnorm)).double()  # the gradient, averaged over ranks
    vec = StepSums.pack(loss_sum, step_m, bad_loss, bad_grad)
    if world > 1:
        dist.all_reduce(vec)
    sums = StepSums.unpack(vec.cpu().numpy(), t.plan.drafter.block_size, world)
    if sums.diverged:  # the same on every rank: all stop here, none waits for another
        raise TrainingDiverged(diverged_message(sums.nonfinite_loss, float(gnorm), st.step + 1, t.out,
                                                st.last_ckpt))
    t.opt.step()
    t.sched.step()
    t.opt.zero_grad(set_to_none=True)
    return sums, gnorm


@dataclass
class StepLog:
    """Rank 0's records of the steps (None on the other ranks): metrics.jsonl, TensorBoard, the bar."""

    metrics: IO[str] | None = None  # metrics.jsonl, appended to
    tb: SummaryWriter | None = None
    bar: tqdm | None = None
    # Where TensorBoard's writer goes, made at the first step recorded: a rerun of a finished run
    # (nothing to train) leaves no empty event file.
    tb_out: Path | None = None

    @classmethod
    def open(cls, t: Trainer, step: int, stop: int | None) -> StepLog:
        if t.rank != 0:
            return cls()
        made = cls(metrics=open(t.out / "metrics.jsonl", "a"), tb_out=t.out)
        if t.cfg.progress:
            from tqdm import tqdm

            made.bar = tqdm(total=stop if stop is not None else t.plan.total_steps, initial=step, unit="step",
                            desc="train", dynamic_ncols=True)
        return made

    def record(self, t: Trainer, st: LoopState, r: StepResult, stop: int | None, recompiles: int) -> None:
        """Rank 0, after step `st.step`: its line of metrics.jsonl, TensorBoard, the bar, the heartbeat, the log."""
        import numpy as np
        import torch

        step, total = st.step, t.plan.total_steps
        m = r.sums
        loss = m.loss_sum / max(r.wsum.item(), 1e-12)  # a step without scored tokens logs 0, not nan
        acc = np.where(m.slot_count > 0, m.slot_correct / np.maximum(m.slot_count, 1), 0.0)
        # From the first drafted token (DFlash's slot 1, DSpark's slot 0): acc_slot1 is its accuracy.
        acc = acc[1 - t.drafter.cfg.label_offset:]
        tau = m.tau_sum / max(m.blocks, 1)
        t_step = time.perf_counter() - r.t0
        rec = {"step": step, "epoch": st.epoch, "loss": loss, "acc_slot1": float(acc[0]), "tau": tau,
               "lr": r.lr, "grad_norm": float(r.gnorm), "step_time": t_step,
               "data_wait": r.t_data / t_step,
               "acc": [round(float(a), 5) for a in acc], "tokens": step * t.tokens_per_step,
               "trained_tokens": int(r.trained_tokens.item()), "recompiles": recompiles}
        if t.cuda:
            rec["max_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        if self.tb_out is not None:
            self.tb, self.tb_out = _tensorboard(self.tb_out), None
        if self.tb is not None:
            for k in ("loss", "acc_slot1", "tau", "lr", "grad_norm", "data_wait"):
                self.tb.add_scalar(f"train/{k}", rec[k], step)
        bar = self.bar
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"loss {loss:.3f} acc1 {acc[0]:.3f} tau {tau:.2f} "
                                f"{t.tokens_per_step * bar.format_dict['rate'] if bar.format_dict.get('rate') else 0:.0f} tok/s")
        heartbeat(phase="train", step=step, total_steps=total, stop_step=stop, loss=loss, tau=tau)
        if step == 1 or step % t.cfg.log_every == 0 or step == stop:
            log.info("step %d/%d loss %.4f acc1 %.3f tau %.2f lr %.2e step %.3fs data-wait %.1f%% recompiles %d",
                     step, total, loss, acc[1], tau, rec["lr"], t_step, 100 * rec["data_wait"], rec["recompiles"])

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.close_bar()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None

def _dspark_loss(t: Trainer, h, mb, B: int):
    """The three-term loss (blocks/dspark_loss.py) of a micro-batch -> (sum, correct): DSpark's, or
    DFlash's with the L1 term (no heads: its CE and L1 terms)."""
    from dflash_offline.drafter.dspark import previous_tokens
    from dflash_offline.blocks.dspark_loss import LossWeights, dspark_loss

    cfg, d = t.cfg, t.drafter
    prev = previous_tokens(mb.block_ids, mb.labels, B) if d.markov_head is not None else mb.labels
    r = dspark_loss(h, d.lm_head.weight, d.markov_head, d.confidence_head, prev, mb.labels, mb.weights, mb.soft_ids,
                    mb.soft_logprobs, LossWeights(cfg.resolved_ce_weight, cfg.resolved_tv_weight, cfg.bce_weight),
                    t.loss_chunk, compiled=t.compile_loss,
                    dpace_alpha=cfg.dpace_alpha if cfg.loss_weights == "dpace" else None, block_size=B)
    return r.total, r.correct


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


def _tensorboard(out: Path):
    """A TensorBoard writer under OUT/tensorboard/, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:
        log.info("tensorboard not installed: metrics go to metrics.jsonl only (pip install tensorboard)")
        return None
    return SummaryWriter(str(out / "tensorboard"))
