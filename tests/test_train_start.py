"""How a training run starts and runs its layers: drafter layers initialised from the target's
(`--init-layers`), the compiled training layer (`--compile-layers`) against the eager module, and
the loss chunk chosen by the vocabulary."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from dflash_offline.train.config import auto_loss_chunk
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.drafter.warm_start import plan_start
from dflash_offline.drafter.masks import count_recompiles, dense_mask
from dflash_offline.runtime.errors import UserError


def _drafter(target, drafter_layers=2, seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(DrafterConfig.from_target(str(target), [1, 3, 5], drafter_layers=drafter_layers, mask_token_id=7))
    d.load_frozen_from_target(str(target))
    return d


def test_init_layers_copies_the_target_layers_exactly(tiny_dense):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_dense, dtype=torch.float32).state_dict()
    d = _drafter(tiny_dense)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    d.init_layers_from_target(str(tiny_dense), [6, 2])
    after = d.state_dict()
    copied = 0
    for name, t in after.items():
        if name.startswith("layers."):
            i, rest = name[len("layers."):].split(".", 1)
            src = target[f"model.layers.{[6, 2][int(i)]}.{rest}"]
            assert torch.equal(t, src.to(t.dtype)), name
            copied += 1
        else:  # fc, norms outside the layers, frozen tables: untouched
            assert torch.equal(t, before[name]), name
    assert copied == len([k for k in after if k.startswith("layers.")]) > 10


def test_init_layers_refuses_a_wrong_count_and_a_missing_layer(tiny_dense):
    """(A hybrid's layers start what fits of the drafter's: tests/test_hybrid_warm_start.py.)"""
    cfg = DrafterConfig.from_target(str(tiny_dense), [1, 3, 5], drafter_layers=2, mask_token_id=7)
    with pytest.raises(UserError, match="one target layer per drafter layer, 2 expected"):
        plan_start(str(tiny_dense), [1, 2, 3], cfg)
    with pytest.raises(UserError, match=r"outside the target's layers 0\.\.7"):
        plan_start(str(tiny_dense), [1, 8], cfg)
    assert len(plan_start(str(tiny_dense), [0, 7], cfg).sources) == 2 * 11  # headers only, nothing loaded


def test_layer_shapes_are_the_modules(tiny_dense, tiny_hybrid):
    for target in (tiny_dense, tiny_hybrid):
        cfg = DrafterConfig.from_target(str(target), [1, 3], drafter_layers=2, mask_token_id=7)
        built = {n[len("layers.1."):]: tuple(p.shape) for n, p in DFlashDrafter.meta(cfg).named_parameters()
                 if n.startswith("layers.1.")}
        assert built == cfg.layer_shapes()


def test_train_refuses_bad_init_layers_before_work(tiny_dense, arith_cache, tmp_path):
    out = tmp_path / "run"
    r = run_cli(["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, "--devices", "cpu",
                 "--drafter-layers", "2", "--init-layers", "1,2,3", "--mask-token-id", "7", "--no-progress"])
    assert r.returncode == 2
    assert "--init-layers 1,2,3: one target layer per drafter layer, 2 expected" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (out / "metrics.jsonl").exists()


def _batch(d: DFlashDrafter, R=2, S=24, anchors=(3, 11), seed=1):
    g = torch.Generator().manual_seed(seed)
    B = d.cfg.block_size
    n = len(d.cfg.target_layer_ids) * d.cfg.hidden_size
    hidden = torch.randn(R, S, n, generator=g)
    a = torch.tensor([list(anchors)] * R)
    valid = torch.ones_like(a, dtype=torch.bool)
    block_ids = torch.randint(0, d.cfg.vocab_size, (R, len(anchors) * B), generator=g)
    block_pos = (a[:, :, None] + torch.arange(B)).reshape(R, -1)
    ctx_pos = torch.arange(S).expand(R, S)
    mask = dense_mask(torch.zeros(R, S, dtype=torch.long), a, valid, B)
    return hidden, block_ids, ctx_pos, block_pos, mask


def test_compiled_layers_train_as_the_eager_module_and_leave_inference_eager(tiny_dense):
    """The compiled training layer (here with the aot_eager backend: the same graph capture and
    autograd, no code generation on CPU) gives the eager forward and gradients; its graph is
    compiled once for every layer (no recompile), and eval-mode or no-grad calls never use it."""
    torch._dynamo.reset()
    eager, comp = _drafter(tiny_dense, drafter_layers=3), _drafter(tiny_dense, drafter_layers=3)
    comp.compile_layers(backend="aot_eager")
    batch = _batch(eager)
    before = count_recompiles()
    for step in range(2):
        outs, grads = [], []
        for d in (eager, comp):
            d.zero_grad()
            h = d(*batch)
            h.square().mean().backward()
            outs.append(h.detach())
            grads.append({n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None})
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
        assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
        for n in grads[0]:
            torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6)
    assert count_recompiles() == before  # three layers, two steps: one graph
    # Another shape in eval mode or under no_grad: the eager module, no compile at all.
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    other = _batch(comp, R=1, S=17, anchors=(5,))
    with torch.no_grad():
        comp(*other)
    comp.eval()
    comp(*other)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_loss_chunk_follows_the_vocabulary():
    assert auto_loss_chunk(8192) == 32768  # the pycode target: a few large chunks
    assert auto_loss_chunk(248320) == 4096  # Qwen3.6: unchanged, bounded logits memory
    assert auto_loss_chunk(151936) == 4096
    assert auto_loss_chunk(512) == 1 << 19


@pytest.mark.gpu
def test_compiled_layers_on_cuda_match_eager_under_flex_and_bf16(tiny_dense):
    """The Inductor-compiled layer with the flex BlockMask under bf16 autocast, as training runs it,
    against the eager module: same forward and gradients to bf16 rounding, one graph."""
    from dflash_offline.drafter.masks import flex_block_mask

    eager, comp = _drafter(tiny_dense, drafter_layers=3).cuda(), _drafter(tiny_dense, drafter_layers=3).cuda()
    comp.compile_layers()
    hidden, block_ids, ctx_pos, block_pos, _ = _batch(eager, R=2, S=256, anchors=(3, 40, 100, 200))
    a = torch.tensor([[3, 40, 100, 200]] * 2)
    mask = flex_block_mask(torch.zeros(2, 256, dtype=torch.long).cuda(), a.cuda(), torch.ones_like(a, dtype=torch.bool).cuda(),
                           eager.cfg.block_size)
    batch = [t.cuda() for t in (hidden, block_ids, ctx_pos, block_pos)] + [mask]
    res = []
    for i, d in enumerate((eager, comp, comp)):
        if i == 2:  # the compiled layer's second step: nothing compiles again
            before = count_recompiles()
        d.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = d(*batch)
        h.float().square().mean().backward()
        res.append((h.detach().float(), {n: p.grad.float().clone() for n, p in d.named_parameters() if p.grad is not None}))
    for h, g in res[1:]:
        torch.testing.assert_close(h, res[0][0], rtol=2e-2, atol=2e-2)
        for n in res[0][1]:
            torch.testing.assert_close(g[n], res[0][1][n], rtol=5e-2, atol=1e-3)
    assert count_recompiles() == before
