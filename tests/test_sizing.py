"""`dflash-offline plan`: exact token counts and sizes, the budget verdict, FLOP counts that match
the model, and one clear line for bad input."""

from __future__ import annotations

import json

import numpy as np

from conftest import ROOT, run_cli
from dflash_offline.rows.reader import scan
from dflash_offline.extract.plan import bytes_per_token
from dflash_offline.targets.folder import read_target
from dflash_offline.sizing import decoder_matrix_params


def test_plan_sizes_and_budget(tiny_dense, tiny_data, tmp_path):
    info = read_target(str(tiny_dense))
    tokens = int(np.minimum(scan([str(tiny_data)], info.vocab_size).lengths, 64).sum())
    bf16 = tokens * bytes_per_token(5, info.hidden_size, 4, "bfloat16")
    r = run_cli(["plan", "--target", tiny_dense, "--data", tiny_data, "--cache", tmp_path / "not-yet" / "cache",
                 "--max-bytes", str(bf16 - 1), "--topk", "4", "--max-len", "64", "--json"])
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["tokens"] == tokens and p["truncated_rows"] > 0
    assert p["modes"]["bfloat16"]["bytes"] == bf16 and p["modes"]["bfloat16"]["fits"] is False
    fp8 = p["modes"]["float8_e4m3fn"]
    assert fp8["bytes"] == tokens * bytes_per_token(5, info.hidden_size, 4, "float8_e4m3fn") < bf16 and fp8["fits"]
    assert p["free_bytes"] > 0 and p["extract"]["hours"] > 0 and p["train"]["hours"] > 0
    r = run_cli(["plan", "--target", tiny_dense, "--data", tiny_data, "--topk", "4", "--max-len", "64"])
    assert r.returncode == 0 and "cache, bfloat16:" in r.stdout and "extract (estimate):" in r.stdout, r.stdout


def test_decoder_matrix_params_match_the_model(tiny_dense, tiny_hybrid):
    from transformers import AutoConfig, AutoModelForCausalLM

    for folder in (tiny_dense, tiny_hybrid):
        info = read_target(str(folder))
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder).get_text_config())
        want = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers.") and p.dim() == 2)
        assert decoder_matrix_params(info) == want


def test_plan_bad_input_is_one_line(tmp_path):
    r = run_cli(["plan", "--target", tmp_path / "nope", "--data", tmp_path])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such folder" in r.stderr, r.stderr


def test_plan_reads_an_extract_recipe(tiny_dense, tiny_data, tmp_path):
    """`plan --config` takes extract's recipe: the keys plan uses, extract's others ignored,
    any other key refused by name; command-line values win."""
    recipe = tmp_path / "extract.toml"
    recipe.write_text(f"""
target = "{tiny_dense}"
data = "{tiny_data}"
cache = "{tmp_path / 'cache'}"
devices = "cpu"
capture_layers = [1, 3, 6]
topk = 4
max_len = 64
batch_tokens = 512
shard_tokens = 1024
compute_dtype = "float32"
max_bytes = 1000
extract_gpus = 2
""")
    r = run_cli(["plan", "--config", recipe, "--json"])
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    info = read_target(str(tiny_dense))
    tokens = int(np.minimum(scan([str(tiny_data)], info.vocab_size).lengths, 64).sum())
    assert p["layer_ids"] == [1, 3, 6] and p["topk"] == 4 and p["tokens"] == tokens
    assert p["max_bytes"] == 1000 and p["extract"]["gpus"] == 2 and p["free_bytes"] > 0
    r = run_cli(["plan", "--config", recipe, "--topk", "2", "--max-len", "32", "--capture-layers", "2,4", "--json"])
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["topk"] == 2 and p["layer_ids"] == [2, 4] and p["tokens"] < tokens
    recipe.write_text(recipe.read_text() + "lr = 0.001\n")
    r = run_cli(["plan", "--config", recipe])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown key 'lr'" in r.stderr, r.stderr
    # The deployment's own recipe, its target and data replaced by the tiny ones.
    r = run_cli(["plan", "--config", ROOT / "stages" / "qwen3.6-27b" / "extract.toml", "--target", tiny_dense,
                 "--data", tiny_data, "--capture-layers", "auto", "--json"])
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["topk"] == 32 and p["layer_ids"] == [1, 2, 3, 4, 5]
