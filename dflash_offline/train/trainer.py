"""What a rank trains with (Trainer: its process group, drafter, DDP wrapper, optimizer and
schedule, built once from the plan) and what changes as its loop runs (LoopState)."""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_offline.options import where
from dflash_offline.train.config import TrainConfig
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.launch import rendezvous_store, single_thread_compute
from dflash_offline.runtime.logs import heartbeat
from dflash_offline.runtime.units import human_count
from dflash_offline.train.plan import TrainPlan
from dflash_offline.train.schedule import TokenSchedule, lr_lambda

if TYPE_CHECKING:  # the types only: torch and the drafter load where the rank builds them
    import torch
    from torch.distributed import ProcessGroup
    from torch.optim.lr_scheduler import LambdaLR

    from dflash_offline.drafter.model import DFlashDrafter

log = logging.getLogger("dflash.train")


@dataclass
class Trainer:
    """A rank's fixed parts: the same objects from its first step to its last."""

    cfg: TrainConfig
    plan: TrainPlan
    rank: int
    world: int
    device: str
    cuda: bool
    bf16: bool  # autocast to bfloat16
    out: Path
    drafter: DFlashDrafter
    model: torch.nn.Module  # the drafter, or its DDP wrapper with more than one rank
    params: list
    opt: torch.optim.AdamW
    sched: LambdaLR | TokenSchedule  # over the plan's steps (epochs), or over its tokens (--follow)
    loss_chunk: int
    compile_loss: bool  # the loss's element-wise passes as compiled kernels (blocks.loss)
    ctrl: ProcessGroup | None  # the group that agrees on stopping: gloo, so the check never syncs with the GPU

    @property
    def follow(self) -> bool:
        return self.plan.follow is not None

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.seq_len * self.plan.accum * self.world


@dataclass
class LoopState:
    """What the loop changes as it goes; the same on every rank after each step."""

    step: int  # optimizer steps done
    last_ckpt: int  # step of the last checkpoint (0: none): all ranks checkpoint together
    epoch: int = 0  # the segment's key: an epoch, or a follow window
    stopping: int | None = None  # the stop signal the ranks agreed on
    first_micro: bool = True  # the process's first micro-batch (it compiles the kernels) is still to come
    wait_total: float = 0.0  # seconds spent waiting for data


def build_trainer(rank: int, world: int, device: str, cfg: TrainConfig, plan: TrainPlan) -> Trainer:
    """Join the process group, build the drafter (frozen parts from the target, --init-layers),
    wrap it for DDP, make the optimizer and the schedule."""
    import torch
    import torch.distributed as dist

    from dflash_offline.drafter.model import DFlashDrafter

    single_thread_compute()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    ctrl = None
    if world > 1:
        # A launch other than torchrun met its ranks on a store (join_ranks); torchrun's and our
        # launcher's ranks meet through MASTER_ADDR/MASTER_PORT.
        store = rendezvous_store()
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                **({"store": store} if store is not None else {}))
        ctrl = dist.new_group(backend="gloo") if cuda else None
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dcfg = plan.drafter
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    # Built on the device: initialising a 27B-shaped drafter's ~1.8B parameters on one CPU thread
    # takes minutes; on the GPU it takes a moment. (GPU and CPU draw different initial weights.)
    t_build = time.perf_counter()
    heartbeat(phase="build drafter")
    with torch.device(device):
        drafter = DFlashDrafter(dcfg)
    heartbeat(phase="load weights")
    fault_point("load-weights")
    drafter.load_frozen_from_target(cfg.target, where(cfg, "target"))
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

        with warnings.catch_warnings():  # torch's advice applies to rank-local buffers; the drafter has none
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            model = DDP(drafter, device_ids=[device] if cuda else None, broadcast_buffers=False)
    params = drafter.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=plan.lr, weight_decay=cfg.weight_decay, fused=cuda)
    warmup = max(1, math.ceil(cfg.warmup_ratio * plan.total_steps))
    sched = (TokenSchedule(opt, plan.lr, cfg.warmup_ratio) if plan.follow is not None
             else torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(plan.total_steps, warmup)))
    return Trainer(cfg=cfg, plan=plan, rank=rank, world=world, device=device, cuda=cuda, bf16=bf16, out=out,
                   drafter=drafter, model=model, params=params, opt=opt, sched=sched, loss_chunk=loss_chunk,
                   compile_loss=cfg.compile_loss, ctrl=ctrl)
