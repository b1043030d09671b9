"""Training's careless-use refusals, each one line before any step: a checkpoint whose saved
settings were edited into another type, a tokenizer file of the wrong shape, a held-out cache
with a missing shard or edited widths, a cache manifest whose widths disagree with the target, a
recipe's cache without a manifest, a recipe setting a field that is not an option. Built on the
small artifacts in tests/data/made-by-f7e7743 (a tiny target, its cache and a run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import EARLIER, run_cli
from conftest import EARLIER_TRAIN as TRAIN


@pytest.fixture
def d(tmp_path) -> Path:
    return Path(shutil.copytree(EARLIER, tmp_path / "d"))


def _train(d, *extra, out=None, train=TRAIN):
    return run_cli(["train", "--target", d / "target", "--cache", d / "cache", "--out", out or d / "run", *train,
                    *extra], timeout=600)


def _without(flag: str) -> list[str]:
    """TRAIN without one option and its value."""
    i = TRAIN.index(flag)
    return TRAIN[:i] + TRAIN[i + 2:]


def _one_line(r) -> str:
    assert r.returncode == 2 and r.stderr.count("\n") == 1, (r.returncode, r.stderr[-3000:])
    return r.stderr.strip()


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def test_a_saved_drafter_setting_of_another_type_is_named(d):
    """state.json's drafter.block_size edited to "8": export and eval named a TypeError; resume
    named "block_size = 8, this run has 8"."""
    _edit_json(d / "run" / "step-3" / "state.json", lambda s: s["drafter"].update(block_size="8"))
    msg = _one_line(run_cli(["export", "--run", d / "run"]))
    assert 'state.json: drafter.block_size is "8", not an integer' in msg, msg
    _edit_json(d / "run" / "step-3" / "state.json", lambda s: (s["drafter"].update(block_size=8),
                                                                s["config"].update(block_size="8")))
    msg = _one_line(_train(d))
    assert 'state.json: config.block_size is "8", not of its type (int)' in msg, msg


def test_a_resume_names_an_unset_setting_as_its_default(d):
    msg = _one_line(_train(d, train=_without("--lr")))
    assert "was made with lr = 0.003, this run has unset (its default rule)" in msg, msg


def test_a_tokenizer_config_of_the_wrong_shape_is_named(d, tmp_path):
    (d / "target" / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": [1, 2]}))
    msg = _one_line(_train(d, out=tmp_path / "new", train=_without("--mask-token-id")))
    assert msg == (f"error: {d / 'target' / 'tokenizer_config.json'}: added_tokens_decoder holds a JSON list, not an "
                   "object; the tokenizer files are damaged: restore them from the model's release"), msg


def test_a_held_out_cache_is_checked_shard_by_shard_before_training(d, tmp_path):
    held = Path(shutil.copytree(d / "cache", tmp_path / "held"))
    shutil.rmtree(held / "shards" / "shard-000001.zarr")
    msg = _one_line(_train(d, "--eval-cache", held, out=tmp_path / "new"))
    assert msg.startswith(f"error: --eval-cache {held}: shard shard-000001 is listed in manifest.json but missing"), msg
    assert not (tmp_path / "new" / "step-3").exists()


def test_the_training_cache_as_held_out_is_refused_before_its_shards_are_read(d, tmp_path):
    """The same folder given twice: the line names the mistake, not a damaged shard found an epoch
    scan later (the shard is gone, so any read of it would fail first)."""
    shutil.rmtree(d / "cache" / "shards" / "shard-000001.zarr")
    msg = _one_line(_train(d, "--eval-cache", d / "cache", out=tmp_path / "new"))
    assert msg.startswith(f"error: --eval-cache {d / 'cache'} is the training cache (--cache {d / 'cache'})"), msg
    assert not (tmp_path / "new").exists()


def test_a_held_out_cache_with_edited_widths_is_refused(d, tmp_path):
    held = Path(shutil.copytree(d / "cache", tmp_path / "held"))
    _edit_json(held / "manifest.json", lambda m: m["target"].update(hidden_size=64))
    msg = _one_line(_train(d, "--eval-cache", held, out=tmp_path / "new"))
    assert msg.startswith(f"error: --eval-cache {held}: its manifest says hidden_size 64 and vocab_size 512, the "
                          "target's are 32 and 512"), msg


def test_a_cache_manifest_whose_widths_disagree_with_the_target_is_refused(d, tmp_path):
    _edit_json(d / "cache" / "manifest.json", lambda m: m["target"].update(hidden_size=64))
    msg = _one_line(_train(d, out=tmp_path / "new"))
    made_from = json.loads((d / "cache" / "manifest.json").read_text())["target"]["path"]
    assert msg == (f"error: --cache {d / 'cache'} was made from another target (its manifest says target.hidden_size "
                   f"64, from {made_from}), but --target {d / 'target'} has 32: give the target the cache was made "
                   "from, or extract a cache with this one"), msg


def test_a_cache_an_extract_is_still_writing_is_named_so(tiny_dense, tiny_data, tmp_path):
    """Not "run the extract command again" (it would meet the running one's lock): wait, or --follow."""
    import os
    import signal

    from conftest import extract_args
    from test_graceful_stop import held, start, wait_until

    cache = tmp_path / "cache"
    proc = start(extract_args(tiny_dense, tiny_data, cache, "--shard-tokens", "1024"),
                 {"DFLASH_OFFLINE_HOLD_AT": "batch-done:1"})
    try:
        wait_until(lambda: held(cache / "logs", ["extract-rank0"]), proc)
        r = run_cli(["train", "--target", tiny_dense, "--cache", cache, "--out", tmp_path / "run", *TRAIN])
        msg = _one_line(r)
        assert msg.startswith(f"error: --cache {cache}: an extract is still writing it (0/") and msg.endswith(
            "shards committed); wait for it to end, or train alongside it with --follow --epochs 1"), msg
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_recipe_cache_without_a_manifest_is_named_by_its_key(d, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'cache = "{empty}"\n')
    r = run_cli(["train", "--config", recipe, "--target", d / "target", "--out", tmp_path / "new", *TRAIN])
    assert _one_line(r) == (f"error: --config {recipe}: key 'cache' {empty}: no manifest.json; not a dflash-offline "
                            "cache (or nothing committed yet): give the folder extract wrote")


def test_a_recipe_cannot_set_a_field_that_is_not_an_option(d, tmp_path):
    """final_checkpoint (benchmarks turn it off) is no option: a recipe setting it ran silently
    without a checkpoint or an export."""
    recipe = tmp_path / "r.toml"
    recipe.write_text("final_checkpoint = false\n")
    r = run_cli(["train", "--config", recipe, "--target", d / "target", "--cache", d / "cache", "--out",
                 tmp_path / "new", *TRAIN])
    assert _one_line(r) == (f"error: --config {recipe}: unknown key 'final_checkpoint'; did you mean "
                            "'keep_checkpoints' or 'checkpoint_every'?")
    recipe.write_text("warmup_ration = 0.1\n")  # close to a key: which one is said
    r = run_cli(["train", "--config", recipe, "--target", d / "target", "--cache", d / "cache", "--out",
                 tmp_path / "new", *TRAIN])
    assert _one_line(r) == f"error: --config {recipe}: unknown key 'warmup_ration'; did you mean 'warmup_ratio'?"
    recipe.write_text("colour = 1\n")  # close to none: where the keys are listed
    r = run_cli(["train", "--config", recipe, "--target", d / "target", "--cache", d / "cache", "--out",
                 tmp_path / "new", *TRAIN])
    assert _one_line(r) == (f"error: --config {recipe}: unknown key 'colour'; the keys are the command's options with _ "
                            "for - (dflash-offline train --help lists them)")


def test_a_users_metrics_file_in_out_is_not_taken_for_a_runs(d, tmp_path):
    """A one-line file named metrics.jsonl that is no record was read as a run's last line cut by
    a kill, and the run replaced it."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "metrics.jsonl").write_text("mine\n")
    msg = _one_line(_train(d, out=out))
    assert msg.startswith(f"error: --out {out}: its metrics.jsonl was not written by `train`"), msg
    assert (out / "metrics.jsonl").read_text() == "mine\n"


def test_eval_checks_its_cache_shards_before_decoding(d):
    shutil.rmtree(d / "cache" / "shards" / "shard-000001.zarr")
    r = run_cli(["eval", "--target", d / "target", "--drafter", d / "run" / "step-3", "--cache", d / "cache",
                 "--no-progress"])
    assert _one_line(r).startswith(f"error: --cache {d / 'cache'}: shard shard-000001 is listed in manifest.json but "
                                   "missing on storage"), r.stderr


def test_a_cut_chunk_file_is_named_before_training(d, tmp_path):
    """A chunk file cut short (every chunk of a raw + CRC32C array has one known size): named when
    the preflight opens its shard, not by the training step that first reads it."""
    chunk = sorted((d / "cache" / "shards").glob("*.zarr/hidden/c/*/0/0"))[-1]
    size = chunk.stat().st_size
    with open(chunk, "r+b") as f:
        f.truncate(size // 2)
    msg = _one_line(_train(d, out=tmp_path / "new"))
    assert f"chunk file c/{chunk.parent.parent.name}/0/0 of {size // 2} bytes, expected {size} (truncated?)" in msg, msg
    assert not (tmp_path / "new" / "step-3").exists()
