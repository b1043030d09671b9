"""Stored hidden states and top-k equal a solo forward of each sample through the target.

The reference is independent of the extractor: transformers' own `from_pretrained` and
`output_hidden_states` (hidden_states[i + 1] is decoder layer i's output), one sample at a time,
no padding. The extractor batches length-sorted, right-padded rows, so equality here shows that
padding leaks nothing, for the dense target and for the hybrid (Gated DeltaNet) target alike.

Tolerance, measured and justified: no value from a padded position can reach a real one (padding
is on the right; causal attention and the causal conv / delta-rule recurrence only look
backwards), but CPU fp32 GEMMs block their sums by matrix shape, so a [B, S] batch and a [1, t]
solo run can differ in the last fp32 bits. Rounding to bfloat16 turns such a difference into one
bf16 ulp when it straddles a rounding boundary (measured: about 1 value in 30,000; near zero,
where ulps shrink, the same fp32 difference can span 2 ulps). We require every stored value within
one bf16 spacing of the reference (2**-8 relative, or 2**-8 of the row's RMS near zero), at least
99.9% bit-identical, top-k log-probabilities within
1 fp16 ulp and top-k ids equal except where two log-probabilities tie within that. A leak from a
padded position or another sample would move values by O(1) relative, thousands of ulps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from _numerics import bf16_close, bf16_ulps, fp16_ulps
from conftest import run_cli
from dflash_offline.cache.reader import CacheReader
from dflash_offline.targets.model import route_cpu_tensors_to_torch_kernels

ARGS = ["--devices", "cpu", "--topk", "6", "--max-len", "120", "--batch-tokens", "480",
        "--shard-tokens", "1500", "--chunk-tokens", "256", "--logits-chunk-tokens", "100", "--no-progress"]


def solo_reference(target_dir, input_ids: np.ndarray, layer_ids: list[int], topk: int):
    from transformers import AutoModelForCausalLM

    model = solo_reference.cache.get(str(target_dir))
    if model is None:
        if "text_config" in json.loads((Path(target_dir) / "config.json").read_text()):
            from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration as cls
        else:
            cls = AutoModelForCausalLM
        model = cls.from_pretrained(target_dir, dtype=torch.float32).eval()
        # Where flash-linear-attention is installed, transformers binds its Triton kernels, which
        # cannot run CPU tensors: the reference takes transformers' own PyTorch path instead.
        route_cpu_tensors_to_torch_kernels(model)
        solo_reference.cache[str(target_dir)] = model
    with torch.no_grad():
        out = model(torch.from_numpy(input_ids.astype(np.int64))[None], output_hidden_states=True)
    hidden = torch.stack([out.hidden_states[i + 1][0] for i in layer_ids], dim=1)  # [t, n, H]
    bits = hidden.to(torch.bfloat16).view(torch.uint16).numpy()
    lp = torch.log_softmax(out.logits[0].float(), dim=-1)
    v, i = torch.topk(lp, topk, dim=-1)
    return bits, i.to(torch.int32).numpy(), v.to(torch.float16).numpy()


solo_reference.cache = {}


@pytest.fixture(scope="session")
def tiny_hybrid_multimodal(tmp_path_factory):
    from dflash_offline.tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("targets") / "tiny-qwen3_5-vl", kind="qwen3_5_vl")


@pytest.mark.parametrize("kind", ["dense", "hybrid", "hybrid-multimodal-checkpoint"])
def test_stored_equals_solo_forward(kind, tiny_dense, tiny_hybrid, tiny_data, tmp_path, request):
    """`hybrid-multimodal-checkpoint` is saved as the released Qwen3.5/3.6 models are (text model
    inside the vision-language wrapper): only the text model is built and its keys remapped; the
    reference is the whole wrapper's own forward."""
    target = {"dense": tiny_dense, "hybrid": tiny_hybrid}.get(kind) or request.getfixturevalue("tiny_hybrid_multimodal")
    cache = tmp_path / "cache"
    r = run_cli(["extract", "--target", str(target), "--data", str(tiny_data), "--cache", str(cache), *ARGS])
    assert r.returncode == 0, r.stderr
    reader = CacheReader(str(cache))
    m = reader.manifest
    assert m["status"] == "complete"
    layer_ids = m["capture"]["layer_ids"]
    assert layer_ids == [1, 2, 3, 4, 5]  # the DFlash rule for L = 8
    seen = identical = total = 0
    for s in reader.samples():
        bits, ids, lp = solo_reference(target, s.input_ids, layer_ids, 6)
        assert s.hidden_bits.shape == bits.shape
        ulps = bf16_ulps(s.hidden_bits, bits)
        assert bf16_close(s.hidden_bits, bits).all(), f"sample {s.sample_id}: hidden off by up to {ulps.max()} bf16 ulps"
        identical += int((ulps == 0).sum())
        total += ulps.size
        assert fp16_ulps(s.topk_logprobs, lp).max() <= 1, f"sample {s.sample_id}: top-k logprobs differ"
        same = s.topk_ids == ids
        # An id may only differ where its neighbour in rank has a (near) tied log-probability.
        tied = np.zeros_like(same)
        tied[:, :-1] |= fp16_ulps(lp[:, :-1], lp[:, 1:]) <= 1
        tied[:, 1:] |= fp16_ulps(lp[:, 1:], lp[:, :-1]) <= 1
        assert (same | tied).all(), f"sample {s.sample_id}: top-k ids differ"
        seen += 1
    assert seen == m["source"]["rows"] == 48
    assert identical / total >= 0.999, f"only {identical / total:.5f} of hidden values bit-identical"
    # The test is only meaningful if batches really mixed lengths (padding present).
    lens = sorted((s.input_ids.shape[0] for s in reader.samples()), reverse=True)
    padded_batches = sum(1 for a, b in zip(lens, lens[1:]) if a != b)
    assert padded_batches > 10


def test_layers_only_no_head(tiny_dense, tiny_data, tmp_path):
    """--topk 0 stores no logits and builds only layers 0..max(layer_ids); values still exact."""
    cache = tmp_path / "cache"
    r = run_cli(["extract", "--target", str(tiny_dense), "--data", str(tiny_data), "--cache", str(cache),
                 *ARGS[:2], "--topk", "0", "--capture-layers", "0,3", *ARGS[4:]])
    assert r.returncode == 0, r.stderr
    reader = CacheReader(str(cache))
    log = (cache / "logs" / "extract-rank0.log").read_text()
    assert "4 of 8 layers, head off" in log
    for s in list(reader.samples())[:10]:
        assert s.topk_ids is None
        bits, _, _ = solo_reference(tiny_dense, s.input_ids, [0, 3], 1)
        assert bf16_close(s.hidden_bits, bits).all()
    shard = reader.shard(reader.shard_names[0]).group
    assert "topk_ids" not in shard and shard.attrs["topk"] == 0
