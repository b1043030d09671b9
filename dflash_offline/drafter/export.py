"""The drafter's serving export: config.json + model.safetensors (bf16, trainable weights only).

The folder loads unchanged in the reference inference code (z-lab/dflash; tests/test_reference_parity.py),
and its config holds the keys vLLM's and SGLang's DFlash loaders read (docs/serving.md); the frozen
embedding and LM head are the target's and are not written. An export replaces only an earlier
export or an empty folder, whole or not at all.

A DSpark drafter is written as DeepSpec's checkpoints are (`Qwen3DSparkModel`: the DFlash fields at
the top level of config.json beside markov_rank, markov_head_type, enable_confidence_head,
confidence_head_with_markov, num_anchors (DeepSpec's loader asserts it) and sample_from_anchor;
`markov_head.*` and `confidence_head.proj.*` beside the DFlash tensors). The target's embedding and LM
head are left out by default, so that every serving engine lends the target's (llama.cpp would
otherwise take the copied input table as its LM head); `target_tables=True` (`export
--target-tables`) writes them for DeepSpec's evaluator, which loads them from the checkpoint. What
an engine cannot take (a gated Markov head, no confidence head) is said in one warning line naming
it (drafter/engines.py holds the facts).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from dflash_offline.drafter.config import DSPARK_ARCHITECTURE, DrafterConfig
from dflash_offline.drafter.engines import WITHOUT_TABLES, cannot_serve
from dflash_offline.drafter.model import FROZEN_PREFIXES, DFlashDrafter
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.paths import ordinary_mode, unwritable_folder

log = logging.getLogger("dflash.drafter")

EXPORT_CONFIG = "config.json"
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_ARCHITECTURES = (["DFlashDraftModel"], [DSPARK_ARCHITECTURE])


def check_export_dest(out: Path) -> None:
    """An export replaces only an earlier export (config.json of a DFlashDraftModel and its weights,
    nothing else) or an empty folder: anything else, e.g. a Hugging Face model folder, is refused."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is a file, not a drafter export; refusing to replace it (choose another "
                        "export folder)")

    why = unwritable_folder(out.absolute().parent)  # the export is written beside it, then renamed
    if why:
        raise UserError(f"{out}: {why}; choose another export folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        arch = json.loads((out / EXPORT_CONFIG).read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        arch = None
    others = sorted(p.name for p in out.iterdir() if p.name not in (EXPORT_CONFIG, EXPORT_WEIGHTS))
    if arch not in EXPORT_ARCHITECTURES or others:
        why = (f"it also holds {', '.join(others[:3])}" if arch in EXPORT_ARCHITECTURES
               else f"its config.json names architectures {arch}" if arch is not None else "it has no drafter config.json")
        raise UserError(f"{out}: exists and is not a drafter export ({why}); refusing to replace it: choose a new or "
                        "empty export folder (nothing was changed)")


def export_drafter(drafter: DFlashDrafter, out_dir: str, target_tables: bool = False, notes: bool = True) -> Path:
    """config.json + model.safetensors (bf16, trainable weights only; with `target_tables`, a DSpark
    drafter's also the target's embedding and LM head it holds). Written to a sibling temp folder
    and renamed into place, so out_dir is either the previous export or the new one. `notes`: say
    which engines cannot serve it as trained (off for the repeated best/ exports of a run)."""
    from safetensors.torch import save_file

    out = Path(out_dir).absolute()
    dspark = drafter.cfg.method == "dspark"
    if target_tables and not dspark:
        raise UserError("--target-tables: a DFlash export holds no embedding or LM head (the reference and every "
                        "engine's DFlash loader lend the target's); leave the option out")
    check_export_dest(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{out}: cannot write there ({e.strerror or e}); choose another export folder") from None
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        state = drafter.state_dict() if target_tables else drafter.trainable_state_dict()
        tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / EXPORT_WEIGHTS), metadata={"format": "pt"})
        ordinary_mode(tmp / EXPORT_WEIGHTS)  # safetensors leaves 0600: a serving process of another user reads it
        (tmp / EXPORT_CONFIG).write_text(json.dumps(drafter.cfg.to_export_dict(), indent=2) + "\n", encoding="utf-8")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)  # a rename cannot overwrite a non-empty folder: move the old one aside
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("drafter exported to %s (%d tensors)", out, len(tensors))
    if notes and dspark:
        tied = bool(torch.equal(drafter.embed_tokens.weight, drafter.lm_head.weight))
        refusing = cannot_serve(drafter.cfg, target_tables, tied)
        if refusing:
            log.warning("%s: not served as trained by %s", out, "; ".join(refusing))
        if not target_tables:
            log.info("%s", WITHOUT_TABLES)
    return out


def _json_kind(v) -> str:
    """The JSON type of a parsed value, as a message names it."""
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


def load_exported(out_dir: str, target_dir: str | None = None) -> DFlashDrafter:
    """Rebuild a drafter from an export (float32 trainable weights); frozen parts from target_dir."""
    from safetensors import safe_open

    root = Path(out_dir)
    try:
        d = json.loads((root / EXPORT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{root}: no readable drafter config.json ({e})") from None
    # The shape before any key is read (from_export_dict reads keys of these objects): hand-edited or
    # another program's file is one line naming it, not an AttributeError.
    if not isinstance(d, dict):
        raise UserError(f"{root / EXPORT_CONFIG}: holds a JSON {_json_kind(d)}, not an object; not a DFlashDraftModel "
                        "config: export the drafter again (dflash-offline export --run RUN --to DIR)")
    for key in ("dflash_config", "dflash_offline"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise UserError(f"{root / EXPORT_CONFIG}: key {key!r} holds a JSON {_json_kind(d[key])}, not an object; "
                            "the drafter config is damaged: export the drafter again (dflash-offline export --run "
                            "RUN --to DIR)")
    arch = d.get("architectures")
    if not (isinstance(arch, list) and ("DFlashDraftModel" in arch or arch == [DSPARK_ARCHITECTURE])):
        raise UserError(f"{root / EXPORT_CONFIG}: not a DFlashDraftModel or {DSPARK_ARCHITECTURE} config (architectures: "
                        f"{json.dumps(arch)})")
    drafter = DFlashDrafter(DrafterConfig.from_export_dict(d, str(root / EXPORT_CONFIG)))
    wanted = drafter.trainable_state_dict()
    with safe_open(str(root / EXPORT_WEIGHTS), framework="pt", device="cpu") as sf:
        keys = set(sf.keys())
        if drafter.cfg.method == "dspark":  # the tables, where written (--target-tables): the target's are used
            keys -= {k for k in keys if k.startswith(FROZEN_PREFIXES)}
        if keys != set(wanted):
            raise UserError(f"{root / EXPORT_WEIGHTS}: missing {sorted(set(wanted) - keys)[:3]}, "
                            f"unexpected {sorted(keys - set(wanted))[:3]}")
        with torch.no_grad():
            for k, dst in wanted.items():
                t = sf.get_tensor(k)
                if t.shape != dst.shape:
                    raise UserError(f"{root / EXPORT_WEIGHTS}: {k} has shape {tuple(t.shape)}, config implies {tuple(dst.shape)}")
                dst.copy_(t)
    if target_dir is not None:
        drafter.load_frozen_from_target(target_dir)
    return drafter
