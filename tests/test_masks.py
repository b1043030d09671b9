"""The DFlash training mask (dflash_offline.drafter.masks): the rules checked against a literal brute force,
flex_attention against SDPA through the one mask definition, and (GPU) compiled flex forward +
backward in bf16 with no recompiles across steps of one shape.

Note: flex_attention on CPU runs eagerly (unfused "math" path) and evaluates mask_mod on the full
score matrix; it ignores the BlockMask's tile lists. The tile lists (which the fused GPU kernel
relies on, skipping mask_mod on "full" tiles) are therefore checked separately against the dense
mask in test_block_mask_tiles_match_dense.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_offline.drafter.masks import attention, count_recompiles, dense_mask, flex_block_mask, make_mask_mod

# Eager flex on CPU warns once that it is unfused; that is the intended CPU path here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def make_rows(seed: int, R: int, S: int, N: int, B: int, device="cpu"):
    """R packed rows: documents of random lengths (several of one token), padding (-1) at the end,
    anchors at document starts, at the last token before a boundary, at random positions, one on
    padding, and invalid blocks holding arbitrary anchor values (-1, 0, S-1, random)."""
    rng = np.random.default_rng(seed)
    doc_ids = np.full((R, S), -1, dtype=np.int32)
    anchors = np.zeros((R, N), dtype=np.int64)
    valid = np.zeros((R, N), dtype=bool)
    for r in range(R):
        content = S - int(rng.integers(2, 12))
        pos, doc, starts = 0, 0, []
        while pos < content:
            length = int(rng.choice([1, 1, 2, 3, 5, 8, 13, 21]))
            starts.append(pos)
            doc_ids[r, pos:min(pos + length, content)] = doc
            pos += length
            doc += 1
        lasts = [s - 1 for s in starts[1:]] + [content - 1]   # last token of each document
        picks = [int(rng.choice(starts[1:])), 0, int(rng.choice(lasts)), content - 1,
                 int(rng.integers(content, S))]                # doc start, row start, last tokens, padding
        picks += [int(rng.integers(0, content)) for _ in range(N - len(picks))]
        anchors[r] = picks[:N]
        valid[r] = True
        bad = rng.choice(N, size=max(1, N // 4), replace=False)  # invalid blocks, garbage anchors
        valid[r, bad] = False
        anchors[r, bad] = rng.choice([-1, 0, S - 1, int(rng.integers(0, S))], size=len(bad))
        perm = rng.permutation(N)
        anchors[r], valid[r] = anchors[r, perm], valid[r, perm]
    return (torch.from_numpy(doc_ids).to(device), torch.from_numpy(anchors).to(device),
            torch.from_numpy(valid).to(device))


def brute_force(doc_ids, anchors, valid, B) -> torch.Tensor:
    """The rules, read literally, in plain Python."""
    doc, anc, val = doc_ids.tolist(), anchors.tolist(), valid.tolist()
    R, S, N = len(doc), len(doc[0]), len(anc[0])
    out = torch.zeros(R, 1, N * B, S + N * B, dtype=torch.bool)
    for r in range(R):
        for q in range(N * B):
            n = q // B
            row = []
            for kv in range(S + N * B):
                if kv < S:
                    ok = (val[r][n] and kv < anc[r][n] and doc[r][kv] == doc[r][anc[r][n]]
                          and doc[r][kv] >= 0)
                else:
                    ok = (kv - S) // B == n
                row.append(ok)
            out[r, 0, q] = torch.tensor(row)
    return out


CASES = [(0, 64, 6, 4), (1, 100, 10, 4), (2, 77, 8, 16), (3, 93, 7, 16), (4, 100, 10, 16)]


@pytest.mark.parametrize("seed,S,N,B", CASES)
def test_dense_mask_equals_brute_force(seed, S, N, B):
    doc_ids, anchors, valid = make_rows(seed, 2, S, N, B)
    got = dense_mask(doc_ids, anchors, valid, B)
    assert got.dtype == torch.bool and got.shape == (2, 1, N * B, S + N * B)
    assert torch.equal(got, brute_force(doc_ids, anchors, valid, B))


def test_anchor_edge_cases():
    """Hand-made row: docs [0,0,0 | 1 | 2,2,2,2 | pad pad], B=2."""
    doc_ids = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2, -1, -1]], dtype=torch.int32)
    anchors = torch.tensor([[4, 3, 7, 2, 8, 5]])      # doc start, 1-token doc, last token, last before
    valid = torch.tensor([[True, True, True, True, True, False]])  # boundary, padding, invalid
    m = dense_mask(doc_ids, anchors, valid, 2)[0, 0]
    ctx = m[:, :10]
    for n, expect in enumerate([[], [], [4, 5, 6], [0, 1], [], []]):
        for j in range(2):
            assert ctx[2 * n + j].nonzero().flatten().tolist() == expect, (n, j)
            assert m[2 * n + j, 10:].nonzero().flatten().tolist() == [2 * n, 2 * n + 1]


@pytest.mark.parametrize("seed,S,N,B", CASES)
def test_every_query_has_a_key_and_invalid_blocks_see_only_themselves(seed, S, N, B):
    doc_ids, anchors, valid = make_rows(seed, 2, S, N, B)
    m = dense_mask(doc_ids, anchors, valid, B)
    assert m.any(dim=-1).all()
    own = torch.zeros(N * B, N * B, dtype=torch.bool)
    for n in range(N):
        own[n * B:(n + 1) * B, n * B:(n + 1) * B] = True
    assert torch.equal(m[..., S:], own.expand_as(m[..., S:]))   # own block only, valid or not
    q_invalid = (~valid).repeat_interleave(B, dim=1)              # [R, Q]
    assert not m[..., :S][q_invalid.unsqueeze(1)].any()


FLEX_CASES = [(5, 70, 7, 4), (6, 100, 10, 16), (7, 128, 8, 16), (8, 300, 20, 16)]  # Q x KV: 28x98,
# 160x260, 128x256 (multiples of the 128 tile), 320x620


@pytest.mark.parametrize("seed,S,N,B", FLEX_CASES)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_flex_matches_sdpa_on_cpu(seed, S, N, B, heads):
    Hq, Hkv = heads
    doc_ids, anchors, valid = make_rows(seed, 2, S, N, B)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, Hq, N * B, 16, generator=g)
    k = torch.randn(2, Hkv, S + N * B, 16, generator=g)
    v = torch.randn(2, Hkv, S + N * B, 16, generator=g)
    scale = 0.3 if Hq == Hkv else None
    bm = flex_block_mask(doc_ids, anchors, valid, B)
    out_flex = attention(q, k, v, bm, scale=scale)
    out_sdpa = attention(q, k, v, dense_mask(doc_ids, anchors, valid, B), scale=scale)
    assert out_flex.shape == (2, Hq, N * B, 16)
    assert torch.isfinite(out_sdpa).all()
    torch.testing.assert_close(out_flex, out_sdpa, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed,S,N,B", FLEX_CASES)
def test_block_mask_tiles_match_dense(seed, S, N, B):
    """The BlockMask's tile lists agree with the dense mask: a tile is listed iff any element is
    allowed, and listed as full (mask_mod skipped on GPU) iff every element is allowed."""
    doc_ids, anchors, valid = make_rows(seed, 2, S, N, B)
    bm = flex_block_mask(doc_ids, anchors, valid, B)
    tq, tk = bm.BLOCK_SIZE
    d = dense_mask(doc_ids, anchors, valid, B)
    Q, KV = d.shape[-2:]
    d = torch.nn.functional.pad(d, (0, -KV % tk, 0, -Q % tq))  # flex pads with False
    tiles = d.view(2, 1, d.shape[2] // tq, tq, d.shape[3] // tk, tk).permute(0, 1, 2, 4, 3, 5)
    assert torch.equal(bm.to_dense().bool(), tiles.any(-1).any(-1))
    full = torch.zeros_like(tiles[..., 0, 0])
    for r in range(2):
        for i in range(full.shape[2]):
            cnt = int(bm.full_kv_num_blocks[r, 0, i])
            full[r, 0, i, bm.full_kv_indices[r, 0, i, :cnt].long()] = True
    assert torch.equal(full, tiles.all(-1).all(-1))


def _listed(num, idx):
    """The tile lists of a BlockMask as a set of (row, head, tile, listed tile) per entry."""
    out = set()
    for r, h, t in np.ndindex(*num.shape):
        out |= {(r, h, t, int(i)) for i in idx[r, h, t, : int(num[r, h, t])]}
    return out


@pytest.mark.parametrize("seed,S,N,B", FLEX_CASES + [(9, 250, 13, 10), (10, 512, 32, 8), (11, 1000, 64, 16)])
def test_block_mask_equals_create_block_mask(seed, S, N, B):
    """flex_block_mask's tables (built per block, no dense mask) equal those of flex_attention's own
    create_block_mask run on the same mask_mod, for the key tiles and the transposed query tiles
    the backward uses; B = 10 puts block boundaries inside query tiles."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc_ids, anchors, valid = make_rows(seed, 2, S, N, B)
    ours = flex_block_mask(doc_ids, anchors, valid, B)
    ref = create_block_mask(make_mask_mod(doc_ids, anchors, valid, S, B), 2, None, N * B, S + N * B, device="cpu")
    assert ours.shape == ref.shape and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                     ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        assert torch.equal(getattr(ours, num), getattr(ref, num)), num
        assert _listed(getattr(ours, num), getattr(ours, idx)) == _listed(getattr(ref, num), getattr(ref, idx)), idx


def test_input_errors():
    doc_ids, anchors, valid = make_rows(0, 2, 64, 6, 4)
    with pytest.raises(ValueError, match="same shape"):
        dense_mask(doc_ids, anchors, valid[:, :5], 4)
    with pytest.raises(ValueError, match="rows"):
        dense_mask(doc_ids[:1], anchors, valid, 4)
    with pytest.raises(ValueError, match="2-D"):
        flex_block_mask(doc_ids[0], anchors, valid, 4)
    with pytest.raises(ValueError, match="seq_len"):
        make_mask_mod(doc_ids, anchors, valid, 63, 4)
    with pytest.raises(ValueError, match="block_size"):
        dense_mask(doc_ids, anchors, valid, 0)
    with pytest.raises(TypeError, match="anchor_valid must be bool"):
        dense_mask(doc_ids, anchors, valid.int(), 4)
    with pytest.raises(TypeError, match="doc_ids must be int"):
        dense_mask(doc_ids.float(), anchors, valid, 4)

    mask = dense_mask(doc_ids, anchors, valid, 4)
    q, k = torch.randn(2, 4, 24, 8), torch.randn(2, 2, 88, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(torch.randn(2, 3, 24, 8), k, k, mask)
    with pytest.raises(ValueError, match="same shape"):
        attention(q, k, k[:, :, :80], mask)
    with pytest.raises(ValueError, match="does not fit"):
        attention(q[:, :, :20], k, k, mask)
    with pytest.raises(ValueError, match="does not fit"):
        attention(q[:, :, :20], k, k, flex_block_mask(doc_ids, anchors, valid, 4))
    with pytest.raises(TypeError, match="must be bool"):
        attention(q, k, k, mask.float())
    with pytest.raises(TypeError, match="BlockMask"):
        attention(q, k, k, "causal")
    # None: no mask at all (a drafted block at inference sees every key it is given).
    full = torch.ones(1, 1, q.shape[2], k.shape[2], dtype=torch.bool)
    torch.testing.assert_close(attention(q, k, k, None), attention(q, k, k, full))


def test_count_recompiles_is_an_int():
    assert isinstance(count_recompiles(), int) and count_recompiles() >= 0


@pytest.mark.gpu
def test_compiled_flex_forward_backward_on_cuda_matches_sdpa():
    R, S, N, B, Hq, Hkv, D = 2, 300, 20, 16, 4, 2, 64   # Q 320, KV 620: not multiples of 128

    def step(seed):
        doc_ids, anchors, valid = make_rows(seed, R, S, N, B, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(R, h, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h, L in ((Hq, N * B), (Hkv, S + N * B), (Hkv, S + N * B)))
        grad_out = torch.randn(R, Hq, N * B, D, device="cuda", dtype=torch.bfloat16, generator=g)
        results = []
        for mask in (flex_block_mask(doc_ids, anchors, valid, B), dense_mask(doc_ids, anchors, valid, B)):
            qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            out = attention(qq, kk, vv, mask)
            out.backward(grad_out)
            results.append([out.detach(), qq.grad, kk.grad, vv.grad])
        return results

    # Tolerance: both kernels take bf16 inputs and round their outputs to bf16 (unit roundoff
    # 2**-8 = 3.9e-3), but accumulate in a different order (flex: tiled online softmax; SDPA:
    # another kernel), so the two may differ by a few bf16 ulps of values of magnitude ~1-4
    # (outputs are softmax-weighted averages of N(0,1) values; grads sum over up to 620 keys).
    # rtol = atol = 2e-2 is ~5 ulps: loose enough for rounding, far tighter than any mask error
    # (a wrong key changes outputs by O(0.1-1)). Measured on an H200 (torch 2.11): max |flex - SDPA|
    # 1e-4 (out), 5e-4 (dq), 0.0156 (dk, dv: one bf16 ulp at |x| in [2, 4)); each kernel is within
    # 0.016 of an fp32 SDPA reference.
    flex, sdpa = step(0)
    for name, a, b in zip(("out", "dq", "dk", "dv"), flex, sdpa):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")

    before = count_recompiles()
    for seed in range(1, 6):   # new doc_ids/anchors, same shapes: cached kernels, no recompile
        flex, sdpa = step(seed)
        torch.testing.assert_close(flex[0].float(), sdpa[0].float(), rtol=2e-2, atol=2e-2)
    assert count_recompiles() == before
