"""8-bit hidden states (`--hidden-dtype fp8`): the error bound, the bytes, and the whole path.

- Round trip on heavy-tailed activations with outlier channels: every dequantised value within
  the bound cache/fp8.py states, |x' - x| <= 2^-4 |x| + 2^-10 scale; the numpy decoder equals torch's.
- Bytes per token on storage against bf16 at a 27B target's width: <= 0.52x.
- extract --hidden-dtype fp8 of a tiny target: within the bound of the bf16 cache of the same
  target; it verifies, inspects, and trains (the loader ships bits and scales, the trainer
  dequantises); the stand-alone checksum code of docs/cache-format.md (what outside checks copy)
  accepts both caches.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from conftest import extract_args, run_cli
from dflash_offline.cache.fp8 import dequantize, dequantize_np, quantize
from dflash_offline.cache.location import Location
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.writer import ShardLayout, ShardWriter


def _bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return 2.0 ** -4 * x.abs() + 2.0 ** -10 * scale.unsqueeze(-1)


def heavy_tailed(tokens=2048, layers=5, H=1024, seed=0) -> torch.Tensor:
    """Student-t (3 degrees of freedom) activations, a few outlier channels 30-300x larger, and a
    token of zeros: what residual streams of large models look like."""
    g = torch.Generator().manual_seed(seed)
    x = torch.distributions.StudentT(3.0).sample((tokens, layers, H))
    outliers = torch.randint(0, H, (6,), generator=g)
    x[..., outliers] *= torch.tensor([30.0, 60.0, 100.0, 150.0, 200.0, 300.0])
    x[7] = 0.0
    return x.bfloat16()


def test_round_trip_within_the_stated_bound():
    x = heavy_tailed()
    bits, scale = quantize(x)
    assert bits.dtype == torch.uint8 and scale.dtype == torch.float32 and scale.shape == x.shape[:2]
    back = dequantize(bits, scale)
    xf = x.float()
    err = (back - xf).abs()
    assert bool((err <= _bound(xf, scale)).all())
    assert bool((back[7] == 0).all())
    np.testing.assert_array_equal(dequantize_np(bits.numpy(), scale.numpy()), back.numpy())
    # The typical error, for the record: a few percent of the values' RMS.
    rel = (err.square().mean() / xf.square().mean()).sqrt().item()
    assert rel < 0.05, rel


def test_bytes_per_token_at_27b_width(tmp_path):
    n, H, T = 5, 5120, 2048
    x = heavy_tailed(T, n, H, seed=1)
    bits, scale = quantize(x)
    sizes = {}
    for dtype, h, sc in (("bfloat16", x.view(torch.uint16).numpy(), None), ("float8_e4m3fn", bits.numpy(), scale.numpy())):
        loc = Location(str(tmp_path / dtype))
        w = ShardWriter(loc, "s.zarr", ShardLayout(tokens=T, cache_layers=n, hidden_size=H, topk=0, chunk_tokens=1024,
                                                    layer_ids=list(range(n)), hidden_dtype=dtype))
        w.append_batch([(0, np.zeros(T, np.int32), np.ones(T, np.uint8))], h, None, None, sc)
        w.close("s")
        sizes[dtype] = loc.du("s.zarr")
    ratio = sizes["float8_e4m3fn"] / sizes["bfloat16"]
    assert ratio <= 0.52, (ratio, sizes)


def doc_checksum_code(cache: Path) -> str:
    """The Python block of docs/cache-format.md that checks shards without this package, aimed at `cache`."""
    text = (Path(__file__).parents[1] / "docs" / "cache-format.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "def shard_checksum" in b]
    assert len(blocks) == 1, "docs/cache-format.md: the stand-alone checksum code is missing or doubled"
    code = blocks[0].replace('cache = "runs/demo/cache"', f"cache = {str(cache)!r}")
    assert str(cache) in code, "the snippet's cache path line changed: update this test"
    return code


def test_fp8_extraction_verifies_inspects_and_trains(tiny_dense, tiny_data, valid_cache, tmp_path):
    bf16, fp8 = valid_cache, tmp_path / "fp8"  # the session's bf16 cache, made with the same options
    r = run_cli(extract_args(tiny_dense, tiny_data, fp8, "--hidden-dtype", "fp8"))
    assert r.returncode == 0, r.stderr
    m = json.loads((fp8 / "manifest.json").read_text())
    assert m["capture"]["hidden_dtype"] == "float8_e4m3fn"
    a, b = CacheReader(str(bf16)), CacheReader(str(fp8))
    checked = 0
    for sa in a.samples():
        sb = b.sample(sa.sample_id)
        assert sb.hidden_bits.dtype == np.uint8 and sb.hidden_scale.shape == sa.hidden_bits.shape[:2]
        ref = torch.from_numpy(sa.hidden)  # bf16 values of the same forward
        got = torch.from_numpy(sb.hidden)
        # The fp8 cache quantises the fp32 forward, the bf16 cache rounds it: allow both roundings.
        limit = (2.0 ** -4 + 2.0 ** -8) * ref.abs() + 2.0 ** -10 * torch.from_numpy(sb.hidden_scale).unsqueeze(-1) + 1e-6
        assert bool(((got - ref).abs() <= limit).all()), sa.sample_id
        checked += 1
    assert checked == len(list(b.samples())) > 0
    assert b.verify() == []
    assert run_cli(["verify", str(fp8)]).returncode == 0
    for cache in (bf16, fp8):  # the documented checker, run without this package's help
        r = subprocess.run([sys.executable, "-c", doc_checksum_code(cache)], capture_output=True, text=True, timeout=120)
        lines = r.stdout.split("\n")[:-1]
        assert r.returncode == 0 and lines and all(x.endswith(" True") for x in lines), (cache, r.stdout, r.stderr)
    r = run_cli(["inspect", str(fp8), "--sample", str(sa.sample_id)])
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    r = run_cli(["train", "--target", str(tiny_dense), "--cache", str(fp8), "--out", str(out), "--seq-len", "128",
                 "--num-anchors", "8", "--block-size", "4", "--global-batch-tokens", "256", "--mask-token-id", "1",
                 "--drafter-layers", "1", "--max-steps", "3", "--loader-workers", "0", "--no-progress"], timeout=600)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(recs) == 3 and all(np.isfinite(x["loss"]) for x in recs)
