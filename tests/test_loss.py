"""The fused head loss against the checkpointed reference: same loss, same hits, same gradient."""

from __future__ import annotations

import pytest
import torch

from dflash_offline.blocks.loss import block_loss


def _case(dtype=torch.float32, seed=0, R=3, Q=40, H=32, V=301):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, Q, H, generator=g, dtype=dtype)
    head = torch.randn(V, H, generator=g, dtype=dtype) / H**0.5
    labels = torch.randint(0, V, (R, Q), generator=g)
    weights = torch.rand(R, Q, generator=g) * (torch.rand(R, Q, generator=g) > 0.3)  # some unscored
    labels[weights == 0] = 0
    return hidden, head, labels, weights


def _loss_and_grad(impl, hidden, head, labels, weights, chunk, scale=0.37, autocast=False):
    h = hidden.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        total, correct = block_loss(h * 1.0, head, labels, weights, chunk_tokens=chunk, impl=impl)
    (total * scale).backward()
    return total.detach(), correct, h.grad


@pytest.mark.parametrize("chunk", [7, 4096])
def test_fused_equals_recompute_fp32(chunk):
    case = _case()
    lf, cf, gf = _loss_and_grad("fused", *case, chunk)
    lr, cr, gr = _loss_and_grad("recompute", *case, chunk)
    torch.testing.assert_close(lf, lr, rtol=1e-6, atol=1e-5)
    assert torch.equal(cf, cr)
    torch.testing.assert_close(gf, gr, rtol=1e-5, atol=1e-6)
    # A brute-force reference: the mean of weight x CE over all tokens at once, by autograd.
    h, head, y, w = case
    h = h.clone().requires_grad_(True)
    ref = (torch.nn.functional.cross_entropy((h @ head.T).reshape(-1, head.shape[0]), y.reshape(-1),
                                             reduction="none") * w.reshape(-1)).sum()
    (ref * 0.37).backward()
    torch.testing.assert_close(lf, ref.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gf, h.grad, rtol=1e-5, atol=1e-6)


def test_fused_under_bf16_autocast_matches_recompute():
    hidden, head, labels, weights = _case(seed=1)
    head = head.to(torch.bfloat16)  # the frozen head keeps the checkpoint's dtype
    lf, cf, gf = _loss_and_grad("fused", hidden, head, labels, weights, 16, autocast=True)
    lr, cr, gr = _loss_and_grad("recompute", hidden, head, labels, weights, 16, autocast=True)
    assert gf.dtype == gr.dtype == torch.float32
    torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-4)
    assert torch.equal(cf, cr)
    # Both round the logits' gradient to bf16 for the matmul; they differ only in where the
    # incoming scale is applied (before or after that rounding).
    torch.testing.assert_close(gf, gr, rtol=2e-2, atol=2e-3)


def test_no_grad_and_trainable_head():
    hidden, head, labels, weights = _case(seed=2)
    with torch.no_grad():
        lf, cf = block_loss(hidden, head, labels, weights, 9, "fused")
        lr, cr = block_loss(hidden, head, labels, weights, 9, "recompute")
    torch.testing.assert_close(lf, lr, rtol=1e-6, atol=1e-5)
    assert torch.equal(cf, cr)
    # A head that trains needs the weight gradient: the fused path steps aside for the reference.
    head = head.clone().requires_grad_(True)
    total, _ = block_loss(hidden, head, labels, weights, 9, "fused")
    total.backward()
    assert head.grad is not None and head.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="impl"):
        block_loss(hidden, head, labels, weights, 9, "other")


@pytest.mark.gpu
def test_fused_equals_recompute_on_cuda_bf16_large_vocab():
    hidden, head, labels, weights = _case(seed=3, R=2, Q=2048, H=256, V=50_000)
    dev = "cuda"
    hidden, labels, weights = hidden.to(dev), labels.to(dev), weights.to(dev)
    head = head.to(dev, torch.bfloat16)

    def run(impl):
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total, correct = block_loss(h * 1.0, head, labels, weights, chunk_tokens=1024, impl=impl)
        (total * 0.37).backward()
        return total.detach(), correct, h.grad

    (lf, cf, gf), (lr, cr, gr) = run("fused"), run("recompute")
    torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-3)
    assert (cf == cr).float().mean() > 0.999
    torch.testing.assert_close(gf, gr, rtol=2e-2, atol=2e-3)
    # The compiled passes (the trainer's GPU default), with D-PACE weights: the eager fused path's
    # numbers up to float32 summation order.
    out = {}
    for compiled in (False, True):
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total, correct = block_loss(h * 1.0, head, labels, weights, chunk_tokens=1024, dpace_alpha=0.5,
                                        block_size=16, compiled=compiled)
        (total * 0.37).backward()
        out[compiled] = (total.detach(), correct, h.grad)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-3)
    assert (out[True][1] == out[False][1]).float().mean() > 0.999
    torch.testing.assert_close(out[True][2], out[False][2], rtol=2e-2, atol=2e-3)


# ----------------------------------------------------------------------------------------------
# Distillation from the target's top-k log-probabilities (soft_ids / soft_logprobs / soft_weight)

def _soft_case(k, dtype=torch.float64, seed=10, R=3, Q=40, H=32, V=301):
    """A block batch with the target's top-k as the cache stores it: int32 ids (distinct per token)
    and float16 log-probabilities, log-softmax over the full vocabulary of a random target."""
    hidden, head, labels, weights = _case(dtype=dtype, seed=seed, R=R, Q=Q, H=H, V=V)
    g = torch.Generator().manual_seed(seed + 1)
    target_logp = torch.log_softmax(2 * torch.randn(R, Q, V, generator=g, dtype=torch.float64), -1)
    ids = torch.rand(R, Q, V, generator=g).argsort(-1)[..., :k]
    logp = target_logp.gather(-1, ids).to(torch.float16)
    return hidden, head, labels, weights, ids.to(torch.int32), logp


def _dense_target(labels, weights, ids, logp, alpha, V):
    """The dense [N, V] target distribution (1 - alpha) onehot + alpha softmax(top-k), built with
    scatter in float64; unscored rows (weight 0) get all zeros, as they contribute nothing."""
    y, w = labels.reshape(-1), weights.reshape(-1)
    k = ids.shape[-1]
    p = torch.softmax(logp.reshape(-1, k).double(), -1)
    t = torch.zeros(y.shape[0], V, dtype=torch.float64)
    t.scatter_(1, y[:, None], 1 - alpha)
    t.scatter_add_(1, ids.reshape(-1, k).long(), alpha * p)
    return torch.where((w != 0)[:, None], t, 0.0)


def _soft_loss_and_grad(impl, hidden, head, labels, weights, ids, logp, alpha, chunk, scale=0.37):
    h = hidden.clone().requires_grad_(True)
    total, correct = block_loss(h * 1.0, head, labels, weights, chunk_tokens=chunk, impl=impl,
                                soft_ids=ids, soft_logprobs=logp, soft_weight=alpha)
    (total * scale).backward()
    return total.detach(), correct, h.grad


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("chunk", [7, 4096])
def test_soft_target_matches_dense_reference(k, alpha, chunk):
    hidden, head, labels, weights, ids, logp = _soft_case(k)
    assert hidden.shape[0] * hidden.shape[1] % 7 != 0  # the last chunk is a partial one
    assert (weights == 0).any()
    # The dense brute force: all logits at once, the soft target by scatter, the gradient by autograd.
    h = hidden.clone().requires_grad_(True)
    logits = (h @ head.T).reshape(-1, head.shape[0])
    t = _dense_target(labels, weights, ids, logp, alpha, head.shape[0])
    ref = (weights.reshape(-1) * (torch.logsumexp(logits, -1) - (t * logits).sum(-1))).sum()
    (ref * 0.37).backward()
    ref_correct = (logits.argmax(-1) == labels.reshape(-1)).view_as(labels)
    lf, cf, gf = _soft_loss_and_grad("fused", hidden, head, labels, weights, ids, logp, alpha, chunk)
    lr, cr, gr = _soft_loss_and_grad("recompute", hidden, head, labels, weights, ids, logp, alpha, chunk)
    assert gf.dtype == gr.dtype == torch.float64
    # Both paths make their logits in float32 (the hard path's `.float()`, kept as it is), so
    # against each other they agree to float32 rounding, against the float64 brute force a bit less.
    torch.testing.assert_close(lf.double(), lr.double(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gf, gr, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lf.double(), ref.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gf, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gr, h.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(cf, ref_correct) and torch.equal(cr, ref_correct)  # still argmax == label


@pytest.mark.parametrize("impl", ["fused", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_soft_weight_zero_is_the_hard_path_bit_for_bit(impl, dtype):
    hidden, head, labels, weights, ids, logp = _soft_case(4, dtype=dtype, seed=11)
    lh, ch, gh = _loss_and_grad(impl, hidden, head, labels, weights, 7)
    ls, cs, gs = _soft_loss_and_grad(impl, hidden, head, labels, weights, ids, logp, 0.0, 7)
    assert torch.equal(lh, ls) and torch.equal(ch, cs) and torch.equal(gh, gs)
    # With no soft arrays the weight is moot: the hard path, unchanged.
    ln, cn, gn = _soft_loss_and_grad(impl, hidden, head, labels, weights, None, None, 0.0, 7)
    assert torch.equal(lh, ln) and torch.equal(ch, cn) and torch.equal(gh, gn)


@pytest.mark.parametrize("impl", ["fused", "recompute"])
def test_soft_weight_one_is_kl_plus_target_entropy(impl):
    hidden, head, labels, weights, ids, logp = _soft_case(4, seed=12)
    loss, _, _ = _soft_loss_and_grad(impl, hidden, head, labels, weights, ids, logp, 1.0, 9)
    V, w = head.shape[0], weights.reshape(-1)
    p = _dense_target(labels, weights, ids, logp, 1.0, V)
    log_q = torch.log_softmax((hidden @ head.T).reshape(-1, V), -1)
    entropy = -(w * torch.xlogy(p, p).sum(-1)).sum()
    kl = (w * torch.nn.functional.kl_div(log_q, p, reduction="none").sum(-1)).sum()
    torch.testing.assert_close(loss.double() - entropy, kl, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("impl", ["fused", "recompute"])
def test_unscored_tokens_with_garbage_soft_targets_stay_finite(impl):
    hidden, head, labels, weights, ids, logp = _soft_case(4, dtype=torch.float32, seed=13)
    unscored = weights == 0
    # What a cache may hold where nothing is scored: -inf log-probabilities, padding ids.
    logp_bad, ids_bad = logp.clone(), ids.clone()
    logp_bad[unscored] = float("-inf")
    ids_bad[unscored] = -1
    r, q = unscored.nonzero()[0].tolist()
    logp_bad[r, q] = float("nan")  # and one row of NaN
    l_bad, c_bad, g_bad = _soft_loss_and_grad(impl, hidden, head, labels, weights, ids_bad, logp_bad, 0.5, 7)
    assert torch.isfinite(l_bad) and torch.isfinite(g_bad).all()
    # ... and they change nothing: the same as with well-formed entries there.
    l_ok, c_ok, g_ok = _soft_loss_and_grad(impl, hidden, head, labels, weights, ids, logp, 0.5, 7)
    torch.testing.assert_close(l_bad, l_ok, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(g_bad, g_ok, rtol=1e-5, atol=1e-6)
    assert torch.equal(c_bad, c_ok)
    assert (g_bad.reshape(-1, g_bad.shape[-1])[unscored.reshape(-1)] == 0).all()


@pytest.mark.parametrize("impl", ["fused", "recompute"])
def test_scored_token_without_soft_target_keeps_only_the_hard_share(impl):
    # A scored token whose top-k is all -inf (nothing recorded) gets p = 0, not NaN: its target is
    # (1 - alpha) x onehot(label), the loss weight x (lse - (1 - alpha) x logit[label]).
    hidden, head, labels, weights, ids, logp = _soft_case(4, seed=16)
    r, q = (weights > 0).nonzero()[0].tolist()
    logp = logp.clone()
    logp[r, q] = float("-inf")
    loss, _, grad = _soft_loss_and_grad(impl, hidden, head, labels, weights, ids, logp, 0.4, 7)
    h = hidden.clone().requires_grad_(True)
    logits = (h @ head.T).reshape(-1, head.shape[0])
    t = _dense_target(labels, weights, ids, logp, 0.4, head.shape[0]).nan_to_num(0.0)
    assert t[r * labels.shape[1] + q].sum() == pytest.approx(0.6)
    ref = (weights.reshape(-1) * (torch.logsumexp(logits, -1) - (t * logits).sum(-1))).sum()
    (ref * 0.37).backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, h.grad, rtol=1e-5, atol=1e-6)


def test_soft_target_no_grad_and_bf16_autocast():
    hidden, head, labels, weights, ids, logp = _soft_case(4, dtype=torch.float32, seed=14)
    kw = dict(soft_ids=ids.long(), soft_logprobs=logp.float(), soft_weight=0.7)  # the other dtypes
    with torch.no_grad():
        lf, cf = block_loss(hidden, head, labels, weights, 9, "fused", **kw)
        lr, cr = block_loss(hidden, head, labels, weights, 9, "recompute", **kw)
    torch.testing.assert_close(lf, lr, rtol=1e-6, atol=1e-5)
    assert torch.equal(cf, cr)
    # Under bf16 autocast with a bf16 head, as on the GPU: the paths agree as the hard ones do.
    head = head.to(torch.bfloat16)
    out = {}
    for impl in ("fused", "recompute"):
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, correct = block_loss(h * 1.0, head, labels, weights, 16, impl, **kw)
        (total * 0.37).backward()
        out[impl] = total.detach(), correct, h.grad
    (lf, cf, gf), (lr, cr, gr) = out["fused"], out["recompute"]
    torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-4)
    assert torch.equal(cf, cr)
    torch.testing.assert_close(gf, gr, rtol=2e-2, atol=2e-3)


def test_soft_target_validation():
    hidden, head, labels, weights, ids, logp = _soft_case(4, dtype=torch.float32, seed=15)
    bad = [
        (dict(soft_ids=ids, soft_weight=0.5), "given together"),
        (dict(soft_logprobs=logp, soft_weight=0.5), "given together"),
        (dict(soft_ids=ids[:, :-1], soft_logprobs=logp[:, :-1], soft_weight=0.5), r"not \[R, Q, k\]"),
        (dict(soft_ids=ids[..., 0], soft_logprobs=logp[..., 0], soft_weight=0.5), r"not \[R, Q, k\]"),
        (dict(soft_ids=ids[..., :3], soft_logprobs=logp, soft_weight=0.5), "differ"),
        (dict(soft_ids=logp, soft_logprobs=logp, soft_weight=0.5), "integer dtype"),
        (dict(soft_ids=ids, soft_logprobs=ids, soft_weight=0.5), "floating dtype"),
        (dict(soft_ids=ids, soft_logprobs=logp, soft_weight=1.5), r"not in \[0, 1\]"),
        (dict(soft_ids=ids, soft_logprobs=logp, soft_weight=-0.1), r"not in \[0, 1\]"),
        (dict(soft_ids=ids, soft_logprobs=logp, soft_weight=float("nan")), r"not in \[0, 1\]"),
    ]
    for impl in ("fused", "recompute"):
        for kw, match in bad:
            with pytest.raises(ValueError, match=match):
                block_loss(hidden, head, labels, weights, 9, impl, **kw)


@pytest.mark.parametrize("soft", [False, True])
def test_compiled_passes_equal_the_eager_ones(soft):
    """`compiled=True` (the trainer's GPU path: Inductor kernels over each chunk's logits) gives the
    eager fused path's loss, hits and gradient, with D-PACE weights and a partial last chunk."""
    from dflash_offline.blocks.loss import _compiled

    hidden, head, labels, weights = _case(R=2, Q=48, H=32, V=301)
    g = torch.Generator().manual_seed(5)
    extra = {}
    if soft:
        ids = torch.rand(2, 48, 301, generator=g).argsort(-1)[..., :4].to(torch.int32)
        logp = torch.log_softmax(torch.randn(2, 48, 4, generator=g), -1).to(torch.float16)
        extra = dict(soft_ids=ids, soft_logprobs=logp, soft_weight=0.5)
    out = {}
    for compiled in (False, True):
        h = hidden.clone().requires_grad_(True)
        total, correct = block_loss(h * 1.0, head, labels, weights, chunk_tokens=40, dpace_alpha=0.5, block_size=8,
                                    compiled=compiled, **extra)
        (total * 0.37).backward()
        out[compiled] = (total.detach(), correct, h.grad)
    assert _compiled, "the compiled kernels were not used"
    # 96 tokens in chunks of 40: the last chunk (16) ran eagerly, so one more call compiles nothing.
    from dflash_offline.drafter.masks import count_recompiles

    before = count_recompiles()
    block_loss(hidden.clone().requires_grad_(True), head, labels, weights, chunk_tokens=40, dpace_alpha=0.5,
               block_size=8, compiled=True, **extra)[0].backward()
    assert count_recompiles() == before
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[True][1], out[False][1])
    torch.testing.assert_close(out[True][2], out[False][2], rtol=1e-4, atol=1e-6)
