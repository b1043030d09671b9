"""Refusals that say what the user meant to do: a clash between a file's explicit ids and another
file's row positions, prompts given where token rows with a mask are read, a file as plan's
--cache folder, a setting prepare or generate would ignore."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from dflash_offline.runtime.errors import UserError


def test_an_id_clash_with_a_file_without_ids_says_its_ids_are_positions(tmp_path):
    from dflash_offline.rows.reader import scan

    pq.write_table(pa.table({"input_ids": [[1, 2], [3, 4]], "loss_mask": [[0, 1], [0, 1]]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [0, 5], "input_ids": [[1, 2], [3, 4]], "loss_mask": [[0, 1], [0, 1]]}),
                   tmp_path / "b.parquet")
    with pytest.raises(UserError) as e:
        scan([str(tmp_path)], 100)
    assert str(e.value) == (f"id 0 occurs twice ({tmp_path / 'a.parquet'} row 0 (no id column: its ids are row "
                            f"positions over all inputs); {tmp_path / 'b.parquet'} row 0): ids must be unique across "
                            "all input files")


def test_prompts_given_as_token_rows_point_to_generate(tmp_path):
    from dflash_offline.rows.reader import scan

    pq.write_table(pa.table({"id": [0], "input_ids": [[1, 2, 3]]}), tmp_path / "p.parquet")
    with pytest.raises(UserError, match=r"are completed by `dflash-offline generate` first\)$"):
        scan([str(tmp_path / "p.parquet")], 100)


def test_plan_refuses_a_file_as_its_cache_folder(tiny_dense, tiny_data, tmp_path):
    r = run_cli(["plan", "--target", tiny_dense, "--data", tiny_data, "--cache", tiny_data])
    assert r.returncode == 2 and r.stderr.strip() == (f"error: --cache {tiny_data}: a file, not a folder; give the "
                                                      "folder the cache would go to"), r.stderr


def test_prepare_refuses_train_turns_it_would_ignore():
    from dflash_offline.config import PrepareConfig

    with pytest.raises(UserError, match=r"^--train-turns last chooses which of the dataset's replies are trained, "
                                        r"with --responses keep; --responses regenerate writes prompts"):
        PrepareConfig(target="t", data=["d"], out="o", train_turns="last").validate()
    PrepareConfig(target="t", data=["d"], out="o", train_turns="last", responses="keep").validate()


def test_generate_refuses_a_step_padded_batches_would_ignore():
    from dflash_offline.config import GenerateConfig

    with pytest.raises(UserError, match=r"^--step plain chooses continuous batching's step; --batching padded "
                                        r"decodes with its own"):
        GenerateConfig(target="t", prompts=["p"], out="o", step="plain", batching="padded").validate()
    GenerateConfig(target="t", prompts=["p"], out="o", step="plain").validate()
