"""Each benchmark script runs end to end in its tiny CPU mode (benchmarks are not tests; this only
keeps them from rotting between GPU runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run_tree

ROOT = Path(__file__).resolve().parent.parent


def _run(args, tmp_path, timeout=600):
    r = run_tree([sys.executable, *args], cwd=ROOT, timeout=timeout)  # its CLI runs and workers die with it
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_extract_throughput_smoke(tmp_path):
    out = tmp_path / "x.json"
    r = _run(["benchmarks/extract_throughput.py", "--smoke", "--cache", str(tmp_path / "cache"), "--out", str(out)],
             tmp_path)
    res = json.loads(out.read_text())
    variants = res["shapes"]["tiny-hybrid"]["batches"]["2x64"]
    assert {"bare", "extract-k32", "copy-k32", "ragged-k32"} <= set(variants)
    assert variants["ragged-k32"]["padding_fraction"] > 0
    assert "| extract-k32 |" in r.stdout


def test_reader_throughput_smoke(tmp_path):
    out = tmp_path / "r.json"
    _run(["benchmarks/reader_throughput.py", "--smoke", "--storage", str(tmp_path / "s"), "--out", str(out)], tmp_path)
    res = json.loads(out.read_text())
    (st,) = res["storage"].values()
    assert st["rows"]["rows"] > 0 and st["direct_samples_GB_per_s"] > 0
    assert set(res["scaling"]) == {"1x", "1x-zarr", "10x", "10x-zarr"}


def test_train_throughput_smoke(tmp_path):
    out = tmp_path / "t.json"
    _run(["benchmarks/train_throughput.py", "--tiny", "--workdir", str(tmp_path / "w"), "--steps", "5", "--rows", "8",
          "--seq-len", "256", "--num-anchors", "16", "--loader-workers", "1", "--out", str(out)], tmp_path)
    res = json.loads(out.read_text())
    assert res["steps"] == 5 and res["attention_pairs_per_row"] > 0


@pytest.mark.parametrize("kind,method", [("qwen3", "dflash"), ("qwen3_5", "dflash"), ("qwen3", "dspark")])
def test_decode_speed_smoke(tmp_path, kind, method):
    out = tmp_path / "d.json"
    _run(["benchmarks/decode_speed.py", "--tiny", "--tiny-kind", kind, "--tiny-method", method, "--out", str(out)],
         tmp_path)
    res = json.loads(out.read_text())["pycode"]
    (d,) = res["drafters"]
    # fp32: speculative decoding gives the target alone's tokens, one at a time and batched
    assert d["batch1"]["equal_to_alone"] == res["batch1_prompts"] and d["batched"]["equal_to_alone"] == res["prompts"]
    assert set(res["batched_alone"]) == {"static", "generate", "generate_continuous", "transformers_kv"}
    assert d["batch1"]["tau"] >= 1 and d["batched"]["speedup_vs_fastest_alone"] > 0


def test_content_check_smoke(tmp_path):
    """benchmarks/content_check.py on a few of the pycode fixture's rows: both phases run and the
    ratio is reported."""
    import pyarrow.parquet as pq

    fx = ROOT.parent / "shared" / "fixtures" / "pycode"
    if not (fx / "target" / "config.json").is_file():
        pytest.skip("needs ../shared/fixtures/pycode")
    rows = tmp_path / "rows.parquet"
    pq.write_table(pq.read_table(fx / "completions-train.parquet").slice(0, 6), rows)
    r = run_tree([sys.executable, str(ROOT / "benchmarks" / "content_check.py"), "--fixture", str(fx), "--data", str(rows),
                  "--work", str(tmp_path / "w"), "--share", "50%", "--json", str(tmp_path / "r.json")], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["samples"] == 6 and res["extract_s"] > 0 and res["verify_content_s"] > 0
    assert res["verify_line"].startswith("content: 3 of 6 samples") and "verify --content 50%" in r.stdout
