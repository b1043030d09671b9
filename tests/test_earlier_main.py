"""Artifacts written by an earlier main (commit f7e7743, before the option renames) still work:
its cache reads, its checkpoint resumes bit for bit, its recipes load. How they were made:
tests/data/made-by-f7e7743/README.md."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import EARLIER, run_cli
from conftest import EARLIER_TRAIN as TRAIN


@pytest.fixture
def earlier(tmp_path) -> Path:
    """A copy: resuming writes into the run folder, and committed data never changes."""
    return Path(shutil.copytree(EARLIER, tmp_path / "earlier"))


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def test_earlier_checkpoint_resumes_to_the_uninterrupted_earlier_run(earlier):
    """The killed run's step-3 checkpoint (saved config with num_layers/layers) resumes under the
    current code and reaches the weights the earlier code reached without a break, bit for bit."""
    r = run_cli(["train", "--target", earlier / "target", "--cache", earlier / "cache", "--out", earlier / "run",
                 *TRAIN], timeout=600)
    assert r.returncode == 0, r.stderr
    assert "resum" in (r.stdout + r.stderr).lower()
    assert "warning:" not in r.stderr  # the checkpoint's earlier keys are mapped, not reported as the user's
    assert _losses(earlier / "run" / "metrics.jsonl") == _losses(earlier / "straight" / "metrics.jsonl")
    got, want = load_file(str(earlier / "run" / "step-6" / "drafter.safetensors")), \
        load_file(str(earlier / "straight" / "step-6" / "drafter.safetensors"))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_earlier_checkpoint_still_refuses_another_depth(earlier):
    r = run_cli(["train", "--target", earlier / "target", "--cache", earlier / "cache", "--out", earlier / "run",
                 *TRAIN, "--drafter-layers", "2"], timeout=600)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "drafter_layers" in r.stderr or "--drafter-layers" in r.stderr, r.stderr


def test_earlier_cache_reads(earlier):
    from dflash_offline import open_cache
    from dflash_offline.cache.view import ManifestView

    v = ManifestView.of(json.loads((earlier / "cache" / "manifest.json").read_text()))
    assert (v.layer_ids, v.num_target_layers, v.hidden_size, v.topk) == ((1, 2, 3), 4, 32, 4)
    assert v.status == "complete" and v.totals.samples == 12
    cache = open_cache(str(earlier / "cache"))
    ids = cache.sample_ids
    assert len(ids) == 12
    s = cache.sample(int(ids[0]))
    assert sorted(s.hidden) == [1, 2, 3] and s.hidden[1].shape == (len(s), 32) and len(s) > 0
    for args in (["verify", earlier / "cache"], ["status", earlier / "cache"], ["inspect", earlier / "cache"]):
        r = run_cli(args)
        assert r.returncode == 0, (args, r.stderr)


def test_earlier_recipes_load(capsys):
    """f7e7743's stages/ recipes load into the current configs and pass their checks; keys renamed
    since (layers, num_layers) reach their new fields with a warning line."""
    import tomllib

    from dflash_offline.config import ExtractConfig, GenerateConfig, PrepareConfig
    from dflash_offline.evaluate.config import EvalConfig
    from dflash_offline.options import load_recipe, merge, renamed
    from dflash_offline.train.config import TrainConfig

    kinds = {"extract": ExtractConfig, "generate": GenerateConfig, "prepare": PrepareConfig, "train": TrainConfig,
             "eval": EvalConfig}
    recipes = sorted((EARLIER / "recipes").glob("*/*.toml"))
    assert len(recipes) == 9
    for path in recipes:
        cls = kinds[path.stem]
        cfg = merge(cls, load_recipe(path, cls), {})
        cfg.validate()
        raw = tomllib.loads(path.read_text())
        for key, value in raw.items():
            name = renamed(cls).get(key, key)
            got = getattr(cfg, name)
            assert got == value or (isinstance(value, str) and got in ([value], value)) or \
                (isinstance(got, list) and list(got) == list(value)), (path, key, got, value)
        written = capsys.readouterr().err
        assert all(f"key {k!r}" in written for k in raw if k in renamed(cls)), (path, written)
