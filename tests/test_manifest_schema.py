"""The cache a real `extract` writes matches its contract: manifest.json against
manifests/cache-manifest.schema.json, totals and id ranges, checksums (and a corrupted chunk is
named), and shards opened by outside tools (plain zarr, xarray) in processes that never import
dflash_offline."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import textwrap

import jsonschema
import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import SCHEMA_PATH, TINY_DATA_ROWS

EXPECTED_DIMS = {
    "input_ids": ("int32", ["token"]),
    "loss_mask": ("uint8", ["token"]),
    "hidden": ("uint16", ["token", "layer", "channel"]),
    "topk_ids": ("int32", ["token", "rank"]),
    "topk_logprobs": ("float16", ["token", "rank"]),
    "sample_offsets": ("int64", ["sample_edge"]),
    "sample_ids": ("int64", ["sample"]),
}


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@pytest.fixture(scope="module")
def validator(schema):
    cls = jsonschema.Draft202012Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@pytest.fixture(scope="module")
def manifest(valid_cache) -> dict:
    return json.loads((valid_cache / "manifest.json").read_text())


def run_outside(script: str, *args, cwd) -> dict:
    """Run `script` in a fresh interpreter (cwd outside the repository); it prints one JSON object."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# The schema and the manifest


def test_schema_is_a_valid_2020_12_schema(schema):
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema.get("$id")
    jsonschema.Draft202012Validator.check_schema(schema)


def test_manifest_validates(validator, manifest):
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    assert manifest["status"] == "complete"
    assert "completed" in manifest
    assert len(manifest["shards"]) == manifest["plan"]["num_shards"] > 1


def test_extracting_manifest_validates(validator, manifest):
    """The manifest as first written (before any shard), made by the package's own constructor."""
    from dflash_offline.cache.manifest import new_manifest

    m = new_manifest(target=manifest["target"], capture=manifest["capture"], source=manifest["source"],
                     plan=manifest["plan"])
    assert m["status"] == "extracting"
    validator.validate(m)


def _drop(path):
    def f(m):
        *parents, last = path
        node = m
        for p in parents:
            node = node[p]
        del node[last]
    return f


def _set(path, value):
    def f(m):
        *parents, last = path
        node = m
        for p in parents:
            node = node[p]
        node[last] = value
    return f


BROKEN = {
    "wrong-format": _set(["format"], "something-else"),
    "version-2": _set(["version"], 2),
    "unknown-status": _set(["status"], "done"),
    "no-totals": _drop(["totals"]),
    "no-target-fingerprint": _drop(["target", "weights_fingerprint"]),
    "no-capture-layer-ids": _drop(["capture", "layer_ids"]),
    "negative-topk": _set(["capture", "topk"], -1),
    "layer-ids-repeated": _set(["capture", "layer_ids"], [1, 1]),
    "source-without-files": _set(["source", "files"], []),
    "file-sha-not-hex": _set(["source", "files", 0, "sha256"], "xyz"),
    "checksum-without-prefix": _set(["shards", 0, "checksum"], "0" * 64),
    "checksum-too-short": _set(["shards", 0, "checksum"], "sha256:" + "0" * 63),
    "checksum-uppercase": _set(["shards", 0, "checksum"], "sha256:" + "A" * 64),
    "sample-ids-single": _set(["shards", 0, "sample_ids"], [[1]]),
    "sample-ids-triple": _set(["shards", 0, "sample_ids"], [[1, 2, 3]]),
    "sample-ids-flat": _set(["shards", 0, "sample_ids"], [1, 2]),
    "sample-ids-float": _set(["shards", 0, "sample_ids"], [[1.5, 2]]),
    "sample-ids-empty": _set(["shards", 0, "sample_ids"], []),
    "shard-unknown-field": _set(["shards", 0, "extra"], 1),
    "shard-without-checksum": _drop(["shards", 0, "checksum"]),
    "shard-name-with-slash": _set(["shards", 0, "name"], "../x"),
    "tokens-negative": _set(["totals", "tokens"], -1),
    "created-not-a-time": _set(["created"], "yesterday"),
}


@pytest.mark.parametrize("mutate", list(BROKEN.values()), ids=list(BROKEN))
def test_schema_rejects_broken_manifest(validator, manifest, mutate):
    m = copy.deepcopy(manifest)
    mutate(m)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(m)


def test_schema_allows_top_level_extensions(validator, manifest):
    m = copy.deepcopy(manifest)
    m["notes"] = {"by": "someone"}
    validator.validate(m)


def test_totals_are_sums_over_shards(manifest):
    shards = manifest["shards"]
    for key in ("samples", "tokens", "bytes"):
        assert manifest["totals"][key] == sum(s[key] for s in shards), key
    assert manifest["totals"]["samples"] == manifest["source"]["rows"] == TINY_DATA_ROWS
    assert [s["name"] for s in shards] == sorted(s["name"] for s in shards)
    assert len({s["name"] for s in shards}) == len(shards)


def test_bytes_are_what_the_shard_folders_hold(valid_cache, manifest):
    for s in manifest["shards"]:
        folder = valid_cache / "shards" / f"{s['name']}.zarr"
        assert s["bytes"] == sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()), s["name"]


def test_sample_id_ranges_cover_exactly_the_input_ids(valid_cache, manifest, tiny_data):
    import zarr

    input_ids = pq.read_table(tiny_data, columns=["id"]).column("id").to_pylist()
    seen: list[int] = []
    for s in manifest["shards"]:
        ranges = s["sample_ids"]
        for a, b in ranges:
            assert a <= b, ranges
        # Sorted, disjoint and maximal (adjacent ranges would have been merged).
        for (a0, b0), (a1, b1) in zip(ranges, ranges[1:]):
            assert b0 + 1 < a1, ranges
        ids = [i for a, b in ranges for i in range(a, b + 1)]
        assert len(ids) == s["samples"], s["name"]
        stored = zarr.open_group(str(valid_cache / "shards" / f"{s['name']}.zarr"), mode="r")["sample_ids"][:]
        assert sorted(stored.tolist()) == ids, s["name"]
        seen.extend(ids)
    assert len(seen) == len(set(seen)), "a sample id is in two shards"
    assert sorted(seen) == sorted(input_ids)


# --------------------------------------------------------------------------------------------
# Checksums


def test_checksums_match_and_a_corrupted_chunk_is_named(valid_cache, manifest, tmp_path):
    from dflash_offline.cache.reader import CacheReader

    cache = tmp_path / "cache"
    shutil.copytree(valid_cache, cache)  # never corrupt the session's cache
    reader = CacheReader(str(cache))
    for s in manifest["shards"]:
        assert reader.shard(s["name"]).compute_checksum() == s["checksum"], s["name"]
    assert reader.verify() == []

    victim = manifest["shards"][len(manifest["shards"]) // 2]["name"]
    chunks = sorted(p for p in (cache / "shards" / f"{victim}.zarr" / "hidden" / "c").rglob("*") if p.is_file())
    assert chunks, "no hidden chunk files"
    chunk = chunks[-1]
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    chunk.write_bytes(bytes(raw))

    assert CacheReader(str(cache)).verify() == [victim]


# --------------------------------------------------------------------------------------------
# Outside tools


PLAIN_ZARR = """
    import json, sys
    import numpy as np
    import zarr

    cache = sys.argv[1]
    with open(cache + "/manifest.json") as f:
        manifest = json.load(f)
    report = {"shards": {}}
    for entry in manifest["shards"]:
        g = zarr.open_group(cache + "/shards/" + entry["name"] + ".zarr", mode="r")
        arrays = {}
        for name, a in g.arrays():
            arrays[name] = {"dtype": str(a.dtype), "shape": list(a.shape),
                            "dims": list(a.metadata.dimension_names or []), "attrs": dict(a.attrs)}
        off = g["sample_offsets"][:]
        ids = g["sample_ids"][:]
        mask = g["loss_mask"][:]
        tok = g["input_ids"][:]
        facts = {
            "attrs": dict(g.attrs), "arrays": arrays,
            "offsets_first": int(off[0]), "offsets_last": int(off[-1]),
            "offsets_increasing": bool(np.all(np.diff(off) > 0)),
            "ids": sorted(int(i) for i in ids),
            "mask_values": sorted(set(int(v) for v in np.unique(mask))),
            "token_range": [int(tok.min()), int(tok.max())],
        }
        if "topk_ids" in g:
            ti, tl = g["topk_ids"][:], g["topk_logprobs"][:].astype(np.float32)
            facts["topk_id_range"] = [int(ti.min()), int(ti.max())]
            facts["topk_lp_max"] = float(tl.max())
            facts["topk_lp_sorted"] = bool(np.all(np.diff(tl, axis=1) <= 0))
        report["shards"][entry["name"]] = facts
    report["dflash_offline_imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "dflash_offline")
    print(json.dumps(report))
"""


def test_plain_zarr_opens_shards_per_contract(valid_cache, manifest, tmp_path):
    report = run_outside(PLAIN_ZARR, valid_cache, cwd=tmp_path)
    assert report["dflash_offline_imported"] == []
    target, capture = manifest["target"], manifest["capture"]
    n, H, k, V = len(capture["layer_ids"]), target["hidden_size"], capture["topk"], target["vocab_size"]
    assert set(report["shards"]) == {s["name"] for s in manifest["shards"]}
    for entry in manifest["shards"]:
        f = report["shards"][entry["name"]]
        T, N = entry["tokens"], entry["samples"]
        assert f["attrs"]["format"] == "dflash-offline/shard"
        assert f["attrs"]["version"] == 1
        assert f["attrs"]["layer_ids"] == capture["layer_ids"]
        assert f["attrs"]["hidden_size"] == H
        assert f["attrs"]["hidden_dtype"] == "bfloat16"
        assert f["attrs"]["topk"] == k
        shapes = {"input_ids": [T], "loss_mask": [T], "hidden": [T, n, H], "topk_ids": [T, k],
                  "topk_logprobs": [T, k], "sample_offsets": [N + 1], "sample_ids": [N]}
        assert set(f["arrays"]) == set(EXPECTED_DIMS)  # bf16 storage: no hidden_scale
        for name, (dtype, dims) in EXPECTED_DIMS.items():
            a = f["arrays"][name]
            assert (a["dtype"], a["dims"], a["shape"]) == (dtype, dims, shapes[name]), name
        assert f["arrays"]["hidden"]["attrs"]["dtype"] == "bfloat16"
        assert f["offsets_first"] == 0 and f["offsets_last"] == T and f["offsets_increasing"]
        assert f["ids"] == [i for a, b in entry["sample_ids"] for i in range(a, b + 1)]
        assert set(f["mask_values"]) <= {0, 1} and 1 in f["mask_values"]
        assert 0 <= f["token_range"][0] and f["token_range"][1] < V
        assert 0 <= f["topk_id_range"][0] and f["topk_id_range"][1] < V
        assert f["topk_lp_max"] <= 0.0 and f["topk_lp_sorted"]


XARRAY = """
    import json, sys
    import numpy as np
    import xarray as xr

    shard, out = sys.argv[1], sys.argv[2]
    ds = xr.open_zarr(shard, consolidated=False)
    off = ds["sample_offsets"].values
    k = len(off) // 2
    a, b = int(off[k]), int(off[k + 1])
    x = ds["hidden"][a:b].values
    np.save(out, (x.astype(np.uint32) << 16).view(np.float32))
    print(json.dumps({
        "sizes": {d: int(s) for d, s in ds.sizes.items()},
        "var_dims": {v: list(ds[v].dims) for v in ds.data_vars},
        "var_dtypes": {v: str(ds[v].dtype) for v in ds.data_vars},
        "hidden_attrs": {k: str(v) for k, v in ds["hidden"].attrs.items()},
        "sample_id": int(ds["sample_ids"].values[k]),
        "dflash_offline_imported": sorted(m for m in sys.modules if m.split(".")[0] == "dflash_offline"),
    }))
"""


def test_xarray_opens_a_shard_and_decodes_hidden(valid_cache, manifest, tmp_path):
    from dflash_offline.cache.reader import CacheReader

    entry = manifest["shards"][0]
    out = tmp_path / "hidden.npy"
    report = run_outside(XARRAY, valid_cache / "shards" / f"{entry['name']}.zarr", out, cwd=tmp_path)
    assert report["dflash_offline_imported"] == []
    n, H, k = len(manifest["capture"]["layer_ids"]), manifest["target"]["hidden_size"], manifest["capture"]["topk"]
    assert report["sizes"] == {"token": entry["tokens"], "layer": n, "channel": H, "rank": k,
                               "sample": entry["samples"], "sample_edge": entry["samples"] + 1}
    assert report["var_dims"] == {name: dims for name, (_, dims) in EXPECTED_DIMS.items()}
    assert report["var_dtypes"] == {name: dtype for name, (dtype, _) in EXPECTED_DIMS.items()}
    assert report["hidden_attrs"].get("dtype") == "bfloat16"

    decoded = np.load(out)
    expected = CacheReader(str(valid_cache)).sample(report["sample_id"]).hidden
    assert decoded.dtype == np.float32 and expected.dtype == np.float32
    assert decoded.shape == expected.shape and decoded.shape[1:] == (n, H)
    assert np.array_equal(decoded.view(np.uint32), expected.view(np.uint32))
    assert np.isfinite(decoded).all() and np.abs(decoded).max() > 0
