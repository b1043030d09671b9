"""GPU: the trainer's compiled path (flex BlockMask from masks.block_tables,
compiled flex_attention, bf16 autocast, fused AdamW) learns and never recompiles after the first
step, over 60 steps of varying rows and anchors: DFlash's loss, and DSpark's three-term loss with
its Markov and confidence heads (p_target from the cache's top-k; eager, and compiled with
--compile-loss), exported in DeepSpec's layout."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method,compile_loss", [("dflash", False), ("dspark", False), ("dspark", True)],
                         ids=["dflash", "dspark", "dspark-compiled-loss"])
def test_compiled_training_on_cuda_no_recompiles(method, compile_loss, tiny_hybrid, tmp_path):
    from dflash_offline.tiny import make_tiny_data

    data = make_tiny_data(tmp_path / "arith.parquet", rows=160, min_len=40, max_len=120, pattern="arith", seed=3)
    cache = tmp_path / "cache"
    r = run_cli(["extract", "--target", str(tiny_hybrid), "--data", str(data), "--cache", str(cache), "--devices", "0",
                 "--topk", "0" if method == "dflash" else "8", "--max-len", "128", "--batch-tokens", "1024", "--shard-tokens", "2048", "--no-progress"])
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    r = run_cli(["train", "--target", str(tiny_hybrid), "--cache", str(cache), "--out", str(out), "--devices", "0",
                 "--seq-len", "256", "--num-anchors", "16", "--block-size", "8", "--global-batch-tokens", "512",
                 "--lr", "3e-3", "--mask-token-id", "1", "--drafter-layers", "2", "--epochs", "3", "--max-steps", "60",
                 "--loader-workers", "2", "--no-progress", "--method", method,
                 *(["--compile-loss"] if compile_loss else [])], timeout=600)
    assert r.returncode == 0, r.stderr
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 60
    print(f"gpu train: loss {m[0]['loss']:.3f} -> {m[-1]['loss']:.3f}, recompiles {m[-1]['recompiles']}, "
          f"first step {m[0]['step_time']:.2f}s, later {sum(x['step_time'] for x in m[5:]) / 55 * 1e3:.1f} ms")
    assert m[-1]["recompiles"] == m[0]["recompiles"] == 0
    assert all(x["loss"] == x["loss"] for x in m)  # finite: NaN != NaN
    assert m[-1]["loss"] < 0.8 * m[0]["loss"]
    exported = json.loads((out / "export" / "config.json").read_text())
    assert exported["architectures"] == (["Qwen3DSparkModel"] if method == "dspark" else ["DFlashDraftModel"])
