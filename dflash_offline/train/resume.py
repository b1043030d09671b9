"""Whether a run folder's last checkpoint may be resumed with this run's settings: the settings a
resumed run must share with it (the TrainConfig fields marked `resume=True`), read under their
current names, with what earlier versions did where a setting did not exist yet. The checkpoint
format itself is runs/checkpoint.py's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dflash_offline.options import under_current_names
from dflash_offline.runs.checkpoint import CHECKPOINT_PREFIX, CheckpointState, checkpoint_damage, damaged_checkpoint, list_checkpoints
from dflash_offline.runtime.errors import UserError
from dflash_offline.train.config import TrainConfig

# Settings a resumed run must share with its checkpoint (they decide the numbers of every step):
# the TrainConfig fields marked `resume=True`.
RESUME_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("resume"))


def saved_config(config: dict) -> dict:
    """A checkpoint's saved TrainConfig with fields saved under an earlier name (a checkpoint from
    before a rename: num_layers, layers) under their current one."""
    return under_current_names(TrainConfig, config)


# What a checkpoint written before a setting existed did, where that is not the setting's default:
# earlier versions cut every sample longer than --seq-len to its first seq_len tokens.
EARLIER_RULES = {"long_samples": "truncate"}


def check_resume(cfg: TrainConfig, cache_fingerprint: str, moot: tuple[str, ...] = ()) -> None:
    """Refuse, before any process starts, to resume a checkpoint made on another cache or with
    other settings (a changed lr would be silently overridden by the saved optimizer state).
    `moot`: settings that change no number of this run (long_samples when every sample fits)."""
    out = Path(cfg.out)
    found = list_checkpoints(out)
    if not found:
        return
    ck = out / f"{CHECKPOINT_PREFIX}{found[-1]}"
    what = checkpoint_damage(ck, config_problem=config_problem)  # headers and sizes only: a damaged file is named before any rank starts
    if what:
        raise UserError(damaged_checkpoint(out, found[-1], what))
    state = CheckpointState.read(ck)
    if state.cache_fingerprint != cache_fingerprint:
        raise UserError(f"{ck} was trained on another cache (its fingerprint differs); use a new --out")
    defaults = TrainConfig()
    saved = saved_config(state.config)
    for key in RESUME_KEYS:
        if key in moot:
            continue
        # A key newer than the checkpoint: what the version that wrote it did, by default its default.
        theirs = saved.get(key, EARLIER_RULES.get(key, getattr(defaults, key)))
        if theirs != getattr(cfg, key):
            raise UserError(f"{ck} was made with {key} = {_shown(theirs)}, this run has {_shown(getattr(cfg, key))}; "
                            "use the same settings to resume, or a new --out")


def config_problem(config: dict) -> str | None:
    """A saved setting of the resume identity that is not of its field's type ("config.KEY is ..."),
    or None: a hand-edited "8" is a damaged file, not a setting that differs from 8."""
    def fits(v, kind: str) -> bool:
        if v is None:
            return "None" in kind
        if kind.startswith("bool"):
            return isinstance(v, bool)
        if kind.startswith("int"):
            return isinstance(v, int) and not isinstance(v, bool)
        if kind.startswith("float"):
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        if kind.startswith("str"):
            return isinstance(v, str)
        if kind.startswith("list[int]"):
            return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
        return True

    saved = saved_config(config)
    for f in dataclasses.fields(TrainConfig):
        if f.name in RESUME_KEYS and f.name in saved and not fits(saved[f.name], str(f.type)):
            return f"config.{f.name} is {json.dumps(saved[f.name])}, not of its type ({f.type})"
    return None


def _shown(v) -> str:
    """A setting in a message, as JSON (a hand-edited "8" must not read as the 8 it differs from);
    None is an option left to its default rule (the lr's, the cache's layers)."""
    return "unset (its default rule)" if v is None else json.dumps(v)
