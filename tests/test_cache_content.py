"""`verify CACHE --content N --target T` (content.py): what a cache holds against a fresh forward
of its target. A clean cache passes on the dense and the hybrid tiny targets (bf16 and fp8); each
injected failure is named in one line, with nothing else changed: a layer zeroed and a NaN in one
vector (written through Zarr into a committed shard), layer ids shifted by one (the manifest's),
a target with the same config and other weights, a target config with another
partial_rotary_factor, the top-k taken from another layer (at extraction)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import zarr

from conftest import extract_args, run_cli
from dflash_offline.tiny import make_tiny_data, make_tiny_target

LAYERS = "1,3,5"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_data(tmp_path_factory.mktemp("content") / "rows.parquet", rows=16, max_len=80, seed=4)


def extract(target, data, cache, *extra, corrupt=None):
    env = {**os.environ, **({"DFLASH_OFFLINE_CORRUPT": corrupt} if corrupt else {})}
    r = run_cli(extract_args(target, data, cache, "--capture-layers", LAYERS, *extra), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return cache


def verify(cache, target, amount="50%"):
    return run_cli(["verify", cache, "--content", amount, "--target", target])


def failures(r) -> list[str]:
    return [x for x in r.stderr.strip().splitlines() if not x.startswith(("Writing", "[transformers]", "Loading"))]


@pytest.mark.parametrize("kind,dtype,compute", [("qwen3", "bfloat16", "float32"), ("qwen3", "fp8", "float32"),
                                                ("qwen3_5", "bfloat16", "float32"), ("qwen3", "bfloat16", "bfloat16"),
                                                ("qwen3_5", "fp8", "bfloat16")])
def test_a_clean_cache_passes(kind, dtype, compute, tiny_dense, tiny_hybrid, data, tmp_path):
    """Also made in bf16 (a fresh bf16 forward of other batch shapes rounds otherwise: its allowance)."""
    target = tiny_dense if kind == "qwen3" else tiny_hybrid
    cache = extract(target, data, tmp_path / "cache", "--hidden-dtype", dtype, "--compute-dtype", compute)
    r = verify(cache, target)
    assert r.returncode == 0, r.stderr[-2000:]
    assert failures(r) == []
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("content: 8 of 16 samples (") and "layer 5 within" in line and "top-k within" in line, line


@pytest.fixture(scope="module")
def clean(tiny_dense, data, tmp_path_factory):
    return extract(tiny_dense, data, tmp_path_factory.mktemp("clean") / "cache")


def copy_of(cache, tmp_path):
    out = tmp_path / "cache"
    shutil.copytree(cache, out)
    return out


def test_a_zeroed_layer_and_a_nan_are_named(clean, tiny_dense, tmp_path):
    cache = copy_of(clean, tmp_path)
    shard = zarr.open_group(str(cache / "shards" / "shard-000000.zarr"), mode="r+")
    offsets, ids = shard["sample_offsets"][:], shard["sample_ids"][:]
    a, b = int(offsets[2]), int(offsets[3])  # the third sample of the shard: layer 3 (column 1) zeroed
    h = shard["hidden"]
    h[a:b, 1, :] = 0
    h[int(offsets[5]) + 1, 2, 7] = 0x7FC0  # a bf16 NaN in one vector of the sixth sample's layer 5
    r = verify(cache, tiny_dense, "100%")
    assert r.returncode == 1
    lines = failures(r)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"layer 3: stored vectors differ from a fresh forward of the target by up to 1 (relative "
                               f"L2, sample {ids[2]};"), lines[0]
    assert lines[1].startswith(f"layer 5: stored vectors differ from a fresh forward of the target by up to inf "
                               f"(relative L2, sample {ids[5]};"), lines[1]


def test_layer_ids_shifted_by_one_are_named(tiny_dense, data, tmp_path):
    cache = extract(tiny_dense, data, tmp_path / "cache", "--capture-layers", "2,4,6")
    m = json.loads((cache / "manifest.json").read_text())
    m["capture"]["layer_ids"] = [1, 3, 5]
    (cache / "manifest.json").write_text(json.dumps(m, indent=1))
    r = verify(cache, tiny_dense)
    assert r.returncode == 1
    lines = failures(r)
    assert len(lines) == 3 and all("the cache's layer ids are off by +1" in x for x in lines), lines
    assert "they match the target's layer 4" in lines[1]


def test_other_weights_and_another_config_are_named(clean, tiny_hybrid, data, tmp_path):
    other = make_tiny_target(tmp_path / "other", kind="qwen3", seed=5)  # the same config, other weights
    r = verify(clean, other)
    lines = failures(r)
    assert r.returncode == 1 and lines[0].startswith(f"--target {other}: its weights are not the ones the cache was "
                                                     "made with"), lines
    assert len(lines) == 5 and all("no layer of the target matches them" in x for x in lines[1:4]), lines
    # a hybrid whose config turns all of each attention head by RoPE: the cache made with it, the
    # target given as it is (partial_rotary_factor 0.25)
    wrong = tmp_path / "wrong-rope"
    shutil.copytree(tiny_hybrid, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
    (wrong / "config.json").write_text(json.dumps(cfg))
    cache = extract(wrong, data, tmp_path / "made-wrong")
    r = verify(cache, tiny_hybrid)
    lines = failures(r)
    assert r.returncode == 1 and lines[0].startswith(f"--target {tiny_hybrid}: its config is not the one the cache "
                                                     "was made with"), lines
    # the Gated DeltaNet layers before the first attention layer (3) agree; from it on they do not
    failing = [x.split(":")[0] for x in lines[1:]]
    assert "layer 1" not in failing and "layer 3" in failing and "layer 5" in failing, lines


def test_top_k_from_another_layer_is_named(tiny_dense, data, tmp_path):
    cache = extract(tiny_dense, data, tmp_path / "cache", corrupt="topk-from-layer:1")
    r = verify(cache, tiny_dense)
    lines = failures(r)
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("top-k: the stored log-probabilities "
                                                                         "differ from a fresh forward's by up to"), lines


def test_refusals_say_what_to_give(clean, tiny_dense):
    for args, words in ((["--content", "5"], "--content 5: compares the cache with a fresh forward of its target"),
                        (["--target", str(tiny_dense)], "read only with --content N"),
                        (["--content", "0%", "--target", str(tiny_dense)], "--content 0%: a number of samples")):
        r = run_cli(["verify", clean, *args])
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
