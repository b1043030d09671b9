"""eval's and export's inputs as users damage them: a part folder (generate's output) with a part
file that is garbage, missing or of ids past int64, given as --prompts or --reference (by flag or by
recipe key); a reference with a token outside the target's vocabulary or a row with no completion;
a checkpoint that lost its weights; an export whose config.json is not an object; export --run of a
folder that does not exist. Each is one line naming the option, the file (and part, row) and the
fix, exit 2, no traceback; and nothing is decoded first."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from dflash_offline.runtime.errors import UserError

MAX_NEW = "4"
DAMAGED = "the folder is damaged: restore the part from a copy, or run `dflash-offline generate` again into a new --out"
REF_FIX = "give the target's greedy completions of these prompts (--prompts; dflash-offline generate)"


def _one_line(r, code: int = 2) -> str:
    """The command's whole stderr is one line, exit `code`, no traceback: that line."""
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def export(tiny_dense, tmp_path_factory) -> Path:
    """A drafter export of tiny_dense's shape (random weights: these tests never get to decode
    except the one that checks a reference folder is read, which needs no accuracy)."""
    from dflash_offline.drafter.config import DrafterConfig
    from dflash_offline.drafter.export import export_drafter
    from dflash_offline.drafter.model import DFlashDrafter

    cfg = DrafterConfig.from_target(str(tiny_dense), [1, 3], block_size=8, drafter_layers=1, mask_token_id=1)
    return export_drafter(DFlashDrafter(cfg), str(tmp_path_factory.mktemp("drafter") / "export"))


@pytest.fixture(scope="module")
def generated(tiny_dense, tmp_path_factory) -> tuple[Path, Path]:
    """(prompts file, generate output folder of their greedy completions in two part files)."""
    root = tmp_path_factory.mktemp("generated")
    prompts = root / "prompts.parquet"
    rows = [[5 + k, 40 + 3 * k, 7, 90 + k, 11] for k in range(4)]
    pq.write_table(pa.table({"id": pa.array(range(4), pa.int64()), "input_ids": pa.array(rows, pa.list_(pa.int32()))}),
                   prompts)
    out = root / "gen"
    r = run_cli(["generate", "--target", tiny_dense, "--prompts", prompts, "--out", out, "--max-new-tokens", MAX_NEW,
                 "--chunk-prompts", "2", "--ignore-eos", "--no-progress"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.parquet")) == ["part-00000.parquet", "part-00001.parquet"]
    return prompts, out


def _eval(tiny_dense, export, *args) -> list:
    return ["eval", "--target", tiny_dense, "--drafter", export, "--max-new-tokens", MAX_NEW, "--ignore-eos",
            "--no-progress", *args]


def _rewrite(part: Path, column: str, values, type_=None) -> None:
    t = pq.read_table(part)
    t = t.set_column(t.column_names.index(column), column, pa.array(values, type_ or t.schema.field(column).type))
    pq.write_table(t, part)


def _copied(gen: Path, tmp_path: Path) -> Path:
    """A copy of the generate output to damage (the session's fixture stays whole)."""
    return Path(shutil.copytree(gen, tmp_path / "gen"))


def _damage(folder: Path, how: str) -> tuple[Path, str]:
    """One of the folder's parts damaged `how`: (the part, what the line says after its name)."""
    part = folder / "part-00001.parquet"
    if how == "garbage":
        part.write_text("garbage\n")
        return part, "not a readable Parquet file (ArrowInvalid: "
    if how == "deleted":
        part.unlink()
        return part, f"no such file, though {folder}/manifest.json lists it; {DAMAGED}"
    n = pq.read_metadata(part).num_rows
    _rewrite(part, "id", [2 ** 63 + k for k in range(n)], pa.uint64())
    return part, (f"row 0: id {2 ** 63} (the column is uint64) is above the largest id the contract allows, "
                  f"2^63 - 1 = {2 ** 63 - 1} (ids are int64); renumber the ids")


# ----------------------------------------------------------------------------------------------
# 1. A part folder with one damaged part, as --prompts or --reference, by flag or recipe key


def test_a_reference_folder_is_read(tiny_dense, export, generated):
    """A generate output folder is a --reference as its merged file would be: the outputs are
    checked against it, no target-alone decode."""
    prompts, gen = generated
    r = run_cli(_eval(tiny_dense, export, "--prompts", prompts, "--reference", gen))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "lossless (against" in r.stdout and " yes" in r.stdout.splitlines()[-2], r.stdout


@pytest.mark.parametrize("how", ["garbage", "deleted", "uint64"])
@pytest.mark.parametrize("option", ["prompts", "reference"])
def test_a_damaged_part_is_named_by_its_option_and_file(tiny_dense, export, generated, tmp_path, how, option):
    prompts, gen = generated
    folder = _copied(gen, tmp_path)
    part, says = _damage(folder, how)
    args = ["--prompts", folder] if option == "prompts" else ["--prompts", prompts, "--reference", folder]
    line = _one_line(run_cli(_eval(tiny_dense, export, *args)))
    start = f"error: --{option} {folder}: {part.name}: {says}"
    if how == "garbage":  # pyarrow's own words in between
        assert line.startswith(start) and line.endswith(f"); {DAMAGED}"), line
    else:
        assert line == start, line


@pytest.mark.parametrize("how", ["garbage", "uint64"])
@pytest.mark.parametrize("option", ["prompts", "reference"])
def test_a_damaged_part_from_a_recipe_is_named_by_its_key(tiny_dense, export, generated, tmp_path, how, option):
    prompts, gen = generated
    folder = _copied(gen, tmp_path)
    part, says = _damage(folder, how)
    recipe = tmp_path / "eval.toml"
    recipe.write_text(f'prompts = "{folder}"\n' if option == "prompts"
                      else f'prompts = "{prompts}"\nreference = "{folder}"\n')
    line = _one_line(run_cli(_eval(tiny_dense, export, "--config", recipe)))
    assert line.startswith(f"error: --config {recipe}: key '{option}' {folder}: {part.name}: {says}"), line


def test_parts_of_other_id_types_are_read_as_one(tmp_path):
    """A part of uint64 ids (all below 2^63) beside parts of int64 ids: one table of int64 ids,
    not pyarrow's multi-line 'Schema at index 1 was different'."""
    from dflash_offline.evaluate.inputs import read_prompts

    folder = _part_folder(tmp_path, [({"id": pa.array([0, 1], pa.int64())}, [[1, 2], [3]]),
                                     ({"id": pa.array([2, 3], pa.uint64())}, [[4], [5, 6]])])
    assert read_prompts(str(folder), 512) == ([0, 1, 2, 3], [[1, 2], [3], [4], [5, 6]])


def test_a_part_without_the_ids_the_others_have_is_named(tmp_path):
    from dflash_offline.evaluate.inputs import read_prompts

    folder = _part_folder(tmp_path, [({"id": pa.array([0, 1], pa.int64())}, [[1, 2], [3]]), ({}, [[4], [5, 6]])])
    with pytest.raises(UserError) as e:
        read_prompts(str(folder), 512)
    assert str(e.value) == (f"--prompts {folder}: part-000001.parquet has no id column, part-000000.parquet has an "
                            "id column; give every part its ids, or none")


def test_a_part_of_string_ids_is_named(tmp_path):
    from dflash_offline.evaluate.inputs import read_prompts

    folder = _part_folder(tmp_path, [({"id": pa.array([0, 1], pa.int64())}, [[1, 2], [3]]),
                                     ({"id": pa.array(["a", "b"])}, [[4], [5, 6]])])
    with pytest.raises(UserError) as e:
        read_prompts(str(folder), 512)
    assert str(e.value) == f"--prompts {folder}: part-000001.parquet: column 'id' must be an integer, found string"


def _part_folder(folder: Path, parts) -> Path:
    """A complete generate-format folder of `parts` ((extra columns, input_ids rows) each), made by
    the writer generate uses."""
    from dflash_offline.rows.parts import OutputStore, new_manifest, write_part

    store = OutputStore(folder)
    store.init_or_check(new_manifest(target={}, settings={}, source={}, plan={"num_parts": len(parts)}))
    for k, (cols, rows) in enumerate(parts):
        table = pa.table({**cols, "input_ids": pa.array(rows, pa.list_(pa.int32()))})
        name, _ = write_part(folder, f"part-{k:06d}", table)
        store.commit_part({"name": f"part-{k:06d}", "file": name, "rows": len(rows)})
    return folder


# ----------------------------------------------------------------------------------------------
# 2, 3. A reference token outside the vocabulary; a reference row without a completion


def test_a_reference_token_outside_the_vocabulary_is_refused_before_decoding(tiny_dense, export, generated, tmp_path):
    """Was decoded, then reported as the drafter not being lossless (exit 1)."""
    prompts, gen = generated
    ref = tmp_path / "ref.parquet"
    table = pa.concat_tables([pq.read_table(p) for p in sorted(gen.glob("part-*.parquet"))])
    pq.write_table(table, ref)
    rows = table.column("input_ids").to_pylist()
    rows[1][len(rows[1]) - 2] = 99999  # id 1, the completion's third token
    _rewrite(ref, "input_ids", rows)
    line = _one_line(run_cli(_eval(tiny_dense, export, "--prompts", prompts, "--reference", ref)))
    assert line == (f"error: --reference {ref}: id 1: its completion holds token id 99999 (position 2), outside the "
                    f"target's vocabulary (0..511); {REF_FIX}"), line


def test_a_reference_row_without_a_completion_says_so(tiny_dense, export, generated, tmp_path):
    """A loss_mask of only 0s: the row has no completion (was 'its prompt (9 tokens) differs from
    the --prompts row (5 tokens) from token 5 on')."""
    prompts, gen = generated
    folder = _copied(gen, tmp_path)
    part = folder / "part-00001.parquet"
    masks = pq.read_table(part).column("loss_mask").to_pylist()
    masks[1] = [0] * len(masks[1])  # id 3
    _rewrite(part, "loss_mask", masks)
    line = _one_line(run_cli(_eval(tiny_dense, export, "--prompts", prompts, "--reference", folder)))
    assert line == (f"error: --reference {folder}: part-00001.parquet: id 3: the row has no completion (its "
                    f"loss_mask holds no 1: all {len(masks[1])} tokens are prompt); {REF_FIX}"), line


# ----------------------------------------------------------------------------------------------
# 4. A checkpoint that lost its weights


@pytest.fixture
def run_folder(tiny_dense, tmp_path) -> Path:
    """A training run folder with checkpoints step-2 and step-4, written by train's own writer."""
    import torch

    from dflash_offline.drafter.config import DrafterConfig
    from dflash_offline.drafter.model import DFlashDrafter
    from dflash_offline.runs.checkpoint import CheckpointState, save_checkpoint

    cfg = DrafterConfig.from_target(str(tiny_dense), [1, 3], block_size=8, drafter_layers=1, mask_token_id=1)
    drafter = DFlashDrafter(cfg)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = tmp_path / "run"
    out.mkdir()
    for step in (2, 4):
        state = CheckpointState(step=step, cache_fingerprint="test", config={}, drafter=dataclasses.asdict(cfg))
        save_checkpoint(out, step, drafter, opt, sched, state, keep=2)
    return out


def test_a_checkpoint_without_its_weights_is_named_by_eval_and_export(tiny_dense, export, generated, run_folder):
    from dflash_offline.evaluate.run import load_drafter

    prompts, _ = generated
    load_drafter(str(run_folder / "step-4"), str(tiny_dense))  # a checkpoint eval loads, whole
    (run_folder / "step-4" / "drafter.safetensors").unlink()
    line = _one_line(run_cli(["eval", "--target", tiny_dense, "--drafter", run_folder / "step-4", "--prompts", prompts,
                              "--no-progress"]))
    assert line == (f"error: --drafter {run_folder}/step-4: drafter.safetensors: No such file or directory; the "
                    f"checkpoint is damaged: use the checkpoint before it, {run_folder}/step-2, or restore the file "
                    "from a copy"), line
    line = _one_line(run_cli(["export", "--run", run_folder, "--to", run_folder.parent / "export"]))
    assert line == (f"error: {run_folder}/step-4/drafter.safetensors: No such file or directory; the checkpoint is "
                    "damaged: export the one before with --step 2, or restore the file from a copy"), line
    (run_folder / "step-2" / "state.json").unlink()  # and the first checkpoint has none before it
    line = _one_line(run_cli(["eval", "--target", tiny_dense, "--drafter", run_folder / "step-2", "--prompts", prompts,
                              "--no-progress"]))
    assert line == (f"error: --drafter {run_folder}/step-2: state.json: No such file or directory; the checkpoint is "
                    "damaged: use another checkpoint or an export, or restore the file from a copy"), line


# ----------------------------------------------------------------------------------------------
# 5. An export whose config.json is not an object


def test_an_export_config_that_is_a_list_is_one_line(tiny_dense, export, generated, tmp_path):
    prompts, _ = generated
    bad = tmp_path / "export"
    shutil.copytree(export, bad)
    (bad / "config.json").write_text("[1]\n")
    line = _one_line(run_cli(["eval", "--target", tiny_dense, "--drafter", bad, "--prompts", prompts, "--no-progress"]))
    assert line == (f"error: {bad}/config.json: holds a JSON list, not an object; not a DFlashDraftModel config: "
                    "export the drafter again (dflash-offline export --run RUN --to DIR)"), line


@pytest.mark.parametrize("key, value, kind", [("dflash_config", [1], "list"), ("dflash_offline", "x", "string")])
def test_an_export_config_with_a_section_that_is_not_an_object_is_one_line(export, tmp_path, key, value, kind):
    from dflash_offline.drafter.export import load_exported

    bad = tmp_path / "export"
    shutil.copytree(export, bad)
    d = json.loads((bad / "config.json").read_text())
    d[key] = value
    (bad / "config.json").write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        load_exported(str(bad))
    assert str(e.value) == (f"{bad}/config.json: key '{key}' holds a JSON {kind}, not an object; the drafter config "
                            "is damaged: export the drafter again (dflash-offline export --run RUN --to DIR)")


# ----------------------------------------------------------------------------------------------
# 6. export --run of a folder that does not exist


def test_export_of_a_run_folder_that_does_not_exist(tmp_path):
    line = _one_line(run_cli(["export", "--run", tmp_path / "no-such-run"]))
    assert line == (f"error: --run {tmp_path}/no-such-run: no such folder; give a training run folder (the --out of "
                    "train, with step-N/ checkpoints)"), line
    assert not (tmp_path / "no-such-run").exists()


# ----------------------------------------------------------------------------------------------
# 7. export --to inside a checkpoint folder; pruning leaves what train did not write


def test_export_into_a_checkpoint_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "step-5").mkdir(parents=True)
    line = _one_line(run_cli(["export", "--run", run, "--to", run / "step-5" / "mine"]))
    assert line == (f"error: --to {run}/step-5/mine: inside the checkpoint folder {run}/step-5, which train writes and "
                    f"prunes; export beside it (the default is {run}/export)"), line
    assert sorted(p.name for p in (run / "step-5").iterdir()) == []


def test_pruning_keeps_a_checkpoint_folder_that_holds_a_users_files(tmp_path, caplog):
    from dflash_offline.runs.checkpoint import CHECKPOINT_FILES, remove_checkpoint

    for step, extra in ((1, None), (2, "NOTES.md")):
        ck = tmp_path / f"step-{step}"
        ck.mkdir()
        for name in CHECKPOINT_FILES:
            (ck / name).write_bytes(b"x")
        if extra:
            (ck / extra).write_text("mine")
    with caplog.at_level("WARNING"):
        remove_checkpoint(tmp_path / "step-1")
        remove_checkpoint(tmp_path / "step-2")
    assert not (tmp_path / "step-1").exists()
    assert sorted(p.name for p in (tmp_path / "step-2").iterdir()) == sorted([*CHECKPOINT_FILES, "NOTES.md"])
    (msg,) = [r.getMessage() for r in caplog.records]
    assert f"kept {tmp_path}/step-2" in msg and "NOTES.md, which train did not write" in msg, msg


def test_a_cache_with_nothing_to_walk_leaves_no_log_folder(tiny_dense, export, tmp_path):
    """eval --cache on a cache whose completions are one token each: one line, and no log folder
    (./dflash-logs for a drafter outside a run) left behind."""
    from conftest import extract_args

    rows = [[5 + k, 40 + 3 * k, 7, 90 + k, 11, 12] for k in range(4)]
    data = tmp_path / "one-token.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32())),
                             "loss_mask": pa.array([[0] * 5 + [1]] * 4, pa.list_(pa.int8()))}), data)
    cache = tmp_path / "cache"
    assert run_cli(extract_args(tiny_dense, data, cache)).returncode == 0
    cwd = tmp_path / "here"
    cwd.mkdir()
    line = _one_line(run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--cache", cache, "--devices", "cpu",
                              "--no-progress"], cwd=cwd))
    assert "no sample with a completion of two tokens or more to walk" in line, line
    assert list(cwd.iterdir()) == []


def test_a_sampled_reference_is_refused_by_name(tiny_dense, export, generated, tmp_path):
    """A reference that generate sampled (its manifest says so) is not the target's greedy decode:
    refused in one line naming it, rather than the drafter reported as not lossless."""
    prompts, _ = generated
    sampled = tmp_path / "sampled.parquet"
    r = run_cli(["generate", "--target", tiny_dense, "--prompts", prompts, "--out", sampled, "--max-new-tokens", MAX_NEW,
                 "--temperature", "1.5", "--ignore-eos", "--no-progress"])
    assert r.returncode == 0, r.stderr[-3000:]
    for given in (sampled, tmp_path / "sampled.parquet.parts"):
        line = _one_line(run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--prompts", prompts,
                                  "--reference", given, "--max-new-tokens", MAX_NEW, "--no-progress"]))
        assert line.startswith(f"error: --reference {given} was sampled (generate --temperature 1.5, its manifest "
                               "says)"), line


def test_eval_of_an_unfinished_cache_is_refused(tiny_dense, export, valid_cache, tmp_path):
    """A cache whose extraction stopped part way (its manifest: extracting, fewer shards than
    planned): refused in one line, not an estimate over part of the data."""
    cache = tmp_path / "cache"
    shutil.copytree(valid_cache, cache)
    m = json.loads((cache / "manifest.json").read_text())
    m["status"] = "extracting"
    dropped = m["shards"].pop()
    for k in ("samples", "tokens", "bytes"):
        m["totals"][k] -= dropped[k]
    (cache / "manifest.json").write_text(json.dumps(m))
    line = _one_line(run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--cache", cache, "--no-progress"]))
    assert line == (f"error: --cache {cache}: extraction is not complete ({len(m['shards'])}/{m['plan']['num_shards']} "
                    "shards committed); run the same extract command again to finish it first"), line


@pytest.mark.parametrize("extra,says", [
    (["--prompts", "P", "--top-k", "5"], "--top-k 5 applies to sampling, but --temperature is 0 (greedy)"),
    (["--prompts", "P", "--top-p", "0.5"], "--top-p 0.5 applies to sampling, but --temperature is 0 (greedy)"),
    (["--cache", "C", "--temperature", "0.7"], "--temperature 0.7 samples the decoding of --prompts"),
], ids=["top-k-greedy", "top-p-greedy", "temperature-cache-only"])
def test_sampling_options_that_would_be_ignored_are_refused(tiny_dense, export, generated, valid_cache, extra, says):
    prompts, _ = generated
    args = [{"P": prompts, "C": valid_cache}.get(a, a) for a in extra]
    line = _one_line(run_cli(["eval", "--target", tiny_dense, "--drafter", export, *args, "--no-progress"]))
    assert says in line, line


def test_a_generate_output_whose_committed_part_is_gone_or_changed(tiny_dense, generated, tmp_path):
    """status says DAMAGED, generate does not call it complete, extract refuses it in one line; a part
    whose bytes are not the ones committed (its sha256) is refused by extract too."""
    prompts, gen = generated
    gone = _copied(gen, tmp_path)
    (gone / "part-00001.parquet").unlink()
    st = run_cli(["status", gone])
    assert st.returncode == 0 and "DAMAGED: committed part part-00001.parquet is missing" in st.stdout, st.stdout
    line = _one_line(run_cli(["generate", "--target", tiny_dense, "--prompts", prompts, "--out", gone,
                              "--max-new-tokens", MAX_NEW, "--chunk-prompts", "2", "--ignore-eos", "--no-progress"]))
    assert line == (f"error: --out {gone}: committed part part-00001.parquet is missing; the output is damaged: "
                    "restore the part from a copy, or generate into a new --out"), line
    line = _one_line(run_cli(["extract", "--target", tiny_dense, "--data", gone, "--cache", tmp_path / "c1",
                              "--devices", "cpu", "--no-progress"]))
    assert line.startswith(f"error: --data {gone}: committed part part-00001.parquet is missing; the folder is "
                           "damaged"), line
    changed = _copied(gen, tmp_path / "changed")
    m = json.loads((changed / "manifest.json").read_text())
    m["parts"][0]["sha256"] = "0" * 64  # as if the file had been replaced by one of the same size
    (changed / "manifest.json").write_text(json.dumps(m))
    line = _one_line(run_cli(["extract", "--target", tiny_dense, "--data", changed, "--cache", tmp_path / "c2",
                              "--devices", "cpu", "--no-progress"]))
    assert line.startswith(f"error: --data {changed / 'part-00000.parquet'}: not the part its folder's manifest.json "
                           "committed"), line
    assert not (tmp_path / "c1" / "manifest.json").exists() and not (tmp_path / "c2" / "manifest.json").exists()


def test_conversations_given_as_prompts_point_to_prepare(tiny_dense, export, tmp_path):
    """As extract says of its --data: a .jsonl of conversations goes through `prepare` first."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    line = _one_line(run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--prompts", chats]))
    assert line.startswith(f"error: --prompts {chats}: not a readable Parquet file (") and line.endswith(
        "conversation data (.jsonl, .json) goes through `dflash-offline prepare` first, which writes the prompts this "
        "option reads (OUT/eval)"), line
