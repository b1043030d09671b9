"""The one owner of a run's checkpoint format: `step-N/` folders (state.json, drafter.safetensors,
trainer.pt), written under a temporary name and renamed, so a checkpoint counts only when complete;
listing, validation, loading, resume, and keep-last-k. train writes them; eval, export and status
read them. Whether a checkpoint's settings allow a resume is train's question (train/resume.py).

Imports no torch at module level: the launcher's preflight and `status` read checkpoints without it
(a broken torch install fails in a process whose log is open)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

from dflash_offline.cache.location import Location
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.runtime.errors import NoRoom, UserError, no_room_reason, tensor_bytes
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.paths import ordinary_mode
from dflash_offline.runtime.units import human_bytes

log = logging.getLogger("dflash.train")
CHECKPOINT_PREFIX = "step-"
# What train writes in a checkpoint folder (step-N/): all that pruning deletes.
CHECKPOINT_FILES = ("state.json", "drafter.safetensors", "trainer.pt")


@dataclass(frozen=True)
class FollowPosition:
    """Where a --follow run goes on from (state.json's "follow"): the next window, its first step,
    and the tokens of the windows before it (the schedule's place)."""

    window: int = 0
    window_start: int = 0
    tokens_before: int = 0


class Place(NamedTuple):
    """Where the data goes on after a checkpoint (the data source says, train/sources.py): the place
    in the epochs, or (--follow) the next window. Exactly one of the two is set."""

    epoch: int | None = None
    step_in_epoch: int | None = None
    follow: FollowPosition | None = None


@dataclass
class CheckpointState:
    """A checkpoint's state.json: its step, the cache it trained on, the run's settings and the
    drafter's config, and where the data goes on (a Place's fields: the place in the epochs, or
    with --follow the next window)."""

    step: int
    cache_fingerprint: str
    config: dict  # dataclasses.asdict(TrainConfig); read back through train/resume.saved_config
    drafter: dict  # dataclasses.asdict(DrafterConfig); read back through DrafterConfig.from_saved
    epoch: int | None = None
    step_in_epoch: int | None = None
    follow: FollowPosition | None = None

    def to_json(self) -> dict:
        """The file's object: the place that is not set is left out, as before this type existed."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> "CheckpointState":
        """From a state.json that checkpoint_damage has read without complaint (keys it does not
        know, from a later version, are ignored)."""
        state = cls(**{f.name: d.get(f.name) for f in fields(cls)})
        if isinstance(state.follow, dict):
            known = {f.name for f in fields(FollowPosition)}
            state.follow = FollowPosition(**{k: v for k, v in state.follow.items() if k in known})
        return state

    @classmethod
    def read(cls, ck: Path) -> "CheckpointState":
        return cls.from_json(json.loads((ck / "state.json").read_text()))


def damaged_checkpoint(out: Path, step: int, what: str) -> str:
    """One line for a damaged file of `out/step-N/` (`what`: "FILE: what is wrong"), with the fix."""
    ck = out / f"{CHECKPOINT_PREFIX}{step}"
    before = checkpoint_before(ck)
    fix = (f"delete {ck} to resume from {out / f'{CHECKPOINT_PREFIX}{before}'}, the checkpoint before it"
           if before is not None else f"delete {ck} to train from the start (there is no checkpoint before it)")
    return f"{ck}/{what}; the checkpoint is damaged: {fix}, or restore the file from a copy"


def checkpoint_before(ck: Path) -> int | None:
    """The step of the run's checkpoint before `ck` (RUN/step-N), the one to fall back to when
    `ck` is damaged; None when there is none (or `ck` is not named as a checkpoint)."""
    step = ck.name[len(CHECKPOINT_PREFIX):]
    if not ck.name.startswith(CHECKPOINT_PREFIX) or not step.isdigit():
        return None
    before = [s for s in list_checkpoints(ck.parent) if s < int(step)]
    return before[-1] if before else None


def list_checkpoints(out: Path) -> list[int]:
    steps = []
    if out.is_dir():
        for p in out.iterdir():
            if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX):].isdigit():
                steps.append(int(p.name[len(CHECKPOINT_PREFIX):]))
    return sorted(steps)


def save_checkpoint(out: Path, step: int, drafter, opt, sched, state: CheckpointState, keep: int) -> Path:
    """Write `step-N/` under a temporary name, then rename: a checkpoint exists only when complete.
    A write that finds no room (a full device, a quota, a file-size limit) removes the temporary
    folder and raises NoRoom: one line naming the folder, the room needed and the intact checkpoint."""
    import torch
    from safetensors.torch import save_file

    final = out / f"{CHECKPOINT_PREFIX}{step}"
    tmp = out / f".tmp-{CHECKPOINT_PREFIX}{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in drafter.trainable_state_dict().items()}
    trainer = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng_cpu": torch.get_rng_state()}
    try:
        tmp.mkdir(parents=True)
        save_file(weights, str(tmp / "drafter.safetensors"))
        ordinary_mode(tmp / "drafter.safetensors")  # safetensors leaves 0600: unreadable to another user
        torch.save(trainer, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps(state.to_json(), indent=1))

        Location(str(out)).fsync_tree(tmp.name)  # on storage before it counts
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint is never left behind
        need = tensor_bytes(weights) + tensor_bytes(trainer) + (64 << 10)  # + headers, state.json
        try:
            free = shutil.disk_usage(out).free
        except OSError:
            free = None
        # torch.save's own message hides the cause: a full device shows as too little free space.
        reason = no_room_reason(e) or ("the device is full" if free is not None and free < need else None)
        if reason is None:
            raise

        before = list_checkpoints(out)
        intact = (f"the last complete checkpoint {out / f'{CHECKPOINT_PREFIX}{before[-1]}'} is intact and the same "
                  "command resumes from it" if before else
                  "there is no complete checkpoint yet: the same command starts from the beginning")
        err = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        raise NoRoom(f"checkpoint {final} could not be written: {reason} ({err}); it needs about "
                     f"{human_bytes(need)}" + (f", {human_bytes(free)} are free there" if free is not None else "")
                     + f"; the half-written {tmp.name} was removed; {intact} once there is room") from e
    fault_point("checkpoint-written")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fault_point("checkpoint-saved")
    for old in list_checkpoints(out)[:-keep]:
        remove_checkpoint(out / f"{CHECKPOINT_PREFIX}{old}")
    return final


def remove_checkpoint(ck: Path) -> None:
    """Prune an old checkpoint (--keep-checkpoints). One that holds anything train did not write
    (notes, an export) is kept whole, with a warning: its files are the user's to delete."""
    try:
        others = sorted(p.name for p in ck.iterdir() if p.name not in CHECKPOINT_FILES)
    except FileNotFoundError:
        return
    if others:
        log.warning("kept %s (--keep-checkpoints would prune it): it also holds %s, which train did not write; "
                    "delete the folder yourself once you no longer need them", ck,
                    ", ".join(others[:5]) + (" ..." if len(others) > 5 else ""))
        return
    shutil.rmtree(ck, ignore_errors=True)




def checkpoint_damage(ck: Path, files: tuple[str, ...] = CHECKPOINT_FILES, config_problem=None) -> str | None:
    """What is wrong with a checkpoint's files, as "FILE: what", or None: state.json is the JSON a
    checkpoint writes, drafter.safetensors and trainer.pt are whole (their headers and sizes agree).
    Reads headers only, no tensors: a check of a 27B-shaped drafter's checkpoint takes a moment.
    `config_problem(config) -> str | None`: a check of the saved training settings (train's resume
    reads them; a reader of the drafter alone need not)."""
    for name in files:
        f = ck / name
        try:
            size = f.stat().st_size
            if name == "state.json":
                try:
                    state = json.loads(f.read_text(encoding="utf-8"))
                except (UnicodeDecodeError, ValueError) as e:
                    return f"{name}: not valid JSON ({type(e).__name__}: {str(e).splitlines()[0]})"
                for key in ("cache_fingerprint", "config", "drafter"):
                    if not isinstance(state, dict) or key not in state:
                        return f"{name}: damaged or not a checkpoint's state (no {key})"
                if not isinstance(state["config"], dict) or not isinstance(state["drafter"], dict):
                    return f"{name}: damaged or not a checkpoint's state (config or drafter is not an object)"

                problem = DrafterConfig.saved_problem(state["drafter"])
                if problem := problem or (config_problem(state["config"]) if config_problem else None):
                    return f"{name}: {problem}"
            elif name.endswith(".safetensors"):
                with open(f, "rb") as fh:
                    head = fh.read(8)
                    n = int.from_bytes(head, "little") if len(head) == 8 else None
                    if n is None or n > size - 8:
                        return f"{name}: cut short ({size} bytes, less than its own header)"
                    try:
                        header = json.loads(fh.read(n))
                        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                                  default=0)
                    except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError):
                        return f"{name}: not a safetensors file (its header does not parse)"
                if 8 + n + end != size:
                    return (f"{name}: {'cut short' if size < 8 + n + end else 'longer than its header says'} "
                            f"({size} bytes, its header says {8 + n + end})")
            else:  # torch.save: a zip archive, its directory at the end
                try:
                    with zipfile.ZipFile(f) as z:
                        if any(i.header_offset + i.compress_size > size for i in z.infolist()):
                            return f"{name}: cut short ({size} bytes)"
                except (zipfile.BadZipFile, ValueError, EOFError) as e:
                    return f"{name}: not a complete torch.save file ({size} bytes; {e})"
        except OSError as e:
            return f"{name}: {e.strerror or e}"
    return None


def load_checkpoint(ck_dir: str):
    """The drafter (DFlashDrafter) of a training checkpoint `step-N/` (state.json + drafter.safetensors,
    float32); the frozen embedding and LM head are placeholders until load_frozen_from_target."""
    from safetensors.torch import load_file

    from dflash_offline.drafter.model import FROZEN_PREFIXES, DFlashDrafter

    ck = Path(ck_dir)
    what = checkpoint_damage(ck, ("state.json", "drafter.safetensors"))
    if what:
        raise UserError(f"{ck}/{what}; the checkpoint is damaged: use another checkpoint of the run (step-N/), or "
                        "restore the file from a copy")
    state = CheckpointState.read(ck)
    drafter = DFlashDrafter(DrafterConfig.from_saved(state.drafter, str(ck / "state.json")))
    got = drafter.load_state_dict(load_file(str(ck / "drafter.safetensors")), strict=False)
    lost = [k for k in got.missing_keys if not k.startswith(FROZEN_PREFIXES)]
    if got.unexpected_keys or lost:
        raise UserError(f"{ck}: drafter weights do not match its config (unexpected {got.unexpected_keys[:3]}, "
                        f"missing {lost[:3]}); the checkpoint is damaged")
    return drafter


def remove_unfinished(out: Path) -> None:
    """Remove the temporary folders of checkpoints a kill cut short (they never counted)."""
    for debris in out.glob(f".tmp-{CHECKPOINT_PREFIX}*"):
        shutil.rmtree(debris, ignore_errors=True)


def resume_checkpoint(out: Path, step: int, drafter, opt, sched, device: str) -> CheckpointState:
    """Load `out/step-N/` into the drafter, optimizer, scheduler and CPU RNG; its state.json.
    Its settings were checked in preflight (check_resume); a file that still fails to load is
    named the way checkpoint_damage names it, with the fix."""
    import torch
    from safetensors.torch import load_file

    ck = out / f"{CHECKPOINT_PREFIX}{step}"
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
        return CheckpointState.read(ck)
    except (MemoryError, torch.OutOfMemoryError):  # not the file's fault
        raise
    except Exception as e:
        raise RuntimeError(damaged_checkpoint(out, step, f"{reading}: {type(e).__name__}: "
                                              f"{str(e).splitlines()[0] if str(e) else ''}")) from None
