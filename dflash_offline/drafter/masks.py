"""The DFlash training attention mask: one definition, two kernels.

A training row holds S context positions (packed documents) and N draft blocks of B tokens. Queries
are the N*B block tokens; keys/values are [context (S) | all blocks (N*B)]. Query q (block n = q // B)
may attend
  - context kv < S  iff the block is valid, kv < anchor_n (strictly before the anchor: at inference
    the anchor has no target feature yet), doc(kv) == doc(anchor_n) (packed documents never see each
    other) and doc(kv) >= 0 (padding is -1);
  - block kv >= S   iff (kv - S) // B == n (its own block, bidirectional), for valid and invalid
    blocks alike, so every query row keeps at least one key and softmax never yields NaN.

`make_mask_mod` is the only place these rules are written. `flex_block_mask` builds flex_attention's
BlockMask from it (the fast, block-sparse path: `block_tables` evaluates it once per block to find
the tiles, the kernel evaluates it inside partial tiles); `dense_mask` evaluates the very same
function on broadcast index tensors (the SDPA reference, and the CPU training path, since flex has
no backward on CPU). A fix to the rules therefore reaches both kernels at once.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = ["make_mask_mod", "dense_mask", "block_tables", "flex_block_mask", "attention", "count_recompiles"]

_INT_DTYPES = (torch.int32, torch.int64)

# Inductor compiles Triton kernels in-process, not in its pool of compile-worker subprocesses: on
# the H200 machine (torch 2.11+cu130) the first compile (then of create_block_mask) waited on that
# pool for over 280 s without progress, and public reports show the same pool dying or hanging
# (torchtitan issue 3944, with TORCHINDUCTOR_COMPILE_THREADS=1 as the fix). The flex forward and
# backward kernels compile in seconds in-process. An explicit TORCHINDUCTOR_COMPILE_THREADS wins.
if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
    import torch._inductor.config as _inductor_config

    _inductor_config.compile_threads = 1

# Compiled ONCE, at import. torch.compile on every call (or per thread) builds a fresh wrapper each
# time, which re-runs guard set-up, can race on dynamo's global state when trainer threads compile
# concurrently, and eventually hits the recompile limit, after which flex silently runs its unfused
# eager path (materialising the full score matrix). dynamic=False: the trainer's shapes are fixed
# (padded row length, fixed number of anchors), so one static specialisation per shape is the
# fastest kernel; a shape change is a deliberate, visible recompile (see count_recompiles).
# Nothing compiles until the first CUDA call, but the wrapping imports torch._dynamo (seconds).
_flex = torch.compile(flex_attention, dynamic=False)

def _check_mask_inputs(doc_ids: Tensor, anchors: Tensor, anchor_valid: Tensor,
                       block_size: int) -> tuple[int, int, int]:
    """Validate shapes/dtypes/devices; return (R, S, N). Values are not checked (that would force a
    GPU sync every step); out-of-range indices are clamped inside the mask function instead."""
    for name, t in (("doc_ids", doc_ids), ("anchors", anchors), ("anchor_valid", anchor_valid)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if doc_ids.dtype not in _INT_DTYPES:
        raise TypeError(f"doc_ids must be int32 or int64, got {doc_ids.dtype}")
    if anchors.dtype not in _INT_DTYPES:
        raise TypeError(f"anchors must be int64 (or int32), got {anchors.dtype}")
    if anchor_valid.dtype != torch.bool:
        raise TypeError(f"anchor_valid must be bool, got {anchor_valid.dtype}")
    if anchors.shape != anchor_valid.shape:
        raise ValueError(f"anchors {tuple(anchors.shape)} and anchor_valid {tuple(anchor_valid.shape)} "
                         "must have the same shape [R, N]")
    if doc_ids.shape[0] != anchors.shape[0]:
        raise ValueError(f"doc_ids has {doc_ids.shape[0]} rows but anchors has {anchors.shape[0]}: "
                         "both must be [R, ...]")
    if not (doc_ids.device == anchors.device == anchor_valid.device):
        raise ValueError("doc_ids, anchors, anchor_valid must share a device, got "
                         f"{doc_ids.device}, {anchors.device}, {anchor_valid.device}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    R, S = doc_ids.shape
    N = anchors.shape[1]
    if R < 1 or S < 1 or N < 1:
        raise ValueError(f"need at least one row, context position and block; got R={R}, S={S}, N={N}")
    return R, S, N


def make_mask_mod(doc_ids: Tensor, anchors: Tensor, anchor_valid: Tensor, seq_len: int,
                  block_size: int) -> Callable:
    """The mask function mask_mod(b, h, q_idx, kv_idx) -> bool for rows [doc_ids [R, S], anchors [R, N],
    anchor_valid [R, N]] (rules: module docstring). Tensor ops only: flex traces it with scalar index
    tensors (vmap / Triton), dense_mask calls it with broadcast index tensors."""
    _, S, N = _check_mask_inputs(doc_ids, anchors, anchor_valid, block_size)
    if seq_len != S:
        raise ValueError(f"seq_len={seq_len} but doc_ids has {S} context positions")
    B = block_size

    def mask_mod(b, h, q_idx, kv_idx):
        n = q_idx // B
        # Clamps keep every gather in bounds: flex pads Q and KV to its tile size (128) and evaluates
        # the function there too, and invalid blocks may carry any anchor value (e.g. -1). The
        # comparisons below use the unclamped values, so padding never matches anything it shouldn't.
        n_c = n.clamp(0, N - 1)
        anchor = anchors[b, n_c]
        anchor_c = anchor.clamp(0, S - 1)
        kv_c = kv_idx.clamp(0, S - 1)
        doc_kv = doc_ids[b, kv_c]
        context = (kv_idx < S) & anchor_valid[b, n_c] & (kv_idx < anchor) \
            & (doc_kv == doc_ids[b, anchor_c]) & (doc_kv >= 0)
        own_block = (kv_idx >= S) & ((kv_idx - S) // B == n)
        return context | own_block

    return mask_mod


def dense_mask(doc_ids: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int) -> Tensor:
    """bool [R, 1, N*B, S + N*B] (True = may attend), from make_mask_mod evaluated on broadcast
    indices. O(Q * KV) memory per row: the reference / CPU path, not for long rows on GPU."""
    R, S, N = _check_mask_inputs(doc_ids, anchors, anchor_valid, block_size)
    Q, KV = N * block_size, S + N * block_size
    mod = make_mask_mod(doc_ids, anchors, anchor_valid, S, block_size)
    dev = doc_ids.device
    b = torch.arange(R, device=dev).view(R, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    q = torch.arange(Q, device=dev).view(1, 1, Q, 1)
    kv = torch.arange(KV, device=dev).view(1, 1, 1, KV)
    return mod(b, h, q, kv).expand(R, 1, Q, KV).contiguous()


SPARSE_BLOCK = 128  # flex_attention's default BlockMask tile (queries x keys)


def block_tables(doc_ids: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Which 128 x 128 tiles of the [Q, KV] mask hold any allowed pair and which hold only allowed
    pairs: (any, full), bool [R, ceil(Q/128), ceil(KV/128)], the tables create_block_mask would
    derive from mask_mod, at a fraction of its cost.

    The rules give every query of a block the same row (they read q only through n = q // B), so
    mask_mod is evaluated once per block, at its first query, and over the context keys only:
    [R, N, S] instead of [R, N*B, S + N*B] (the block keys' part is an interval per block). A query
    tile then lists a key tile if any of its blocks allows any key there, and marks it full if all
    of its blocks allow all of them; tiles cut short by the end of Q or KV are never full (create_block_mask pads with False too).
    Checked equal to create_block_mask in tests/test_masks.py."""
    R, S, N = _check_mask_inputs(doc_ids, anchors, anchor_valid, block_size)
    B, T, dev = block_size, SPARSE_BLOCK, doc_ids.device
    Q, KV = N * B, S + N * B
    Tq, Tk = -(-Q // T), -(-KV // T)
    # Allowed keys per (block, key tile), counted in two parts. The context part (kv < S) is the
    # rules evaluated on [R, N, S]; the block part needs no evaluation: block n's own keys are the
    # interval S + n*B .. S + n*B + B - 1, so its count in tile j is that interval's overlap with the
    # tile. (Evaluating the rules over all S + N*B keys cost 9x more at 2048 blocks over 4096
    # context tokens, almost all of it on the block part's diagonal.)
    mod = make_mask_mod(doc_ids, anchors, anchor_valid, S, B)
    b = torch.arange(R, device=dev).view(R, 1, 1)
    h = torch.zeros(1, 1, 1, dtype=torch.long, device=dev)
    first_query = (torch.arange(N, device=dev) * B).view(1, N, 1)
    Tc = -(-S // T)  # key tiles holding context positions
    ctx = mod(b, h, first_query, torch.arange(S, device=dev).view(1, 1, S)).expand(R, N, S)
    ctx_count = F.pad(ctx, (0, Tc * T - S), value=False).view(R, N, Tc, T).sum(-1, dtype=torch.int32)
    count = F.pad(ctx_count, (0, Tk - Tc))  # [R, N, Tk]
    start = S + torch.arange(N, device=dev) * B  # [N]: block n's first key
    lo = torch.arange(Tk, device=dev) * T  # [Tk]: tile j's first key
    own = (torch.minimum(start[:, None] + B, lo[None, :] + T) - torch.maximum(start[:, None], lo[None, :])).clamp_min(0)
    count = count + own.to(torch.int32)[None]
    # A tile cut short by the end of KV is never full (create_block_mask pads with False too).
    block_any = (count > 0).float()
    block_full = ((count == T) & (lo + T <= KV)[None, None, :]).float()  # [R, N, Tk]
    # Query tile t holds queries t*128 .. t*128+127: blocks (t*128)//B .. ((t+1)*128-1)//B.
    t = torch.arange(Tq, device=dev)
    n = torch.arange(N, device=dev)
    first, last = (t * T) // B, torch.clamp(((t + 1) * T - 1) // B, max=N - 1)
    overlap = ((n >= first[:, None]) & (n <= last[:, None])).float()  # [Tq, N]
    # Block counts are small integers, exact in float32: these matmuls are boolean OR / AND.
    any_t = (overlap @ block_any) > 0
    full_t = ((overlap @ block_full) == overlap.sum(-1)[:, None]) & ((t + 1) * T <= Q)[:, None]
    return any_t, full_t


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """bool [R, Tq, Tk] -> (count [R, 1, Tq], indices [R, 1, Tq, Tk]) int32: the listed tiles first,
    in ascending order (BlockMask's layout)."""
    count = tiles.sum(-1, dtype=torch.int32)
    # A stable sort of the negated flags puts listed tiles first and keeps their ascending order.
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def flex_block_mask(doc_ids: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int) -> BlockMask:
    """BlockMask for flex_attention (head-independent: H=1), built on doc_ids.device from
    block_tables and mask_mod, in eager tensor ops.

    Not create_block_mask: it evaluates mask_mod on every (query, key) pair, so eagerly it
    materialises the dense [R, Q, KV] mask, and compiled, its first Triton build took 190 s at
    Q = 8192 x KV = 12,288 on an H200 (30 s at Q = 4096): minutes before the first step on every
    fresh machine and for every new shape. block_tables needs one [R, N, KV] evaluation."""
    any_t, full_t = block_tables(doc_ids, anchors, anchor_valid, block_size)  # validates the inputs
    R, S = doc_ids.shape
    N = anchors.shape[1]
    Q, KV = N * block_size, S + N * block_size
    mod = make_mask_mod(doc_ids, anchors, anchor_valid, S, block_size)
    count, idx = _ordered(any_t & ~full_t)
    full_count, full_idx = _ordered(full_t)
    return BlockMask.from_kv_blocks(count, idx, full_count, full_idx, BLOCK_SIZE=SPARSE_BLOCK, mask_mod=mod,
                                    seq_lengths=(Q, KV))


def attention(q: Tensor, k: Tensor, v: Tensor, mask, scale: float | None = None) -> Tensor:
    """Masked attention: q [R, Hq, Q, D], k/v [R, Hkv, KV, D] (Hq a multiple of Hkv) -> [R, Hq, Q, D].
    `mask` a bool Tensor (dense_mask) -> SDPA; a BlockMask (flex_block_mask) -> flex_attention,
    compiled on CUDA, eager on CPU (forward only there: torch has no flex backward on CPU);
    None -> SDPA without a mask (a drafted block at inference sees every key it is given)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [R, H, L, D], got {got}")
    R, Hq, Q, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    Rk, Hkv, KV, Dk = k.shape
    if Rk != R or Dk != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on rows or head_dim")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if isinstance(mask, BlockMask):
        if tuple(mask.seq_lengths) != (Q, KV) or mask.shape[0] not in (1, R):
            raise ValueError(f"BlockMask shape {tuple(mask.shape)} does not fit q/k ({R} rows, {Q} x {KV})")
        # No silent fallback to dense: if flex cannot run here, the caller should know.
        fn = _flex if q.device.type == "cuda" else flex_attention
        return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=Hq != Hkv)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=Hq != Hkv)
    if isinstance(mask, Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"a Tensor mask must be bool (True = attend), got {mask.dtype}")
        if (mask.dim() != 4 or mask.shape[0] not in (1, R) or mask.shape[1] not in (1, Hq)
                or tuple(mask.shape[2:]) != (Q, KV)):
            raise ValueError(f"mask shape {tuple(mask.shape)} does not fit q/k ({R} rows, {Hq} heads, {Q} x {KV})")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv)
    raise TypeError("mask must be a bool Tensor (dense_mask), a BlockMask (flex_block_mask) or None, "
                    f"got {type(mask).__name__}")


def count_recompiles() -> int:
    """Dynamo recompilations so far in this process: for every compiled frame (code object), the
    compiles beyond its first. Read from dynamo's per-frame compile counter
    (torch._dynamo.convert_frame.FRAME_COMPILE_COUNTER, the `/1`, `/2` in compile ids such as
    [0/1]); torch._dynamo.utils.counters has no recompile entry (only frames total/ok and
    unique_graphs, which also count first compiles). torch._dynamo.reset() clears it."""
    from torch._dynamo import convert_frame

    counter = getattr(convert_frame, "FRAME_COMPILE_COUNTER", None)
    if counter is None:  # a future torch without it: report compiled graphs as an upper bound
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return int(sum(max(0, c - 1) for c in counter.values()))
