"""Null elements inside list columns of the input, damaged target
and drafter files, a failed first extract that must not bind its cache, a damaged metrics.jsonl
tail under `status`, a file given where a folder is expected (and the reverse), and a checkpoint
write that finds no room. Each case runs the real command and checks the one line, the exit code,
no traceback, and that nothing committed changed."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SMALL_OPTS, STRAIGHT, TRAIN, extract_args, run_cli, run_tree, tree_digest
from test_stale_env_and_damaged_checkpoints import _one_line  # the command's stderr is one line, its exit code, no traceback


def _only_logs(folder: Path) -> None:
    """A refused first run leaves its location with nothing but its log folder (or nothing)."""
    assert not folder.exists() or sorted(os.listdir(folder)) == ["logs"], sorted(os.listdir(folder))


# ----------------------------------------------------------------------------------------------
# Null elements inside input_ids / loss_mask


def _with_null(src: Path, dst: Path, column: str, row: int, pos: int) -> Path:
    t = pq.read_table(src)
    values = t.column(column).to_pylist()
    values[row][pos] = None
    cols = {name: t.column(name) for name in t.column_names}
    cols[column] = pa.array(values, t.schema.field(column).type)
    pq.write_table(pa.table(cols), dst)
    return dst


@pytest.mark.parametrize("column", ["input_ids", "loss_mask"])
def test_null_element_in_a_list_column_is_refused(tiny_dense, tiny_data, tmp_path, column):
    """[1, None, 3]: one was committed as token 0 (a mask value), the other crashed a worker."""
    data = _with_null(tiny_data, tmp_path / "nulls.parquet", column, 17, 2)
    cache = tmp_path / "cache"
    r = run_cli(extract_args(tiny_dense, data, cache))
    line = _one_line(r, 2, f"error: {data}: row 17 of column {column} holds a null element (position 2)")
    assert "fix or drop that row" in line
    _only_logs(cache)
    if column == "input_ids":  # the prompts of generate are read by the same scan
        out = tmp_path / "gen"
        r = run_cli(["generate", "--target", tiny_dense, "--prompts", data, "--out", out, "--max-new-tokens", "4",
                     "--no-progress"])
        _one_line(r, 2, f"error: {data}: row 17 of column input_ids holds a null element (position 2)")
        _only_logs(out)


# ----------------------------------------------------------------------------------------------
# Damaged target files


def _cut(path: Path, keep=lambda n: n // 2) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])


DAMAGE = {
    "weights-cut": ("model.safetensors", lambda p: _cut(p), "cut short ("),
    "weights-empty": ("model.safetensors", lambda p: p.write_bytes(b""), "empty (0 bytes)"),
    "weights-header-cut": ("model.safetensors", lambda p: _cut(p, lambda n: 1000), "cut short (1000 bytes, less than"),
    "index-cut": ("model.safetensors.index.json",
                  lambda p: p.write_text('{"metadata": {}, "weight_map": {"lm_head.weight": "model.safe'),
                  "not valid JSON ("),
    "config-cut": ("config.json", lambda p: _cut(p), "not valid JSON ("),
    "config-empty": ("config.json", lambda p: p.write_text(""), "empty (0 bytes)"),
}


def _damaged_target(tiny_dense, tmp_path, kind: str) -> tuple[Path, str]:
    name, damage, what = DAMAGE[kind]
    target = tmp_path / "target"
    shutil.copytree(tiny_dense, target)
    damage(target / name)
    return target, f"error: {target / name}: {what}"


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_target_file_is_named_by_extract(tiny_dense, tiny_data, tmp_path, kind):
    target, start = _damaged_target(tiny_dense, tmp_path, kind)
    before = tree_digest(target)
    cache = tmp_path / "cache"
    line = _one_line(run_cli(extract_args(target, tiny_data, cache)), 2, start)
    assert "damaged or truncated" in line and "re-download it" in line, line
    assert tree_digest(target) == before
    _only_logs(cache)


def test_damaged_target_is_named_by_every_command(tiny_dense, tiny_data, arith_cache, straight_run, tmp_path):
    """generate, train and eval read the same folder: the same line, before any work."""
    target, start = _damaged_target(tiny_dense, tmp_path, "weights-cut")
    committed = tree_digest(arith_cache)
    r = run_cli(["generate", "--target", target, "--prompts", tiny_data, "--out", tmp_path / "gen", "--no-progress"])
    _one_line(r, 2, start)
    r = run_cli(["train", "--target", target, "--cache", arith_cache, "--out", tmp_path / "run", *TRAIN,
                 "--devices", "cpu"])
    _one_line(r, 2, start)
    _only_logs(tmp_path / "run")
    export = tmp_path / "export"
    shutil.copytree(straight_run("cpu") / "export", export)
    r = run_cli(["eval", "--target", target, "--drafter", export, "--cache", arith_cache, "--no-progress"])
    _one_line(r, 2, start)
    assert tree_digest(arith_cache) == committed


def test_damaged_drafter_export_is_named_by_eval(tiny_dense, arith_cache, straight_run, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(straight_run("cpu") / "export", export)
    _cut(export / "model.safetensors")
    before = tree_digest(export)
    r = run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--cache", arith_cache, "--no-progress"])
    line = _one_line(r, 2, f"error: {export}/model.safetensors: cut short (")
    assert "the drafter export is damaged: export it again" in line, line
    assert tree_digest(export) == before


# ----------------------------------------------------------------------------------------------
# A first extract that fails before its first commit binds nothing


def test_failed_first_attempt_does_not_bind_the_cache(tiny_dense, tiny_data, tmp_path):
    """The first attempt writes its manifest and fails in its worker before any shard is committed;
    the rerun with other settings (what its failure made the user fix) is accepted, and only a cache
    with committed shards refuses other settings."""
    cache = tmp_path / "cache"
    r = run_cli(extract_args(tiny_dense, tiny_data, cache), env={"DFLASH_OFFLINE_RAISE_AT": "load-target:1"})
    assert r.returncode == 1 and "injected failure at load-target" in r.stderr, r.stderr[-2000:]
    first = json.loads((cache / "manifest.json").read_text())
    assert first["shards"] == [] and first["capture"]["topk"] == 4
    r = run_cli(extract_args(tiny_dense, tiny_data, cache, "--topk", "2"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "an earlier attempt on this cache committed no shard" in r.stderr
    m = json.loads((cache / "manifest.json").read_text())
    assert m["status"] == "complete" and m["capture"]["topk"] == 2
    # Once shards are committed, other settings are refused as before (test_bad_input, test_stale_env_and_damaged_checkpoints).


def test_failed_first_generate_does_not_bind_its_output(tiny_dense, tmp_path):
    """The same for `generate`: a first attempt that failed before its first part leaves a manifest
    that a rerun with other settings replaces; its output is then that of the rerun."""
    from test_generate import GEN, make_prompts

    prompts = make_prompts(tmp_path / "prompts.parquet", rows=4)
    out = tmp_path / "gen"
    args = ["generate", "--target", tiny_dense, "--prompts", prompts, "--out", out, "--no-progress", *GEN]
    r = run_cli([*args, "--max-new-tokens", 6], env={"DFLASH_OFFLINE_RAISE_AT": "load-target:1"})
    assert r.returncode == 1 and "injected failure at load-target" in r.stderr, r.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["parts"] == []
    r = run_cli([*args, "--max-new-tokens", 5])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "an earlier attempt on this output committed no part" in r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "complete" and m["settings"]["max_new_tokens"] == 5


# ----------------------------------------------------------------------------------------------
# status with a damaged metrics.jsonl tail


@pytest.mark.parametrize("tail,what", [(b'{"step": 13, "loss": 0.4, "acc_sl', "a torn line"),
                                       (b"\0" * 4096, "zero bytes")])
def test_status_ignores_a_damaged_metrics_tail(straight_run, tmp_path, tail, what):
    out = tmp_path / "run"
    shutil.copytree(straight_run("cpu"), out)
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(tail)
    r = run_cli(["status", out])
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stderr[-2000:]
    assert "last step 12/" in r.stdout, r.stdout
    notes = [ln for ln in r.stdout.splitlines() if "metrics.jsonl" in ln]
    assert len(notes) == 1 and f"the last 1 line(s) are damaged ({what}" in notes[0], r.stdout
    st = json.loads(run_cli(["status", out, "--json"]).stdout)
    assert st["last_metrics"]["step"] == 12 and "is step 12" in st["metrics_damaged"]


# ----------------------------------------------------------------------------------------------
# A file where a folder is expected, a folder where a file is expected


KIND_CASES = [
    ("inspect", lambda f, d, c, e, t: ["inspect", f], "inspect {f}: a file, not a folder"),
    ("verify", lambda f, d, c, e, t: ["verify", f], "verify {f}: a file, not a folder"),
    ("status", lambda f, d, c, e, t: ["status", f], "status {f}: a file, not a folder"),
    ("eval-drafter", lambda f, d, c, e, t: ["eval", "--target", t, "--drafter", f, "--cache", c],
     "--drafter {f}: a file, not a folder"),
    ("eval-cache", lambda f, d, c, e, t: ["eval", "--target", t, "--drafter", e, "--cache", f],
     "--cache {f}: a file, not a folder"),
    ("eval-prompts", lambda f, d, c, e, t: ["eval", "--target", t, "--drafter", e, "--prompts", d],
     "--prompts {d}: a folder, not a file"),
    ("eval-json", lambda f, d, c, e, t: ["eval", "--target", t, "--drafter", e, "--cache", c, "--json", d],
     "--json {d}: a folder, not a file"),
    ("export-run", lambda f, d, c, e, t: ["export", "--run", f, "--to", d / "x"], "--run {f}: a file, not a folder"),
    ("export-to", lambda f, d, c, e, t: ["export", "--run", e.parent, "--to", f], "--to {f}: a file, not a folder"),
    ("train-cache", lambda f, d, c, e, t: ["train", "--target", t, "--cache", f, "--out", d / "run", *TRAIN],
     "--cache {f}: a file, not a folder"),
    ("train-out", lambda f, d, c, e, t: ["train", "--target", t, "--cache", c, "--out", f, *TRAIN],
     "--out {f}: cannot write its log folder {f}/logs (Not a directory)"),
    ("extract-cache", lambda f, d, c, e, t: ["extract", "--target", t, "--data", d, "--cache", f, *SMALL_OPTS],
     "--cache {f}: cannot write there ("),
]


@pytest.mark.parametrize("name,args,start", KIND_CASES, ids=[c[0] for c in KIND_CASES])
def test_a_file_where_a_folder_is_expected(tiny_dense, arith_cache, straight_run, tmp_path, name, args, start):
    run = tmp_path / "run"
    shutil.copytree(straight_run("cpu"), run, ignore=shutil.ignore_patterns("logs"))
    afile, adir = tmp_path / "a-file", tmp_path / "a-dir"
    afile.write_text("not a folder\n")
    adir.mkdir()
    def files():  # everything but log folders (a refused run may write its log)
        return {k: v for k, v in tree_digest(tmp_path).items() if "logs" not in Path(k).parts}

    before = files()
    r = run_cli(args(afile, adir, arith_cache, run / "export", tiny_dense) + ["--no-progress"] * name.startswith("eval"))
    _one_line(r, 2, "error: " + start.format(f=afile, d=adir))
    assert files() == before


# ----------------------------------------------------------------------------------------------
# A checkpoint write that finds no room


def _run_with_file_limit(args, limit: int) -> subprocess.CompletedProcess:
    """The CLI with RLIMIT_FSIZE: a write past `limit` bytes fails with EFBIG, as on a full device
    (Python ignores SIGXFSZ, so the write returns the error instead of killing the process)."""
    def limit_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    return run_tree([sys.executable, "-m", "dflash_offline", *map(str, args)], env=env, timeout=300,
                    preexec_fn=limit_files)


def test_checkpoint_write_without_room_keeps_the_last_checkpoint(straight_run, arith_cache, tiny_dense, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight_run("cpu"), out)
    kept = tree_digest(out / "step-12")
    assert (out / "step-12" / "drafter.safetensors").stat().st_size > 200_000  # the limit stops the checkpoint
    again = ["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN, *STRAIGHT,
             "--max-steps", "13", "--devices", "cpu"]
    r = _run_with_file_limit(again, 200_000)
    line = _one_line(r, 1, f"failed: checkpoint {out}/step-13 could not be written: a file-size limit was reached")
    assert "it needs about " in line and " are free there" in line, line
    assert f"the last complete checkpoint {out}/step-12 is intact and the same command resumes from it" in line, line
    assert not [p for p in os.listdir(out) if p.startswith(".tmp-")] and not (out / "step-13").exists()
    assert tree_digest(out / "step-12") == kept
    r = run_cli(again)  # room again: it resumes from step-12
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "step-13").is_dir()


# ----------------------------------------------------------------------------------------------
# Recipe values of the wrong type


@pytest.mark.parametrize("stage,line,expect", [
    ("train", 'lr = "fast"', "key 'lr' must be a number, got str 'fast'"),
    ("train", "epochs = 2.5", "key 'epochs' must be an integer, got float 2.5"),
    ("train", 'target = ["t"]', "key 'target' must be a string, got list ['t']"),
    ("train", "init_layers = [0, 1.5]", "key 'init_layers' must be a list of integers"),
    ("train", "progress = 1", "key 'progress' must be true or false, got int 1"),
    ("extract", "data = 5", "key 'data' must be a string or a list of strings, got int 5"),
    ("extract", "log_dir = 5", "key 'log_dir' must be a string, got int 5"),
])
def test_recipe_value_of_a_wrong_type_is_one_line_before_work(tiny_dense, arith_cache, tmp_path, stage, line, expect):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(line + "\n")
    out = tmp_path / "out"
    where = ["--out", out, "--cache", arith_cache] if stage == "train" else ["--cache", out, "--data", "x.parquet"]
    r = run_cli([stage, "--config", recipe, "--target", tiny_dense, *where, "--no-progress"])
    msg = _one_line(r, 2, "error: ")
    assert f"--config {recipe}: {expect}" in msg
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# A fresh catalogue of careless cases: each one line, exit 2, nothing changed


def test_option_syntax_errors_are_one_line(tiny_dense):
    for args, want in ((["extract", "--topk", "abc"], "Invalid value for '--topk': 'abc' is not a valid integer"),
                       (["extract", "--max-bytes", "nan"], "Invalid value for '--max-bytes'"),
                       (["train", "--epochs", "x"], "Invalid value for '--epochs'"),
                       (["inspect", str(tiny_dense), "--max-tokens", "0"], "Invalid value for '--max-tokens'"),
                       (["extrac"], "No such command 'extrac'")):
        msg = _one_line(run_cli(args), 2, "error: ")
        assert want in msg and "--help)" in msg, msg


def test_layer_rules_never_repeat_a_layer(tiny_dense, tiny_data, tmp_path):
    cache = tmp_path / "cache"
    msg = _one_line(run_cli(extract_args(tiny_dense, tiny_data, cache, "--capture-count", "99")), 2, "error: ")
    assert "--capture-count 99: the DFlash rule" in msg and "at most 5 here" in msg
    msg = _one_line(run_cli(extract_args(tiny_dense, tiny_data, cache, "--capture-layers", "1,1,2")), 2, "error: ")
    assert "lists a layer twice" in msg
    assert not (cache / "manifest.json").exists()


def test_impossible_sizes_are_refused_before_work(tiny_dense, tiny_data, arith_cache, tmp_path):
    msg = _one_line(run_cli(extract_args(tiny_dense, tiny_data, tmp_path / "c", "--max-len", str(10 ** 20))), 2, "error: ")
    assert "--max-len" in msg and "too large" in msg
    out = tmp_path / "run"
    msg = _one_line(run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, "--devices", "cpu",
                             *TRAIN, "--num-anchors", "100000"]), 2, "error: ")
    assert "--num-anchors 100000 exceeds --seq-len 256" in msg
    msg = _one_line(run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, "--devices", "cpu",
                             *TRAIN, "--seq-len", str(10 ** 12), "--global-batch-tokens", str(10 ** 12)]), 2, "error: ")
    assert f"--seq-len {10 ** 12}: one row of hidden states needs" in msg and "lower --seq-len" in msg
    assert not (out / "metrics.jsonl").exists()


def test_eval_json_never_replaces_a_file_it_did_not_write(tiny_dense, arith_cache, straight_run, tmp_path):
    export = straight_run("cpu") / "export"
    foreign = tmp_path / "config.json"
    foreign.write_text('{"model_type": "qwen3"}\n')
    base = ["eval", "--target", tiny_dense, "--drafter", export, "--cache", arith_cache, "--max-samples", "2",
            "--no-progress", "--json"]
    msg = _one_line(run_cli([*base, foreign]), 2, "error: ")
    assert "the file exists and is not an eval report" in msg
    assert foreign.read_text() == '{"model_type": "qwen3"}\n'
    msg = _one_line(run_cli([*base, tmp_path / "no" / "such" / "e.json"]), 2, "error: ")
    assert "does not exist; create it" in msg
    mine = tmp_path / "e.json"
    for _ in range(2):  # a report of ours is replaced by the next one
        r = run_cli([*base, mine])
        assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(mine.read_text())["format"] == "dflash-offline/eval-report"


def test_unwritable_export_destination_is_one_line(straight_run):
    msg = _one_line(run_cli(["export", "--run", straight_run("cpu"), "--to", "/proc/dflash-export"]), 2, "error: ")
    assert "cannot create a file in /proc" in msg


def test_train_out_with_someone_elses_metrics_file_is_refused(tiny_dense, arith_cache, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.9}\n')
    msg = _one_line(run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, "--devices", "cpu",
                             *TRAIN]), 2, "error: ")
    assert "its metrics.jsonl was not written by `train`" in msg
    assert sorted(os.listdir(out)) == ["metrics.jsonl"] and "epoch" in (out / "metrics.jsonl").read_text()


def test_eval_refuses_zero_prompts_and_another_targets_cache(tiny_dense, arith_cache, straight_run, tmp_path):
    from dflash_offline.tiny import make_tiny_target

    export = straight_run("cpu") / "export"
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([], pa.list_(pa.int32()))}), empty)
    msg = _one_line(run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--prompts", empty, "--no-progress"]),
                    2, "error: ")
    assert "holds no rows" in msg
    # A target of the same shapes with other weights: arith_cache (tiny_dense's) is another target's
    # cache for it (no extract of its own needed).
    other = make_tiny_target(tmp_path / "other", seed=5)
    msg = _one_line(run_cli(["eval", "--target", other, "--drafter", export, "--cache", arith_cache, "--no-progress"]),
                    2, "error: ")
    assert "was extracted from another target than --target" in msg and str(other) in msg, msg


def test_training_on_all_zero_loss_masks_is_refused(tiny_dense, tmp_path):
    """extract refuses input with nothing to train on, and a --max-len whose cut leaves nothing to
    train on, before any work (train refuses such a cache too, for one made elsewhere)."""
    from dflash_offline.tiny import make_tiny_data

    data = make_tiny_data(tmp_path / "d.parquet", rows=8, min_len=40, max_len=80)
    t = pq.read_table(data)
    zero = pa.array([[0] * len(m) for m in t.column("loss_mask").to_pylist()], t.schema.field("loss_mask").type)
    pq.write_table(t.set_column(t.column_names.index("loss_mask"), "loss_mask", zero), data)
    msg = _one_line(run_cli(extract_args(tiny_dense, data, tmp_path / "refused")), 2, "error: ")
    assert msg.startswith(f"error: --data {data}: no row has a token to train on"), msg
    assert not (tmp_path / "refused" / "manifest.json").exists()
    last = pa.array([[0] * (len(m) - 1) + [1] for m in t.column("loss_mask").to_pylist()], t.schema.field("loss_mask").type)
    pq.write_table(t.set_column(t.column_names.index("loss_mask"), "loss_mask", last), data)
    first = min(len(m) - 1 for m in t.column("loss_mask").to_pylist())
    cache = tmp_path / "cache"
    msg = _one_line(run_cli(extract_args(tiny_dense, data, cache, "--max-len", "32")), 2, "error: ")
    assert msg == (f"error: --max-len 32 cuts every row's completion away (the earliest starts at position {first}): "
                   "nothing would be left to train on; raise --max-len past the prompts"), msg
    assert not (cache / "manifest.json").exists()
    # A cache with nothing to train on that extract did not make (written here with the project's
    # writer, for this target): train refuses it before any work.
    import numpy as np

    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, new_manifest
    from dflash_offline.cache.shards import publish_shard, tmp_shard_rel
    from dflash_offline.cache.writer import ShardLayout, ShardWriter
    from dflash_offline.targets.folder import read_target

    info = read_target(str(tiny_dense))
    zero = tmp_path / "zero-cache"
    loc = Location(str(zero))
    store = ManifestStore(loc)
    store.init_or_check(new_manifest(
        target=info.manifest_entry(), capture={"layer_ids": [1, 2], "topk": 0, "hidden_dtype": "bfloat16", "max_len": 64},
        source={"files": [], "rows": 4}, plan={"shard_tokens": 0, "sort_window": 0, "num_shards": 1}))
    loc.makedirs("shards")
    w = ShardWriter(loc, tmp_shard_rel("shard-000000"), ShardLayout(tokens=4 * 40, cache_layers=2,
                                                                     hidden_size=info.hidden_size, topk=0,
                                                                     chunk_tokens=64, layer_ids=[1, 2]))
    rng = np.random.default_rng(0)
    for sid in range(4):
        w.append(sid, rng.integers(2, 500, 40).astype(np.int32), np.zeros(40, np.uint8),
                 rng.integers(0, 2 ** 14, (40, 2, info.hidden_size)).astype(np.uint16), None, None)
    publish_shard(store, w.close("shard-000000"))
    out = tmp_path / "run"
    msg = _one_line(run_cli(["train", "--target", tiny_dense, "--cache", zero, "--out", out, "--devices", "cpu", *TRAIN]),
                    2, "error: ")
    assert "every loss_mask value is 0" in msg, msg
    assert not (out / "export").exists()


def test_targets_transformers_cannot_build_as_a_decoder_are_one_line(tiny_dense, tiny_data, tmp_path):
    for model_type, want in (("flarp9", "cannot build it as a causal language model"),):
        t = tmp_path / model_type
        shutil.copytree(tiny_dense, t)
        cfg = json.loads((t / "config.json").read_text())
        cfg["model_type"] = model_type
        (t / "config.json").write_text(json.dumps(cfg))
        msg = _one_line(run_cli(extract_args(t, tiny_data, tmp_path / f"c-{model_type}")), 2, "error: ")
        assert want in msg, msg


def test_binary_recipe_is_one_line(tiny_dense, tiny_data, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_bytes(b"\xff\xfe\x00binary")
    msg = _one_line(run_cli(["extract", "--config", recipe, "--target", tiny_dense, "--data", tiny_data, "--cache",
                             tmp_path / "c"]), 2, "error: ")
    assert "not a text file" in msg


def test_status_names_committed_shards_missing_on_storage(valid_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(valid_cache, cache)
    gone = sorted((cache / "shards").iterdir())[0]
    shutil.rmtree(gone)
    r = run_cli(["status", cache])
    assert "Traceback" not in r.stderr
    assert f"DAMAGED: 1 committed shard(s) missing on storage: {gone.name[:-5]}" in r.stdout, r.stdout


def test_eval_refuses_prompts_that_would_decode_past_the_context(tiny_dense, straight_run, tmp_path):
    from test_generate import make_prompts

    prompts = make_prompts(tmp_path / "p.parquet", rows=3)
    limit = json.loads((Path(tiny_dense) / "config.json").read_text())["max_position_embeddings"]
    msg = _one_line(run_cli(["eval", "--target", tiny_dense, "--drafter", straight_run("cpu") / "export", "--prompts",
                             prompts, "--max-new-tokens", str(limit), "--no-progress"]), 2, "error: ")
    assert f"exceeds the target's context ({limit} positions)" in msg


def test_cache_folder_with_someone_elses_shards_folder_is_refused(tiny_dense, tiny_data, tmp_path):
    cache = tmp_path / "cache"
    (cache / "shards").mkdir(parents=True)
    (cache / "shards" / "README.txt").write_text("mine\n")
    msg = _one_line(run_cli(extract_args(tiny_dense, tiny_data, cache)), 2, "error: ")
    assert "is not a cache" in msg and "README.txt" in msg
    assert sorted(os.listdir(cache / "shards")) == ["README.txt"] and not (cache / "manifest.json").exists()


@pytest.mark.parametrize("key, value, expect", [
    ("vocab_size", "many", 'vocab_size is "many", not a positive integer'),
    ("hidden_size", 0, "hidden_size is 0, not a positive integer"),
    ("num_hidden_layers", 400, "transformers"),  # 400 layers but layer_types lists 4: its own check refuses
], ids=["vocab-text", "hidden-zero", "layers-vs-layer-types"])
def test_damaged_target_config_values_are_one_line(tiny_hybrid, tiny_data, tmp_path, key, value, expect):
    t = tmp_path / "target"
    shutil.copytree(tiny_hybrid, t)
    cfg = json.loads((t / "config.json").read_text())
    (cfg.get("text_config") or cfg)[key] = value
    (t / "config.json").write_text(json.dumps(cfg))
    msg = _one_line(run_cli(extract_args(t, tiny_data, tmp_path / "cache", "--capture-layers", "1,2")), 2, "error: ")
    assert str(t / "config.json") in msg and expect in msg, msg
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_status_names_a_damaged_checkpoint(straight_run, tmp_path):
    """A checkpoint whose state.json was cut: status says so, with the fix, before resume or export
    refuse it; the run folder is only read."""
    run = tmp_path / "run"
    shutil.copytree(straight_run("cpu"), run)
    steps = sorted(int(p.name[5:]) for p in run.glob("step-*"))
    state = run / f"step-{steps[-1]}" / "state.json"
    state.write_text(state.read_text()[:12])
    before = tree_digest(run)
    r = run_cli(["status", run])
    assert r.returncode == 0, r.stderr
    assert f"DAMAGED: {state}: not valid JSON" in r.stdout and "the checkpoint is damaged: delete" in r.stdout, r.stdout
    st = json.loads(run_cli(["status", run, "--json"]).stdout)
    assert "DAMAGED checkpoint(s): step-" in st["verdict"] and len(st["damaged_checkpoints"]) == 1, st
    assert tree_digest(run) == before
