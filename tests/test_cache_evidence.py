"""Extraction keeps the evidence (cache/evidence.py): each shard's per-layer statistics, made from
what is written, in its attributes; a degenerate layer (all zeros, one vector repeated, NaN, a copy
of another layer or of the embeddings) ends the run in one line naming the layer and the first
sample, before anything of the shard commits. The faults are injected into the batch the forward
hands over (DFLASH_OFFLINE_CORRUPT), nothing else changed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zarr

from conftest import extract_args, run_cli
from dflash_offline.cache.evidence import COLUMNS, DegenerateLayer, LayerEvidence, check_batch
from dflash_offline.cache.reader import CacheReader
from dflash_offline.tiny import make_tiny_data

LAYERS = [1, 3, 5]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_data(tmp_path_factory.mktemp("evidence") / "rows.parquet", rows=12, max_len=60, seed=3)


def extract(target, data, cache, corrupt=None):
    env = {**os.environ, **({"DFLASH_OFFLINE_CORRUPT": corrupt} if corrupt else {})}
    return run_cli(extract_args(target, data, cache, "--capture-layers", ",".join(map(str, LAYERS))), env=env)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_a_clean_cache_keeps_each_layers_statistics(kind, tiny_dense, tiny_hybrid, data, tmp_path):
    target = tiny_dense if kind == "qwen3" else tiny_hybrid
    r = extract(target, data, tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
    reader = CacheReader(str(tmp_path / "cache"))
    for entry in reader.manifest["shards"]:
        stats = dict(zarr.open_group(str(tmp_path / "cache" / "shards" / f"{entry['name']}.zarr"), mode="r").attrs)[
            "layer_stats"]
        assert sorted(stats, key=int) == [str(x) for x in LAYERS]
        # against the stored values (bf16 of the fp32 forward: the figures agree to bf16's rounding)
        shard = reader.shard(entry["name"])
        stored = np.concatenate([shard.sample(k).hidden for k in range(len(shard))]).astype(np.float64)  # [T, n, H]
        for c, lid in enumerate(LAYERS):
            st, x = stats[str(lid)], stored[:, c]
            assert st["vectors"] == entry["tokens"] == x.shape[0]
            assert (st["zero_vectors"], st["nonfinite_vectors"], st["equal_to_embeddings"]) == (0, 0, 0)
            assert st["mean"] == pytest.approx(x.mean(), abs=1e-4)
            assert st["std"] == pytest.approx(x.std(), rel=1e-2)
            assert st["absmax"] == pytest.approx(np.abs(x).max(), rel=2 ** -7)


@pytest.mark.parametrize("corrupt,named", [
    ("zero-layer:1", "layer 3 is all zeros ("),
    ("nan-vector:2", "layer 5 holds non-finite values (NaN or inf) in 1 of"),
    ("same-layer:0=2", "layer 1 equals layer 5 at every position ("),
    ("embed-layer:0", "layer 1 equals the token embeddings, its input ("),
])
def test_a_degenerate_layer_ends_the_run_before_its_shard_commits(corrupt, named, tiny_dense, data, tmp_path):
    cache = tmp_path / "cache"
    r = extract(tiny_dense, data, cache, corrupt)
    assert r.returncode == 1, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert named in line and "sample " in line and "shard-000000" in line, line
    assert "nothing of the shard was committed" in line and "run the same command again" not in line.lower()
    assert "Traceback" not in r.stderr
    m = json.loads((cache / "manifest.json").read_text())
    assert m["shards"] == [] and not list((cache / "shards").glob("shard-*.zarr"))


def test_check_batch_names_the_first_bad_sample_and_passes_a_clean_table():
    """The table's rules on hand-made tables: the NaN's sample is found from its vector's index."""
    n, cols = 2, len(COLUMNS) + 2
    clean = np.zeros((n, cols))
    clean[:, len(COLUMNS):] = np.eye(n) * 10  # each layer equals itself only
    samples = [(7, 4), (9, 6)]  # ids 7 and 9, 4 and 6 tokens
    check_batch(clean, [2, 4], samples, "shard-000001")
    bad = clean.copy()
    bad[1, COLUMNS.index("nonfinite_vectors")] = 1
    bad[1, COLUMNS.index("first_nonfinite")] = 5  # the sixth vector: sample 9's second
    with pytest.raises(DegenerateLayer, match="layer 4 holds non-finite values .* the first in sample 9 "):
        check_batch(bad, [2, 4], samples, "shard-000001")
    one = clean.copy()
    one[0, COLUMNS.index("same_as_first")] = 10
    with pytest.raises(DegenerateLayer, match="layer 2 is one vector repeated"):
        check_batch(one, [2, 4], samples, "shard-000001")
    check_batch(one, [2, 4], samples, "shard-000001", one_token=True)  # one token repeated: one vector is right
    ev = LayerEvidence([2, 4], hidden_size=3)
    t = clean.copy()
    t[:, 0], t[:, 1], t[:, 2] = [3.0, 6.0], [9.0, 12.0], [1.5, 2.5]
    ev.add(t, 10)
    ev.add(t, 10)
    s = ev.summary()
    assert s["2"]["mean"] == pytest.approx(6 / 60) and s["4"]["absmax"] == 2.5 and s["2"]["vectors"] == 20
    assert s["2"]["std"] == pytest.approx((18 / 60 - (6 / 60) ** 2) ** 0.5)


def test_one_token_repeated_is_not_refused(tiny_dense, tmp_path):
    """A row that is one token repeated gives one vector at every position of every layer (attention
    averages equal values): real output, not a forward that wrote nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": pa.array([0], pa.int64()), "input_ids": [[5] * 60],
                             "loss_mask": pa.array([[0] * 10 + [1] * 50], pa.list_(pa.int8()))}), rows)
    r = extract(tiny_dense, rows, tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
