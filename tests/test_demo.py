"""The README's first command: the main job end to end on the embedded default (CPU)."""

from __future__ import annotations

import json

from conftest import run_cli


def test_demo_extracts_trains_and_exports(tmp_path):
    out = tmp_path / "demo"
    r = run_cli(["demo", "--out", str(out)], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "all match" in r.stdout and f"export:  {out / 'train' / 'export'}" in r.stdout
    m = json.loads((out / "cache" / "manifest.json").read_text())
    assert m["status"] == "complete"
    metrics = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]
    cfg = json.loads((out / "train" / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert (out / "train" / "export" / "model.safetensors").exists()
