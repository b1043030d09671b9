"""`dflash-offline export`: a checkpoint's drafter in the serving format (dflash-method.md)."""

from __future__ import annotations

import json
from pathlib import Path

from .runtime import UserError


def export_checkpoint(run_dir: str, step: int | None = None, dest: str | None = None) -> Path:
    from safetensors.torch import load_file

    from .drafter import DFlashDrafter, DrafterConfig, export_drafter
    from .train import CHECKPOINT_PREFIX, list_checkpoints

    run = Path(run_dir)
    steps = list_checkpoints(run)
    if not steps:
        raise UserError(f"--run {run_dir}: no complete checkpoint (step-N/) in the folder")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise UserError(f"--step {step}: no such checkpoint in {run_dir}; available: {', '.join(map(str, steps))}")
    ck = run / f"{CHECKPOINT_PREFIX}{step}"
    state = json.loads((ck / "state.json").read_text())
    dcfg = DrafterConfig(**state["drafter"])
    drafter = DFlashDrafter(dcfg)
    missing = drafter.load_state_dict(load_file(str(ck / "drafter.safetensors")), strict=False)
    lost = [k for k in missing.missing_keys if not k.startswith(("embed_tokens.", "lm_head."))]
    if missing.unexpected_keys or lost:
        raise UserError(f"{ck}: drafter weights do not match its config (unexpected {missing.unexpected_keys[:3]}, "
                        f"missing {lost[:3]}); the checkpoint is damaged")
    return export_drafter(drafter, dest or str(run / "export"))
