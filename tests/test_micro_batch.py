"""MicroBatch, the typed row the loader delivers: `on` moves it and dequantises fp8 hidden states
exactly as the cache's own dequantiser does; its read-only view by name lists the tensors it holds."""

from __future__ import annotations

import torch

from dflash_offline.cache.fp8 import dequantize, quantize
from dflash_offline.blocks.stream import MicroBatch


def _batch(**hidden) -> MicroBatch:
    z = torch.zeros((1, 8), dtype=torch.long)
    return MicroBatch(row=torch.tensor([3]), doc_ids=z, ctx_positions=z, anchors=z[:, :2], anchor_valid=z[:, :2] > 0,
                      block_ids=z, block_positions=z, labels=z, weights=torch.ones((1, 8)), **hidden)


def test_on_dequantises_fp8_rows_like_the_cache():
    torch.manual_seed(0)
    x = torch.randn(1, 8, 3, 16) * 5  # [R, S, n, H]
    bits, scale = quantize(x)
    mb = _batch(target_hidden_bits=bits.view(torch.uint8).reshape(1, 8, 48), target_hidden_scale=scale)
    got = mb.on("cpu")
    want = dequantize(bits.view(torch.uint8), scale, torch.bfloat16).view(1, 8, 48)
    assert got.target_hidden_bits is None and got.target_hidden_scale is None
    assert got.target_hidden.dtype == torch.bfloat16 and torch.equal(got.target_hidden, want)
    plain = _batch(target_hidden=torch.randn(1, 8, 48).bfloat16())
    assert torch.equal(plain.on("cpu").target_hidden, plain.target_hidden)


def test_view_by_name():
    mb = _batch(target_hidden=torch.zeros(1, 8, 4))
    assert set(mb.keys()) == {"row", "doc_ids", "ctx_positions", "anchors", "anchor_valid", "block_ids",
                              "block_positions", "labels", "weights", "target_hidden"}
    assert torch.equal(mb["weights"], mb.weights) and mb.get("soft_ids") is None and list(mb) == list(mb.keys())
