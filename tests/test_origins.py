"""Every message about a value names where it came from: the flag the user typed, or the recipe
key and file it was read from; the shared sampling options are checked the same way in every
command that takes them."""

from __future__ import annotations

import math

import pytest

from conftest import TRAIN, run_cli
from dflash_offline.config import ExtractConfig, GenerateConfig
from dflash_offline.evaluate.config import EvalConfig
from dflash_offline.train.config import TrainConfig
from dflash_offline.options import load_recipe, merge
from dflash_offline.runtime.errors import UserError

REQUIRED = {
    TrainConfig: 'cache = "c"\ntarget = "t"\nout = "o"\n',
    ExtractConfig: 'target = "t"\ndata = "d"\ncache = "c"\n',
    GenerateConfig: 'target = "t"\nprompts = "p"\nout = "o"\n',
    EvalConfig: 'target = "t"\ndrafters = "d"\nprompts = "p"\n',
}


def _from_recipe(tmp_path, cls, body: str):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(REQUIRED[cls] + body)
    return merge(cls, load_recipe(recipe, cls), {}), recipe


@pytest.mark.parametrize("cls", [GenerateConfig, EvalConfig], ids=["generate", "eval"])
@pytest.mark.parametrize("bad, expect", [
    ("temperature = nan", "key 'temperature' must be >= 0 and finite, got nan (0 = greedy)"),
    ("temperature = inf", "key 'temperature' must be >= 0 and finite, got inf (0 = greedy)"),
    ("temperature = -1.0", "key 'temperature' must be >= 0 and finite, got -1.0"),
    ("temperature = 1.0\ntop_p = 0.0", "key 'top_p' must be in (0, 1], got 0.0"),
    ("seed = -1", "key 'seed' must be >= 0 (it keys the sampling noise), got -1"),
    ("seed = 4611686018427387904", "key 'seed' 4611686018427387904 is too large"),
])
def test_sampling_options_are_checked_alike_and_named_by_their_key(tmp_path, cls, bad, expect):
    """generate and eval share the sampling options and their checks: a NaN or infinite
    temperature and a negative seed (whose noise would repeat another seed's) are refused."""
    cfg, recipe = _from_recipe(tmp_path, cls, bad + "\n")
    with pytest.raises(UserError) as e:
        cfg.validate()
    assert str(e.value).startswith(f"--config {recipe}: ") and expect in str(e.value), str(e.value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_eval_refuses_a_non_finite_temperature_from_the_command_line(value):
    with pytest.raises(UserError, match=r"^--temperature must be >= 0 and finite, got (nan|inf)"):
        EvalConfig(target="t", drafters=["d"], prompts="p", temperature=value).validate()


@pytest.mark.parametrize("cls, body, expect", [
    (TrainConfig, "seq_len = 8\nblock_size = 8", "key 'seq_len' must exceed key 'block_size' (8), got 8"),
    (TrainConfig, "seq_len = 64\nnum_anchors = 100000", "key 'num_anchors' 100000 exceeds key 'seq_len' 64"),
    (ExtractConfig, "max_len = 64\nbatch_tokens = 32", "key 'batch_tokens' 32 is smaller than key 'max_len' 64"),
    (ExtractConfig, "capture_layers = [1, 1]", "key 'capture_layers' [1, 1] lists a layer twice"),
    (GenerateConfig, "eos_token_ids = [-2]", "key 'eos_token_ids' [-2]: token ids are >= 0"),
    (GenerateConfig, "top_p = 0.5", "key 'top_p' 0.5 applies to sampling, but --temperature is 0"),
])
def test_cross_checks_name_recipe_keys(tmp_path, cls, body, expect):
    cfg, recipe = _from_recipe(tmp_path, cls, body + "\n")
    with pytest.raises(UserError) as e:
        cfg.validate()
    assert str(e.value).startswith(f"--config {recipe}: ") and expect.format(r=recipe) in str(e.value), str(e.value)


def test_a_mask_token_from_a_recipe_is_named_by_its_key(tiny_dense, arith_cache, tmp_path):
    """Checked against the target's vocabulary in preflight: the message names the recipe key
    the id came from, not a --mask-token-id the user never typed."""
    recipe = tmp_path / "train.toml"
    recipe.write_text("mask_token_id = 99999\n")
    args = [a for a in TRAIN]
    i = args.index("--mask-token-id")
    del args[i:i + 2]
    r = run_cli(["train", "--config", recipe, "--target", tiny_dense, "--cache", arith_cache, "--out",
                 tmp_path / "run", *args], timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: --config {recipe}: key 'mask_token_id' 99999 outside the target's vocabulary"), \
        r.stderr


@pytest.mark.parametrize("edit, says", [
    (lambda d: d["dflash_config"].update(mask_token_id=600), "mask_token_id 600 is outside the vocabulary"),
    (lambda d: d.update(block_size=8.5), "key 'block_size' must be a positive integer, got 8.5"),
    (lambda d: d["dflash_config"].update(target_layer_ids="1,2"), "key 'dflash_config.target_layer_ids' must list"),
    (lambda d: d["dflash_config"].update(mask_token_id="1"), "key 'dflash_config.mask_token_id' must be an integer"),
    (lambda d: d.pop("hidden_size"), "missing ['hidden_size']"),
    (lambda d: d["dflash_config"].update(block_size=4), "block_size 8 and dflash_config.block_size 4 disagree"),
    (lambda d: d.update(rms_norm_eps=True), "key 'rms_norm_eps' must be a positive number, got True"),
])
def test_a_damaged_export_config_is_one_line_naming_the_file(tiny_dense, tmp_path, edit, says):
    """An export's config.json edited by hand (or written by another program): `eval` and anything
    that loads the drafter name the file and the key instead of failing inside the model."""
    import json

    from dflash_offline.drafter.config import DrafterConfig
    from dflash_offline.drafter.export import load_exported

    d = DrafterConfig.from_target(str(tiny_dense), [1, 3], block_size=8, drafter_layers=1, mask_token_id=1).to_export_dict()
    d["architectures"] = ["DFlashDraftModel"]
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        load_exported(str(tmp_path), str(tiny_dense))
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: ") and says in str(e.value), str(e.value)


@pytest.mark.parametrize("file, edit, says", [
    ("tokenizer_config.json", lambda d: d.setdefault("added_tokens_decoder", {}).update({"x": {"content": "<q>"}}),
     "tokenizer_config.json: added_tokens_decoder key 'x' holds \"x\", not a token id"),
    ("tokenizer.json", lambda d: d.setdefault("added_tokens", []).append({"content": "<q>"}),
     "tokenizer.json: added_tokens[{n}].id holds null, not a token id"),
])
def test_damaged_tokenizer_files_are_one_line_naming_the_file_and_key(tiny_dense, tmp_path, file, edit, says):
    import json
    import shutil

    from dflash_offline.drafter.config import mask_token_from_tokenizer

    target = tmp_path / "target"
    shutil.copytree(tiny_dense, target)
    path = target / file
    d = json.loads(path.read_text()) if path.is_file() else {}
    n = len(d.get("added_tokens") or [])
    edit(d)
    path.write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        mask_token_from_tokenizer(target)
    assert str(e.value).startswith(str(path)) and says.format(n=n) in str(e.value), str(e.value)


def test_a_bad_prompt_in_a_part_folder_names_its_part_and_row(tmp_path):
    """eval --prompts with a generate/prepare output folder: the row is counted within its part
    file, which is named (the folder's parts are read as one table)."""
    import pyarrow as pa

    from dflash_offline.evaluate.inputs import read_prompts
    from dflash_offline.rows.parts import OutputStore, new_manifest, write_part

    store = OutputStore(tmp_path)
    store.init_or_check(new_manifest(target={}, settings={}, source={}, plan={"num_parts": 2}))
    for k, rows in enumerate(([[1, 2], [3]], [[4], [5, 600], [6]])):
        first = 2 * k
        table = pa.table({"id": pa.array(range(first, first + len(rows)), pa.int64()),
                          "input_ids": pa.array(rows, pa.list_(pa.int32()))})
        name, size = write_part(tmp_path, f"part-{k:06d}", table)
        store.commit_part({"name": f"part-{k:06d}", "file": name, "rows": len(rows)})
    with pytest.raises(UserError, match=rf"^--prompts {tmp_path}: part-000001.parquet: row 1 holds token id 600"):
        read_prompts(str(tmp_path), vocab_size=512)


def test_a_path_from_a_recipe_is_named_by_its_key(tiny_dense, arith_cache, tmp_path):
    """Paths too: a held-out cache a recipe names is refused naming the recipe's key and file."""
    recipe = tmp_path / "train.toml"
    missing = tmp_path / "no-eval-cache"
    recipe.write_text(f'eval_cache = "{missing}"\n')
    r = run_cli(["train", "--config", recipe, "--target", tiny_dense, "--cache", arith_cache, "--out",
                 tmp_path / "run", *TRAIN], timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: --config {recipe}: key 'eval_cache' {missing}: no cache there"), r.stderr


def _prompts_file(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [0], "input_ids": [[5, 6, 7]]}), path)
    return path


@pytest.mark.parametrize("command, key, value, says", [
    ("train", "target", "{tmp}/no-target", "{value}: no such folder"),
    ("train", "devices", "gpu0", "'gpu0': 'gpu0' is not a GPU index or 'cpu'"),
    ("train", "out", "{tmp}/a-file", "{value}: cannot write its log folder"),
    ("extract", "target", "{tmp}/no-target", "{value}: no such folder"),
    ("extract", "max_bytes", "1KB", "1.00 kB cannot hold one shard"),
    ("extract", "cache", "memory://c", "{value}: memory:// lives inside one process"),
    ("plan", "data", "{tmp}/no-data.parquet", "{value}: no such file or folder"),
    ("generate", "out", "{tmp}/foreign", "{value}: the folder exists, is not empty and holds no generate manifest"),
    ("prepare", "out", "{tmp}/a-file", "{value}: is a file; give a folder"),
    ("eval", "prompts", "{tmp}/foreign", "{value}: a folder, not a file"),
    ("eval", "drafters", "{tmp}/foreign", "{value}: neither a drafter export"),
    ("eval", "devices", "gpu0", "'gpu0': 'gpu0' is not a GPU index or 'cpu'"),
    ("eval", "implied_for", "no-such-gpu", "{value}: no measured target shape of that name"),
])
def test_values_a_recipe_gave_are_named_by_their_key_at_every_depth(tiny_dense, arith_cache, tiny_data, tmp_path,
                                                                     command, key, value, says):
    """A value read from a recipe is named by its key and file wherever it is refused: in the
    launcher, and in the readers below it (target folder, devices, cache location, output
    folders, eval's inputs), which take the name from the command's config."""
    (tmp_path / "a-file").write_text("not a folder\n")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("someone's\n")
    # (prepare says a missing --data before anything else: here the data are there)
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                          '{"role": "assistant", "content": "hello"}]}\n')
    prompts = _prompts_file(tmp_path / "prompts.parquet")
    value = value.format(tmp=tmp_path)
    given = {
        "train": {"target": tiny_dense, "cache": arith_cache, "out": tmp_path / "run"},
        "extract": {"target": tiny_dense, "data": tiny_data, "cache": tmp_path / "cache"},
        "plan": {"target": tiny_dense, "data": tiny_data},
        "generate": {"target": tiny_dense, "prompts": prompts, "out": tmp_path / "gen"},
        "prepare": {"target": tiny_dense, "data": tmp_path / "chats.jsonl", "out": tmp_path / "prep"},
        "eval": {"target": tiny_dense, "drafters": tmp_path / "no-drafter", "prompts": prompts},
    }[command]
    given.pop(key, None)
    flags = {"drafters": "--drafter"}
    args = [command, "--config", tmp_path / "recipe.toml"]
    for name, v in given.items():
        args += [flags.get(name, "--" + name.replace("_", "-")), v]
    if command == "train":
        args += TRAIN
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f"{key} = {value!r}\n".replace("'", '"'))
    r = run_cli(args, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
    want = f"error: --config {recipe}: key '{key}' " + says.format(value=value)
    assert r.stderr.startswith(want), r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
