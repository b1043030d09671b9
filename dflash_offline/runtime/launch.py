"""How a stage was launched (one process per device, or torchrun ranks), its devices, and the
rendezvous of the ranks."""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import os
import sys
import time
from dataclasses import dataclass

from dflash_offline.runtime import logs
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.logs import heartbeat, log
from dflash_offline.runtime.signals import stop_requested


# --------------------------------------------------------------------------------------------
# Devices and launch


@dataclass(frozen=True)
class Launch:
    """Who this process is: started by our own launcher, by torchrun, or alone."""

    rank: int
    world_size: int
    local_rank: int
    under_torchrun: bool


# What a torch.distributed launch puts in each rank's environment. torchrun (the elastic agent)
# also sets TORCHELASTIC_RUN_ID and GROUP_RANK: a shell never has them, so they tell a real launch
# from variables left over from an earlier one (`export RANK=0 WORLD_SIZE=2`), which would have a
# plain command do its share of the work and wait forever for ranks that never come.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK")
RENDEZVOUS_S = 120.0  # how long a rank of a launch other than torchrun waits for the others to join
RANK_WAIT_S = 1800.0  # how long rank 0 waits for the other ranks' commits without any progress
UNSET_RANK_VARS = "unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT"


def launch_env() -> str:
    return " ".join(f"{k}={os.environ[k]}" for k in LAUNCH_VARS if k in os.environ)


def torchrun_launch() -> Launch | None:
    """The rank layout torchrun (or another torch.distributed launcher) put in the environment, or
    None for a plain command. The variables count only when the launch really is distributed:
    torchrun's own markers are set, or WORLD_SIZE > 1 comes with all of RANK, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT (such a launch meets its ranks first, `join_ranks`); anything else
    (a stale RANK/WORLD_SIZE in the shell, values that do not fit) is refused in one line."""
    if not any(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None  # MASTER_ADDR/MASTER_PORT alone change nothing
    env = launch_env()
    torchrun = all(k in os.environ for k in TORCHRUN_VARS)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        ok = 0 <= rank < world and 0 <= local <= rank
    except (KeyError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"the environment has {env}, which is not a consistent distributed launch; to run alone: "
                        f"{UNSET_RANK_VARS} (left from an earlier torchrun?); to run distributed, start the command with "
                        "torchrun")
    if not torchrun and not (world > 1 and all(k in os.environ for k in LAUNCH_VARS)):
        raise UserError(f"the environment has {env} but this is not a torchrun launch (no {' or '.join(TORCHRUN_VARS)}"
                        f"); to run alone: {UNSET_RANK_VARS} (left from an earlier torchrun?); to run distributed, start the "
                        "command with torchrun")
    return Launch(rank=rank, world_size=world, local_rank=local, under_torchrun=torchrun)


_rendezvous_store = None  # join_ranks' store: the training process group is built on it


def join_ranks(launch: Launch | None) -> None:
    """A launch other than torchrun (which meets its ranks before it starts them): every rank
    meets the others at MASTER_ADDR:MASTER_PORT before any work, at most
    DFLASH_OFFLINE_RENDEZVOUS_S seconds (default RENDEZVOUS_S), and says so in its log; ranks
    that do not come end the command in one line."""
    global _rendezvous_store
    if launch is None or launch.under_torchrun or launch.world_size == 1 or _rendezvous_store is not None:
        return
    timeout = float(os.environ.get("DFLASH_OFFLINE_RENDEZVOUS_S", RENDEZVOUS_S))
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    log.info("distributed launch without torchrun (%s): rank %d waits up to %.0fs for the other %d rank(s) at %s:%s",
             launch_env(), launch.rank, timeout, launch.world_size - 1, addr, port)
    heartbeat(phase="waiting for the other ranks")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # a client's retries print C++ stacks otherwise

    import torch.distributed as dist

    t0 = time.time()
    try:
        _rendezvous_store = dist.TCPStore(addr, int(port), launch.world_size, launch.rank == 0,
                                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=True)
    except Exception as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"the environment has {launch_env()}, but the other ranks did not join at {addr}:{port} "
                        f"within {time.time() - t0:.0f}s ({why}); to run alone: {UNSET_RANK_VARS} (left from an earlier "
                        "torchrun?); to run distributed, start every rank (torchrun does)") from None
    log.info("all %d ranks joined in %.1fs", launch.world_size, time.time() - t0)


def rendezvous_store():
    """The store join_ranks met the other ranks on (None under torchrun, our launcher, or alone)."""
    return _rendezvous_store


# --------------------------------------------------------------------------------------------
# Waiting for the other ranks in a collective

# A rank blocked in a C++ collective (gloo, NCCL) runs no Python signal handler until it returns,
# so a stop request cannot reach a rank whose peer is stuck or gone; wait_for_ranks polls instead.
# After a stop request a rank still waits STOP_WAIT_S for the others (they got the request too and
# may be a moment behind), and at least DFLASH_OFFLINE_SLOW_RANK_S seconds (default SLOW_RANK_S)
# in all: rank 0 saving a large checkpoint or writing the export keeps the others waiting that long
# without being stuck.
STOP_WAIT_S = 3.0
SLOW_RANK_S = 120.0
_POLL_S = 0.05


class RanksNotMet(Exception):
    """A stop was requested and this rank stopped without the other ranks at a collective: they
    did not come (stuck, or gone), or the collective failed (a rank that stopped first is gone)."""

    def __init__(self, signum: int, what: str, why: str):
        super().__init__(f"they did not meet it at {what} ({why}); a rank is stuck or gone")
        self.signum = signum


def wait_for_ranks(work, what: str) -> None:
    """Wait for the collective `work` (started with async_op=True), `what` naming it for messages.
    Without a stop request this is work.wait(), its errors included (a rank that died: gloo's
    "Connection closed by peer"). After one, it raises RanksNotMet when the collective fails, or
    when it is still pending STOP_WAIT_S after the request and SLOW_RANK_S after the wait began; a
    second stop signal (KeyboardInterrupt) ends the wait at once. A collective given up while
    pending is left to the process's end (abandon_process_groups)."""
    t0 = time.monotonic()
    slow = float(os.environ.get("DFLASH_OFFLINE_SLOW_RANK_S", SLOW_RANK_S))
    asked = None  # when this wait saw the stop request
    said = False
    try:
        while not work.is_completed():
            now = time.monotonic()
            if not said and now - t0 > 1.0:
                heartbeat(phase=f"waiting for the other ranks at {what}")
                said = True
            signum = stop_requested()
            if signum is not None:
                asked = asked if asked is not None else now
                if now - asked >= STOP_WAIT_S and now - t0 >= slow:
                    raise RanksNotMet(signum, what, f"still pending {now - asked:.0f}s after the stop request, "
                                                    f"{now - t0:.0f}s in all")
            time.sleep(_POLL_S)  # the stop handlers run here
    except BaseException:
        abandon_process_groups()
        raise
    try:
        work.wait()
    except Exception as e:
        signum = stop_requested()
        if signum is None:
            raise
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RanksNotMet(signum, what, why) from e


def abandon_process_groups() -> None:
    """This process gave up on a collective that is still pending: the process groups' threads
    stay blocked in it, and destroying a group (destroy_process_group, or the interpreter freeing
    it at exit) waits for them forever. The groups are kept alive to the process's end instead
    (one reference more that is never dropped), so that the process can exit."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    for pg in {*c10d._world.pg_map, dist.group.WORLD}:
        if pg is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


# A rank past the end-of-run barrier has nothing left to do but exit; the C++ teardown of a process
# group (destroy_process_group, or the interpreter freeing the model that holds it) can hang for
# good, holding the GIL (a known torch.distributed failure: pytorch/pytorch#75097), where neither a
# signal handler nor a Python thread runs. faulthandler's watchdog is a C thread: it still runs.
TEARDOWN_S = 60.0


def exit_within(seconds: float) -> None:
    """The process's work is done: if it has not exited `seconds` from now, the tracebacks of its
    threads go to its log and it exits with code 1, instead of never."""
    stream = getattr(getattr(logs, "_file_handler", None), "stream", None) or sys.stderr
    faulthandler.dump_traceback_later(seconds, exit=True, file=stream)


def parse_devices(spec: str, option: str = "--devices") -> list[str]:
    """`"0,1,2"` -> `["cuda:0", "cuda:1", "cuda:2"]`; `"cpu,cpu"` -> two CPU workers. `option`: how
    messages name the value (the flag, or the recipe key and file)."""
    items = [s.strip() for s in str(spec).split(",") if s.strip()]
    if not items:
        raise UserError(f"{option} {spec!r} is empty: give GPU indices like 0,1,2 or 'cpu'")
    out = []
    for s in items:
        if s == "cpu":
            out.append("cpu")
        elif s.isdigit():
            out.append(f"cuda:{int(s)}")
        elif s.startswith("cuda:") and s[5:].isdigit():
            out.append(s)
        else:
            raise UserError(f"{option} {spec!r}: {s!r} is not a GPU index or 'cpu' (example: 0,1,2,3,4)")
    gpus = [d for d in out if d != "cpu"]
    if len(set(gpus)) != len(gpus):
        raise UserError(f"{option} {spec!r} lists a GPU twice: one worker process per GPU")
    return out


def check_devices_exist(devices: list[str], option: str = "--devices") -> None:
    """Refuse GPU indices the machine does not have (torch imported here, no weights loaded)."""
    gpus = [int(d.split(":")[1]) for d in devices if d.startswith("cuda")]
    if not gpus:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [g for g in gpus if g >= count]
    if missing:
        fix = "set it to cpu" if option.startswith("--config ") else f"use {option} cpu"  # a recipe key, or the flag
        raise UserError(
            f"{option} asks for GPU {','.join(map(str, missing))} but this machine has {count} CUDA "
            f"device(s){' (torch sees no CUDA)' if count == 0 else ''}; {fix} to run on the CPU"
        )


def single_thread_compute() -> None:
    """One compute thread per process: several worker processes share the machine's cores."""
    import torch

    torch.set_num_threads(int(os.environ.get("DFLASH_THREADS", "1")) or 1)


def resolve_compute_dtype(name: str, devices: list[str], launch: Launch | None,
                          options: tuple[str, str] = ("--devices", "--compute-dtype")) -> str:
    """`auto` -> bfloat16 on GPUs, float32 on CPUs; one dtype per cache, so no mixing of the two."""
    kinds = {"cpu" if d == "cpu" else "cuda" for d in devices}
    if launch is not None:
        kinds = {"cpu"} if kinds == {"cpu"} else {"cuda"}
    if name != "auto":
        return name
    if len(kinds) > 1:
        devices_option, dtype_option = options
        raise UserError(f"{devices_option} mixes CPU and GPU workers with {dtype_option} auto (bf16 on GPU, fp32 on "
                        f"CPU); choose one kind of device or set {dtype_option}")
    return "bfloat16" if kinds == {"cuda"} else "float32"
