"""`dflash-offline export`: a checkpoint's drafter in the serving format (dflash-method.md)."""

from __future__ import annotations

from pathlib import Path

from dflash_offline.runs.checkpoint import (CHECKPOINT_PREFIX, CheckpointState, checkpoint_before, checkpoint_damage,
                                            list_checkpoints, load_checkpoint)
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.paths import require_kind
from dflash_offline.targets.folder import read_target
from dflash_offline.train.resume import config_problem


def export_checkpoint(run_dir: str, step: int | None = None, dest: str | None = None,
                      target_dir: str | None = None, target_tables: bool = False) -> Path:
    from dflash_offline.drafter.export import check_export_dest, export_drafter

    run = Path(run_dir)
    require_kind(run_dir, "--run", True, "a training run folder (OUT of train, with step-N/ checkpoints)")
    if not run.exists():  # before anything else: the destination's checks would speak of a folder inside it
        raise UserError(f"--run {run_dir}: no such folder; give a training run folder (the --out of train, with "
                        "step-N/ checkpoints)")
    require_kind(dest, "--to", True, "a new or empty folder, or an earlier export")
    if target_dir is not None and not target_tables:
        raise UserError(f"--target {target_dir}: read only with --target-tables (an export without the target's tables "
                        "needs no target); add --target-tables or leave --target out")
    dest = dest or str(run / "export")
    inside = [p for p in Path(dest).absolute().parents if p.parent == run.absolute() and p.name.startswith(CHECKPOINT_PREFIX)]
    if inside:  # train owns its checkpoint folders (and prunes them)
        raise UserError(f"--to {dest}: inside the checkpoint folder {inside[0]}, which train writes and prunes; "
                        f"export beside it (the default is {run / 'export'})")
    check_export_dest(Path(dest).absolute())  # before the checkpoint is read
    steps = list_checkpoints(run)
    if not steps:
        raise UserError(f"--run {run_dir}: no complete checkpoint (step-N/) in the folder")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise UserError(f"--step {step}: no such checkpoint in {run_dir}; available: {', '.join(map(str, steps))}")
    ck = run / f"{CHECKPOINT_PREFIX}{step}"

    # The saved training settings are checked too: a DSpark export reads the run's target from them.
    what = checkpoint_damage(ck, ("state.json", "drafter.safetensors"), config_problem=config_problem)
    if what:
        before = checkpoint_before(ck)
        other = (f"export the one before with --step {before}" if before is not None
                 else "train again (no checkpoint before it)")
        raise UserError(f"{ck}/{what}; the checkpoint is damaged: {other}, or restore the file from a copy")
    drafter = load_checkpoint(str(ck))
    if target_tables and drafter.cfg.method != "dspark":
        raise UserError(f"--target-tables: {ck} holds a DFlash drafter, whose export has no embedding or LM head (the "
                        "reference and every engine's DFlash loader lend the target's); leave the option out")
    if target_tables:
        # DeepSpec's evaluator loads the embedding and LM head from the checkpoint: read them from the
        # target the run trained against.
        target = target_dir or (CheckpointState.read(ck).config or {}).get("target")
        if not target or not Path(target).is_dir():
            raise UserError(f"{ck}: --target-tables copies the target's embedding and LM head, but the run's target "
                            f"{target!r} is not a folder here; give its folder with --target")
        option = "--target" if target_dir else "the run's target"
        _check_trained_against(drafter, target, option)
        drafter.load_frozen_from_target(target, option)
    return export_drafter(drafter, dest, target_tables=target_tables)


def _check_trained_against(drafter, target: str, option: str) -> None:
    """The target folder holds the weights the run trained against (its fingerprint as the run
    recorded it): another model's embedding and LM head would be exported under this run's name."""
    info = read_target(target, option)
    want = (drafter.cfg.target or {}).get("weights_fingerprint")
    if want is not None and info.weights_fingerprint != want:
        raise UserError(f"{option} {target}: its weights are not the ones the run trained against (fingerprint "
                        f"{info.weights_fingerprint}, the run's {want}); --target-tables copies the target's "
                        "embedding and LM head: give the target the run trained against with --target")
