"""The shard write and read paths beside Zarr's, and the writer processes' failures.

- Whole chunks written straight to their files equal, byte for byte, what Zarr writes for the same
  data through its own codec pipeline (an fsspec URL cache takes that path), and Zarr reads them.
- `ChunkFiles` returns what Zarr returns for any token range, and refuses a corrupted, truncated or
  missing chunk file, naming it.
- The trainer's rows are the same read from chunk files or through Zarr.
- Shards checksummed with sha256 (earlier versions) still verify; a flipped byte fails either kind.
- A failing writer process stops `extract` with one line naming its log; the run resumes to the
  same cache. (That a killed run leaves no shared-memory segment behind is checked after every
  SIGKILL of test_extract_resume.py.)
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import zarr

from conftest import extract_args, run_cli, tree_digest
from dflash_offline.cache.location import Location
from dflash_offline.cache.manifest import ManifestStore, new_manifest
from dflash_offline.cache.reader import CacheReader, ChunkFiles, Shard
from dflash_offline.cache.shards import publish_shard, tmp_shard_rel
from dflash_offline.cache.writer import ShardLayout, ShardWriter

T, N_LAYERS, H, K, C = 5000, 3, 48, 4, 512


def _data(seed=0):
    rng = np.random.default_rng(seed)
    h = rng.integers(0, 1 << 16, (T, N_LAYERS, H)).astype(np.uint16)
    ti = rng.integers(0, 1000, (T, K)).astype(np.int32)
    tl = rng.standard_normal((T, K)).astype(np.float16)
    return h, ti, tl


def _write(root: str, name: str = "shard-000000", batches=(700, 2100, 1500, 700)) -> dict:
    """One committed shard written in batches that straddle chunk boundaries."""
    loc = Location(root)
    store = ManifestStore(loc)
    store.init_or_check(new_manifest(target={}, capture={}, source={},
                                     plan={"num_shards": 1, "shard_tokens": 0, "sort_window": 0}))
    loc.makedirs("shards")
    h, ti, tl = _data()
    w = ShardWriter(loc, tmp_shard_rel(name), ShardLayout(tokens=T, cache_layers=N_LAYERS, hidden_size=H, topk=K,
                                                           chunk_tokens=C, layer_ids=[0, 1, 2]))
    pos, sid = 0, 0
    for n in batches:
        samples = []
        for t in (n // 2, n - n // 2):
            samples.append((sid, np.arange(pos, pos + t, dtype=np.int32) % 97, (np.arange(t) % 3 == 0).astype(np.uint8)))
            sid += 1
            pos += t
        w.append_batch(samples, h[pos - n:pos], ti[pos - n:pos], tl[pos - n:pos])
    entry = w.close(name)
    publish_shard(store, entry)
    return {"entry": entry, "direct": w._direct_root is not None}


def _chunk_files(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if "/c/" in p:
                out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def test_direct_chunk_files_equal_zarr_written_ones(tmp_path):
    direct = _write(str(tmp_path / "direct"))
    via_zarr = _write(f"local://{tmp_path / 'zarr'}")  # a URL cache: every write goes through Zarr
    assert direct["direct"] and not via_zarr["direct"]
    a, b = _chunk_files(tmp_path / "direct"), _chunk_files(tmp_path / "zarr")
    assert a.keys() == b.keys() and len(a) >= 10
    assert all(a[k] == b[k] for k in a)
    assert direct["entry"]["checksum"] == via_zarr["entry"]["checksum"]
    assert direct["entry"]["checksum"].startswith("crc32c:")
    h, ti, tl = _data()
    g = zarr.open_group(str(tmp_path / "direct" / "shards" / "shard-000000.zarr"), mode="r")
    np.testing.assert_array_equal(g["hidden"][:], h)
    np.testing.assert_array_equal(g["topk_ids"][:], ti)
    np.testing.assert_array_equal(g["topk_logprobs"][:].view(np.uint16), tl.view(np.uint16))
    assert CacheReader(str(tmp_path / "direct")).verify() == []


def test_chunk_files_reads_equal_zarr_and_refuse_damage(tmp_path):
    _write(str(tmp_path))
    loc = Location(str(tmp_path))
    files = ChunkFiles(loc)
    g = zarr.open_group(str(tmp_path / "shards" / "shard-000000.zarr"), mode="r")
    rng = np.random.default_rng(1)
    for a, b in [(0, 1), (0, C), (C - 1, C + 1), (1, T), (T - 7, T), (4000, 4000)] + \
            [tuple(sorted(rng.integers(0, T + 1, 2))) for _ in range(20)]:
        for name in ("hidden", "input_ids", "loss_mask", "topk_ids"):
            np.testing.assert_array_equal(files.read("shard-000000", name, a, b), g[name][a:b])
    chunk = tmp_path / "shards" / "shard-000000.zarr" / "hidden" / "c" / "3" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 1
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"hidden/c/3/0/0: chunk fails its CRC32C"):
        ChunkFiles(loc).read("shard-000000", "hidden", 3 * C + 5, 3 * C + 9)
    np.testing.assert_array_equal(ChunkFiles(loc).read("shard-000000", "hidden", 0, C), g["hidden"][:C])
    chunk.write_bytes(bytes(raw[:-10]))
    with pytest.raises(ValueError, match="truncated"):
        ChunkFiles(loc).read("shard-000000", "hidden", 3 * C, 3 * C + 1)
    chunk.unlink()
    with pytest.raises(FileNotFoundError):
        ChunkFiles(loc).read("shard-000000", "hidden", 3 * C, 3 * C + 1)


def test_loader_rows_from_chunk_files_equal_rows_through_zarr(valid_cache):
    """The trainer's rows, read from chunk files (refs with their first token) and through Zarr."""
    from dflash_offline.blocks.stream import RowStream, Span

    reader = CacheReader(str(valid_cache))
    refs3, refs2, lengths = [], [], []
    for name in reader.shard_names:
        sh = reader.shard(name)
        lengths.extend((sh.offsets[1:] - sh.offsets[:-1]).tolist())
        refs3.extend((name, k, int(sh.offsets[k])) for k in range(len(sh)))
        refs2.extend((name, k) for k in range(len(sh)))
    n = len(reader.manifest["capture"]["layer_ids"])
    spec = {"seed": 3, "seq_len": 128, "num_anchors": 8, "block_size": 4, "mask_token_id": 1, "gamma": 4.0,
            "hidden_size": reader.manifest["target"]["hidden_size"], "num_layers": n}
    lengths = np.asarray(lengths)
    a = RowStream(str(valid_cache), refs3, lengths, spec, Span(1, 0, 6), 0, 1, 1)
    b = RowStream(str(valid_cache), refs2, lengths, spec, Span(1, 0, 6), 0, 1, 1)
    rows = list(a)
    assert len(rows) == 6
    for ra, rb in zip(rows, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k].dtype == rb[k].dtype and torch.equal(ra[k].view(-1).view(torch.uint8),
                                                               rb[k].view(-1).view(torch.uint8)), k


def test_sha256_checksums_of_earlier_shards_still_verify(tmp_path):
    _write(str(tmp_path))
    m = json.loads((tmp_path / "manifest.json").read_text())
    loc = Location(str(tmp_path))
    old = Shard(loc, m["shards"][0]).compute_checksum(algorithm="sha256")
    assert old.startswith("sha256:") and old != m["shards"][0]["checksum"]
    m["shards"][0]["checksum"] = old
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    assert CacheReader(str(tmp_path)).verify() == []
    # A flipped byte inside a value (its chunk CRC recomputed, so only the shard checksum can tell).
    f = tmp_path / "shards" / "shard-000000.zarr" / "input_ids" / "c" / "0"
    raw = bytearray(f.read_bytes())
    raw[8] ^= 1
    import google_crc32c

    raw[-4:] = np.array([google_crc32c.value(bytes(raw[:-4]))], "<u4").tobytes()
    f.write_bytes(bytes(raw))
    assert CacheReader(str(tmp_path)).verify() == ["shard-000000"]


OPTS = ["--topk", "4", "--max-len", "120", "--batch-tokens", "360", "--shard-tokens", "450",
        "--chunk-tokens", "128", "--no-progress"]


def _extract(target, data, cache, env=None):
    return run_cli(["extract", "--target", str(target), "--data", str(data), "--cache", str(cache),
                    "--devices", "cpu", *OPTS], env=env)


def test_writer_failure_is_one_line_and_resumes(tiny_dense, tiny_data, valid_cache, tmp_path):
    cache = tmp_path / "cache"
    r = run_cli(extract_args(tiny_dense, tiny_data, cache), env={"DFLASH_OFFLINE_RAISE_AT": "batch-written:5"})
    assert r.returncode != 0
    assert "shard writer failed (writer 0: InjectedFault: injected failure at batch-written" in r.stderr, r.stderr
    assert "extract-rank0-writer*.log" in r.stderr and "Run the same command again to resume" in r.stderr
    log = (cache / "logs" / "extract-rank0-writer0.log").read_text()
    assert "Traceback" in log and "InjectedFault" in log
    m = json.loads((cache / "manifest.json").read_text())
    assert m["status"] == "extracting" and 0 < len(m["shards"]) < m["plan"]["num_shards"]
    assert CacheReader(str(cache)).verify() == []
    assert run_cli(extract_args(tiny_dense, tiny_data, cache)).returncode == 0
    # The resumed cache equals the session's uninterrupted one, file for file (the manifest has timestamps).
    strip = lambda d: {k: v for k, v in d.items() if k != "manifest.json"}  # noqa: E731
    assert strip(tree_digest(cache)) == strip(tree_digest(valid_cache))
    a, b = json.loads((cache / "manifest.json").read_text()), json.loads((valid_cache / "manifest.json").read_text())
    assert a["shards"] == b["shards"]


def test_one_loader_over_several_epochs_equals_a_loader_per_epoch(valid_cache):
    """The run's loader spans its epochs (its processes live from the first step to the last): its
    micro-batches, made by two spawned processes, equal those of one in-process stream per epoch,
    bit for bit, in order, from a resumed step in the first epoch to a stop inside the last."""
    from dflash_offline.blocks.stream import RowStream, Span, make_loader

    reader = CacheReader(str(valid_cache))
    refs, lengths = [], []
    for name in reader.shard_names:
        sh = reader.shard(name)
        lengths.extend((sh.offsets[1:] - sh.offsets[:-1]).tolist())
        refs.extend((name, k, int(sh.offsets[k])) for k in range(len(sh)))
    spec = {"seed": 5, "seq_len": 64, "num_anchors": 4, "block_size": 4, "mask_token_id": 1, "gamma": 4.0,
            "hidden_size": reader.manifest["target"]["hidden_size"],
            "num_layers": len(reader.manifest["capture"]["layer_ids"])}
    lengths = np.asarray(lengths)
    world, rank, accum = 2, 1, 2
    probe = RowStream(str(valid_cache), refs, lengths, spec, Span(0, 0, 1), rank, world, accum)
    steps = min(len(probe.rows(e)) for e in range(3)) // (world * accum)
    assert steps >= 2
    spans = [Span(0, 1, steps), Span(1, 0, steps), Span(2, 0, steps - 1)]
    whole = RowStream(str(valid_cache), refs, lengths, spec, spans, rank, world, accum)
    got = list(make_loader(whole, 2, 2, pin=False))
    want = [mb for sp in spans for mb in RowStream(str(valid_cache), refs, lengths, spec, sp, rank, world, accum)]
    assert len(got) == len(want) == len(whole) == (3 * steps - 2) * accum
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k
    # The epochs differ (order and anchors): the test would see a stream stuck on one.
    assert not torch.equal(got[0]["anchors"], got[(steps - 1) * accum]["anchors"])
