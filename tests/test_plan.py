"""The pure parts of stage one: layer rule, plan, batches, kernel warning, URL refusal."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_offline.extract.plan import make_batches, make_plan
from dflash_offline.targets.model import check_kernels, default_layer_ids
from dflash_offline.targets.folder import read_target


@pytest.mark.parametrize("L, ids", [(36, [1, 9, 17, 25, 33]), (64, [1, 16, 31, 46, 61]), (8, [1, 2, 3, 4, 5])])
def test_dflash_layer_rule(L, ids):
    assert default_layer_ids(L, 5) == ids  # dflash-method.md's examples


def test_plan_covers_every_row_once_within_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 900, size=1000)
    shards = make_plan(lengths, max_len=512, shard_tokens=4096, sort_window=128)
    rows = np.concatenate(shards)
    assert sorted(rows.tolist()) == list(range(1000))
    tl = np.minimum(lengths, 512)
    for s in shards:
        assert tl[s].sum() <= 4096
    # Longest first within each window; shards never mix windows out of order.
    for s in shards:
        assert (np.diff(tl[s]) <= 0).all() or len({int(r) // 128 for r in s}) > 1
    # A pure function of its inputs.
    again = make_plan(lengths, max_len=512, shard_tokens=4096, sort_window=128)
    assert all((a == b).all() for a, b in zip(shards, again))


def test_single_sample_longer_than_shard_gets_its_own_shard():
    shards = make_plan(np.array([10, 5000, 10]), max_len=8192, shard_tokens=1000, sort_window=8)
    assert [s.tolist() for s in shards] == [[1], [0, 2]]


def test_batches_respect_token_budget_with_padding():
    lens = [100, 90, 80, 50, 50, 49, 10, 10, 10, 10]
    batches = make_batches(lens, 200)
    assert [b for a, b in batches][-1] == len(lens)
    for a, b in batches:
        assert max(lens[a:b]) * (b - a) <= 200
    assert batches[0] == (0, 2)


def test_hybrid_without_fla_on_cuda_warns_with_install_command(tiny_hybrid, tiny_dense):
    import importlib.util

    info = read_target(str(tiny_hybrid))
    assert info.hybrid and not read_target(str(tiny_dense)).hybrid
    assert check_kernels(info, ["cpu"]) is None  # CPU runs use the PyTorch kernels by design
    msg = check_kernels(info, ["cuda:0"])
    if importlib.util.find_spec("fla") is None:
        assert "flash-linear-attention" in msg and "pip install" in msg
    assert check_kernels(read_target(str(tiny_dense)), ["cuda:0"]) is None


def test_url_cache_with_several_workers_is_refused(tiny_dense, tiny_data, tmp_path):
    from conftest import run_cli

    r = run_cli(["extract", "--target", str(tiny_dense), "--data", str(tiny_data),
                 "--cache", f"local://{tmp_path}/c", "--devices", "cpu,cpu", "--log-dir", str(tmp_path / "logs")])
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "object stores" in r.stderr
