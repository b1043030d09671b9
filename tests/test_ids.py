"""Row ids are read in the file's own type: an unsigned 64-bit id above 2^63 - 1 (the contract's
ids are int64) is refused naming the row and the value the file holds, never reported as the
negative number a cast would make of it; unsigned ids within range are read as they are."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_offline.runtime.errors import UserError

BIG = (1 << 63) + 5


def _write(path, ids):
    pq.write_table(pa.table({"id": pa.array(ids, pa.uint64()), "input_ids": [[1, 2, 3]] * len(ids),
                             "loss_mask": [[0, 1, 1]] * len(ids)}), path)
    return path


@pytest.mark.parametrize("reader", ["extract", "eval"])
def test_unsigned_ids_above_int64_are_refused_as_written(reader, tmp_path):
    from dflash_offline.evaluate.inputs import read_prompts
    from dflash_offline.rows.reader import scan

    path = _write(tmp_path / "rows.parquet", [3, BIG])
    with pytest.raises(UserError) as e:
        scan([str(path)], 100) if reader == "extract" else read_prompts(str(path), 100)
    msg = str(e.value)
    assert f"row 1: id {BIG} (the column is uint64)" in msg and "2^63 - 1" in msg and str(path) in msg, msg
    assert "-" + str((1 << 64) - BIG) not in msg  # not the wrapped value
    ok = _write(tmp_path / "ok.parquet", [3, (1 << 63) - 1])
    if reader == "extract":
        assert scan([str(ok)], 100).ids.tolist() == [3, (1 << 63) - 1]
    else:
        assert read_prompts(str(ok), 100)[0] == [3, (1 << 63) - 1]


def test_extract_refuses_them_in_one_line_before_any_work(tiny_dense, tmp_path):
    from conftest import run_cli

    path = _write(tmp_path / "rows.parquet", [BIG])
    r = run_cli(["extract", "--target", tiny_dense, "--data", path, "--cache", tmp_path / "cache"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and f"id {BIG}" in r.stderr, r.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("shard*"))


def _copy_target(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_mask_token_from_the_tokenizer_is_not_reported_as_a_flag(tiny_dense, tmp_path):
    """A mask token id read from the target's tokenizer that the model's vocabulary cannot hold is
    reported as the tokenizer's, with the file and the token; a --mask-token-id the user gave is
    reported as the flag."""
    import json

    from dflash_offline.drafter.config import DrafterConfig, mask_token_from_tokenizer

    folder = _copy_target(tiny_dense, tmp_path / "t")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    mask = vocab + 88  # a tokenizer that declares a mask token the model's vocabulary cannot hold
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"mask_token": "<|MASK|>", "added_tokens_decoder": {str(mask): {"content": "<|MASK|>"}}}))
    assert mask_token_from_tokenizer(folder) == mask
    with pytest.raises(UserError) as e:
        DrafterConfig.from_target(str(folder), [1, 2])
    msg = str(e.value)
    assert "--mask-token-id" not in msg.split(";")[0] and str(folder) in msg and "tokenizer's mask token" in msg, msg
    assert f"has id {mask}" in msg and "pass --mask-token-id" in msg
    with pytest.raises(UserError, match=f"^--mask-token-id {mask + 7} outside"):
        DrafterConfig.from_target(str(folder), [1, 2], mask_token_id=mask + 7)


@pytest.mark.parametrize("value, says", [(99999, "eos_token_id [99999]: outside the target's vocabulary"),
                                         ("2", 'eos_token_id "2" is not a token id')])
def test_eos_ids_from_the_target_name_their_file(value, says, tiny_dense, tmp_path):
    """generate's end-of-sequence ids read from generation_config.json are reported with that file
    (not as --eos-token-ids, which the user did not give) and in the type the file holds them."""
    import json

    from conftest import run_cli

    folder = _copy_target(tiny_dense, tmp_path / "t")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    prompts = tmp_path / "p.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7]]}), prompts)
    r = run_cli(["generate", "--target", folder, "--prompts", prompts, "--out", tmp_path / "out", "--max-new-tokens", "8",
                 "--no-progress"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "generation_config.json" in r.stderr and says in r.stderr and "--eos-token-ids [" not in r.stderr, r.stderr
