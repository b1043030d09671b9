"""Option ranges refused before any work, a non-finite loss stopping training
without an export, and no folder the tool did not create written into. Each refusal is one line,
with its exit code, no traceback, and nothing committed changed."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
from conftest import TRAIN, run_cli, tree_digest

from dflash_offline.config import ExtractConfig, GenerateConfig
from dflash_offline.evaluate.config import EvalConfig
from dflash_offline.sizing_config import PlanConfig
from dflash_offline.train.config import TrainConfig
from dflash_offline.runtime.errors import UserError

NAN, INF = float("nan"), float("inf")


def _train(**kw):
    return TrainConfig(cache="c", target="t", out="o", **kw)


def _extract(**kw):
    return ExtractConfig(target="t", data=["d"], cache="c", **kw)


def _generate(**kw):
    return GenerateConfig(target="t", prompts=["p"], out="o", **kw)


def _plan(**kw):
    return PlanConfig(target="t", data=["d"], **kw)


def _eval(**kw):
    return EvalConfig(target="t", drafters=["d"], prompts="p", **kw)


# (config, the start of its one line): every class of out-of-range numeric option, per stage.
BAD = [
    (_train(clip=0.0), "--clip must be positive"),
    (_train(clip=-1.0), "--clip must be positive"),
    (_train(clip=NAN), "--clip must be positive"),
    (_train(gamma=0.0), "--gamma must be positive"),
    (_train(gamma=-2.0), "--gamma must be positive"),
    (_train(warmup_ratio=1.0), "--warmup-ratio must be in [0, 1)"),
    (_train(warmup_ratio=-0.1), "--warmup-ratio must be in [0, 1)"),
    (_train(weight_decay=-0.01), "--weight-decay must be >= 0"),
    (_train(weight_decay=INF), "--weight-decay must be >= 0"),
    (_train(lr=INF), "--lr must be positive and finite"),
    (_train(lr=0.0), "--lr must be positive"),
    (_train(kd_weight=NAN), "--kd-weight must be in [0, 1]"),
    (_train(prefetch=0), "--prefetch must be positive"),
    (_train(loader_workers=-1), "--loader-workers must be >= 0"),
    (_train(anchors_per_sample=-1), "--anchors-per-sample must be >= 0"),
    (_train(seed=-1), "--seed must be >= 0"),
    (_train(mask_token_id=-1), "--mask-token-id must be >= 0"),
    (_train(max_steps=0), "--max-steps must be positive"),
    (_train(follow_window=0), "--follow-window must be positive"),
    (_train(eval_samples=-3), "--eval-samples must be positive"),
    (_train(seq_len=8, block_size=8), "--seq-len must exceed --block-size (8), got 8"),
    (_train(epochs="2"), "--epochs must be an integer"),
    (_extract(max_bytes=0), "--max-bytes must be positive"),
    (_extract(writers=0), "--writers must be positive"),
    (_extract(topk=-1), "--topk must be >= 0"),
    (_extract(passes=-2), "--passes must be positive"),
    (_generate(temperature=NAN), "--temperature must be >= 0 and finite"),
    (_generate(temperature=-0.5), "--temperature must be >= 0"),
    (_generate(top_p=0.0), "--top-p must be in (0, 1]"),
    (_generate(eos_token_ids=[-1]), "--eos-token-ids [-1]: token ids are >= 0"),
    (_plan(extract_gpus=0), "--extract-gpus must be positive"),
    (_plan(train_gpus=-1), "--train-gpus must be positive"),
    (_plan(epochs=0), "--epochs must be positive"),
    (_plan(max_len=0), "--max-len must be positive"),
    (_plan(topk=-1), "--topk must be >= 0"),
    (_plan(max_bytes=0), "--max-bytes must be positive"),
    (_eval(max_prompts=0), "--max-prompts must be positive"),
    (_eval(walk_batch_rows=0), "--walk-batch-rows must be positive"),
    # Options that would otherwise be ignored without a word.
    (_train(eval_every=5), "--eval-every sets how often --eval-cache is measured"),
    (_generate(top_p=0.5), "--top-p 0.5 applies to sampling, but --temperature is 0 (greedy)"),
    (_eval(cache="c", seq_len=16, num_anchors=100000), "--num-anchors 100000 exceeds --seq-len 16"),
]


@pytest.mark.parametrize("cfg,line", BAD, ids=[f"{type(c).__name__}:{line.split()[0]}" for c, line in BAD])
def test_option_out_of_range_is_one_line(cfg, line):
    with pytest.raises(UserError) as e:
        cfg.validate()
    msg = str(e.value)
    assert msg.startswith(line) and "\n" not in msg, msg


def test_off_values_are_accepted():
    """0 is a legal "off" where the option says so; inf clip is no clipping."""
    _train(loader_workers=0, anchors_per_sample=0, kd_weight=0.0, warmup_ratio=0.0, weight_decay=0.0, clip=INF,
           profile_steps=0, seed=0, seq_len=9, block_size=8).validate()
    _extract(topk=0).validate()
    _generate(temperature=0.0, top_p=1.0).validate()
    _plan(topk=0).validate()


def test_option_range_cli_refuses_before_any_work(tmp_path):
    """Through the CLI: one `error:` line, exit 2, no traceback, and not even a run folder or log."""
    out = tmp_path / "run"
    r = run_cli(["train", "--cache", tmp_path / "no-cache", "--target", tmp_path / "no-target", "--out", out,
                 "--clip", "0", "--no-progress"], timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: --clip must be positive (inf = no clipping), got 0.0 ("), r.stderr
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# Non-finite loss


def test_nonfinite_loss_stops_all_ranks_without_export(tmp_path, arith_cache, tiny_dense):
    """lr 1e30 on two ranks: step 1 is finite and checkpointed, step 2's loss is not. Both ranks stop
    at step 2 before the update (no hang); one line names the step, the ranks and step-1; exit 1; no
    export, no step-2, and step-1 as it was committed."""
    from dflash_offline.runs.checkpoint import load_checkpoint

    out = tmp_path / "run"
    r = run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN, "--lr", "1e30",
                 "--max-steps", "5", "--checkpoint-every", "1", "--devices", "cpu,cpu"], timeout=300)
    assert r.returncode == 1, r.stderr
    err = r.stderr.strip()
    assert err.splitlines() == [err] and "Traceback" not in err, err
    assert err.startswith("failed: training stopped at step 2: the loss is not finite on rank 0, 1; the step was "
                          f"not applied and no export was written; the last good checkpoint is {out}/step-1; "), err
    assert "--lr" in err, err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step-", "export", ".tmp"))) == ["step-1"]
    assert load_checkpoint(str(out / "step-1")) is not None  # complete: config and weights agree
    assert [ln for ln in (out / "metrics.jsonl").read_text().splitlines()][-1].startswith('{"step": 1,')


def test_diverged_message_without_checkpoint_names_the_gradient():
    from dflash_offline.train.outcomes import diverged_message

    line = diverged_message([0.0, 0.0], math.inf, 7, Path("runs/r"), 0)
    assert line.startswith("training stopped at step 7: the gradient norm is inf on every rank (2 rank(s)), "
                           "with a finite loss;") and "there is no checkpoint yet" in line


# ----------------------------------------------------------------------------------------------
# Folders the tool did not create


def _snapshot(path: Path) -> dict:
    """Every entry's bytes and mtime: a refused run must not even add a log folder."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(path))] = (p.stat().st_mtime_ns, p.is_dir())
    return {"stat": out, "bytes": tree_digest(path, exclude=())}


def test_foreign_folders_are_refused_untouched(tmp_path, tiny_dense, tiny_data, arith_cache):
    """A Hugging Face model folder (config.json, weights) given as export --to, train --out or
    extract --cache: one line each, exit 2, no traceback, every file and mtime as it was."""
    hf = tmp_path / "hf-model"
    shutil.copytree(tiny_dense, hf)
    snap = _snapshot(hf)
    (tmp_path / "run").mkdir()  # a run folder (without checkpoints): the --to check comes first
    cases = [
        (["export", "--run", tmp_path / "run", "--to", hf],
         f"error: {hf}: exists and is not a drafter export (its config.json names architectures "
         "['Qwen3ForCausalLM']); refusing to replace it"),
        (["train", "--target", tiny_dense, "--cache", arith_cache, "--out", hf, *TRAIN],
         f"error: --out {hf}: the folder exists, is not empty and is not a training run (no step-N/ checkpoint; "
         "it holds config.json, generation_config.json, model.safetensors); choose a new or empty folder"),
        (["extract", "--target", tiny_dense, "--data", tiny_data, "--cache", hf, "--no-progress"],
         f"error: --cache {hf}: the folder exists, is not empty and is not a cache (no manifest.json; "
         "it holds config.json, generation_config.json, model.safetensors); choose a new or empty folder"),
    ]
    for args, line in cases:
        r = run_cli(args, timeout=120)
        err = r.stderr.strip()
        assert r.returncode == 2, (args[0], r.stderr)
        assert err.splitlines() == [err] and "Traceback" not in err, err
        assert err.startswith(line), err
        assert _snapshot(hf) == snap, args[0]


def test_export_dest_rules(tmp_path):
    """An earlier export (or an empty folder) may be replaced; a file, a folder with other files, or
    an unreadable config may not."""
    from dflash_offline.drafter.export import check_export_dest

    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    (ours / "model.safetensors").write_bytes(b"x")
    check_export_dest(ours)
    (tmp_path / "empty").mkdir()
    check_export_dest(tmp_path / "empty")
    check_export_dest(tmp_path / "missing")
    (ours / "README.md").write_text("mine")
    with pytest.raises(UserError, match=r"not a drafter export \(it also holds README.md\)"):
        check_export_dest(ours)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match="exists and is a file"):
        check_export_dest(tmp_path / "a-file")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="it has no drafter config.json"):
        check_export_dest(bad)


@pytest.mark.parametrize("entries,refused", [
    (["logs", "metrics.jsonl", ".run.lock", "tensorboard", ".tmp-step-3-77"], False),  # a first run that stopped
    (["logs", "notes.txt"], True),
    (["manifest.json", "shards"], True),  # a cache given as --out
])
def test_run_folder_rule(tmp_path, entries, refused):
    from dflash_offline.runs.folder import refuse_foreign_run

    for name in entries:
        (tmp_path / name).mkdir()
    try:
        refuse_foreign_run(tmp_path)
    except UserError:
        assert refused
    else:
        assert not refused
