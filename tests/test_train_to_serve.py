"""The train-to-serve check of `eval --cache --parity` (evaluate/serving_features.py): what each of
eval's decoder paths (the static decoder's layers and transformers' forward with its caches) feeds
the drafter, a prefill and then verify blocks teacher-forced, against what the cache stores, per
layer, within cache/bounds.py's bound, in fp32 and bf16, on the hybrid target; a target whose
config turns all of each head by RoPE (the cache made with the family's quarter) is named, from
its first attention layer on, for both paths."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import extract_args, run_cli
from dflash_offline.cache.bounds import feature_bound
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.evaluate.parity import check_parity
from dflash_offline.evaluate.serving_features import relative_errors
from dflash_offline.tiny import make_tiny_data

LAYERS = [1, 3, 5]


@pytest.fixture(scope="module")
def hybrid_cache(tiny_hybrid, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    data = make_tiny_data(root / "rows.parquet", rows=6, min_len=30, max_len=70, seed=6)
    r = run_cli(extract_args(tiny_hybrid, data, root / "cache", "--capture-layers", ",".join(map(str, LAYERS))))
    assert r.returncode == 0, r.stderr[-2000:]
    return root / "cache"


def drafter(target) -> DFlashDrafter:
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.from_target(str(target), LAYERS, block_size=4, drafter_layers=1, mask_token_id=1))
    d.load_frozen_from_target(str(target))
    return d.eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_decoder_paths_feed_what_the_cache_holds(dtype, tiny_hybrid, hybrid_cache):
    p = check_parity(str(tiny_hybrid), drafter(tiny_hybrid), str(hybrid_cache), 3, "cpu", dtype)
    assert set(p["feature_gap"]) == {"static", "transformers"}
    assert p["feature_bound"] == feature_bound("bfloat16", dtype)
    for path, gaps in p["feature_gap"].items():
        assert max(gaps) <= p["feature_bound"], (path, gaps)
    assert not [c for c in p["causes"] if "feeds the drafter other features" in c], p["causes"]


def test_a_cache_made_in_bf16_is_held_to_bf16s_allowance_in_an_fp32_eval(tiny_dense, tmp_path):
    """Extraction on a GPU runs bf16, eval defaults to fp32: the stored features carry bf16's forward
    rounding, which the bound allows (the coarser of the two dtypes)."""
    data = make_tiny_data(tmp_path / "rows.parquet", rows=4, min_len=30, max_len=70, seed=7)
    r = run_cli(extract_args(tiny_dense, data, tmp_path / "cache", "--capture-layers", "1,3,5", "--compute-dtype",
                             "bfloat16"))
    assert r.returncode == 0, r.stderr[-2000:]
    p = check_parity(str(tiny_dense), drafter(tiny_dense), str(tmp_path / "cache"), 2, "cpu", "float32")
    assert p["feature_bound"] == feature_bound("bfloat16", "bfloat16")
    assert not [c for c in p["causes"] if "feeds the drafter other features" in c], p["causes"]


def test_a_gap_beyond_the_bound_is_named_per_path(tiny_hybrid, hybrid_cache, tmp_path):
    wrong = tmp_path / "wrong-rope"
    shutil.copytree(tiny_hybrid, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
    (wrong / "config.json").write_text(json.dumps(cfg))
    p = check_parity(str(wrong), drafter(wrong), str(hybrid_cache), 2, "cpu", "float32")
    for path in ("static", "transformers"):
        (line,) = [c for c in p["causes"] if c.startswith(f"the {path} decoder feeds the drafter other features")]
        assert "at layers [3, 5] up to" in line, line  # layer 1 (Gated DeltaNet, before any attention) agrees
    assert p["feature_gap"]["static"][0] <= p["feature_bound"] < p["feature_gap"]["static"][1]


def test_relative_errors_take_the_worst_vector_and_call_a_nan_infinite():
    stored = np.ones((3, 2, 4), np.float32)
    got = stored.copy()
    got[1, 0] *= 1.5
    got[2, 1, 0] = np.nan
    e = relative_errors(stored, got)
    assert e[0] == pytest.approx(0.5) and e[1] == np.inf
