"""The one-token step in pieces (targets/fused_step.py) against the layers' own modules, on the CPU in fp32:

- concatenating a layer's input projections leaves every module's weight a view of the one matrix
  (no second copy) and its output as it was;
- a one-token forward through the pieces equals the plain forward: the hidden states, and the
  attention buffers, convolution windows and recurrent states it leaves, with rows that keep their
  token and rows that do not (finished slots), dense and hybrid targets;
- compiled, each piece is one graph for every layer (the layers' parameters are its inputs): a graph
  per layer would run into torch.compile's recompile limit on a 64-layer target and fall back to eager.
"""

from __future__ import annotations

import pytest
import torch

from dflash_offline.evaluate.speculative import load_target_for_decoding
from dflash_offline.targets import fused_step as step
from dflash_offline.targets.static import StaticTarget


@pytest.fixture(params=["qwen3", "qwen3_5"])
def model(request, tiny_dense, tiny_hybrid):
    folder = tiny_dense if request.param == "qwen3" else tiny_hybrid
    return load_target_for_decoding(str(folder), "cpu", "float32")[0]


def test_fused_projections_are_views_with_the_same_outputs(model):
    layers = model.model.layers
    g = torch.Generator().manual_seed(0)
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(3, 2, m.in_features, generator=g) for m in linears]
    with torch.inference_mode():
        before = [m(h).clone() for m, h in zip(linears, inputs)]
        maps = step.fuse_projections(layers, [hasattr(layer, "linear_attn") for layer in layers])
        after = [m(h) for m, h in zip(linears, inputs)]
    assert step.fuse_projections(layers, []) is maps  # once per model
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    for layer, m in zip(layers, maps):
        mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
        parts = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"] if hasattr(layer, "linear_attn") \
            else ["q_proj", "k_proj", "v_proj"]
        for fused, mods in ((m.mixer, [getattr(mixer, p) for p in parts]),
                            (m.mlp, [layer.mlp.gate_proj, layer.mlp.up_proj])):
            assert sum(fused.sizes) == fused.weight.shape[0]
            for mod in mods:
                assert mod.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()


def _one_token(model, fast: bool, keep: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor):
    """A target whose rows hold a prefill of random tokens, then one token forwarded."""
    R, P = ids.shape[0], 7
    prompt = torch.randint(2, model.config.vocab_size, (R, P), generator=torch.Generator().manual_seed(1))
    t = StaticTarget(model, [1, 2], R, 16, fused_step=fast)
    assert (t.pieces is not None) == fast
    with torch.inference_mode():
        t.forward(prompt, torch.arange(P)[None].expand(R, P), False, keep=torch.full((R,), P), span=P)
        hidden, feats = t.forward(ids, pos, True, keep=keep)
    return hidden, feats, [b.clone() for b in t.buffers()]


def test_step_through_pieces_equals_the_plain_forward(model):
    ids = torch.tensor([[5], [9], [300], [41]])
    pos = torch.tensor([[7], [7], [7], [7]])
    keep = torch.tensor([1, 0, 1, 0])  # rows 1 and 3: a finished slot, its state must not move
    plain = _one_token(model, False, keep, ids, pos)
    fast = _one_token(model, True, keep, ids, pos)
    torch.testing.assert_close(fast[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast[1], plain[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(fast[2], plain[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_each_piece_compiles_once_for_every_layer(model):
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = step.Pieces(*(torch.compile(f, backend=count, dynamic=False, fullgraph=True)
                             for f in (step.linear_in, step.linear_out, step.attn_in, step.attn_out)))
    t = StaticTarget(model, [], 2, 16, fused_step=True)
    t.pieces = compiled
    ids, pos, keep = torch.tensor([[5], [9]]), torch.tensor([[3], [4]]), torch.tensor([1, 1])
    with torch.inference_mode():
        for _ in range(3):
            t.forward(ids, pos, False, keep=keep)
            pos = pos + 1
    kinds = {hasattr(layer, "linear_attn") for layer in model.model.layers}
    assert len(graphs) == 2 * len(kinds), [g.code[:200] for g in graphs]
