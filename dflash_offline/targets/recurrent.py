"""Gated DeltaNet layers over per-row state buffers: the static decoder's hybrid half (Qwen3.5/3.6).

A Gated DeltaNet layer keeps two things per row instead of keys and values per position: the last
K-1 inputs of its short causal convolution (the *window*) and a [heads, d_k, d_v] matrix (the
*state*) that every token updates, S <- exp(g) S + beta k (v - S^T k)^T. Neither can be cut back
to a shorter length once a token is in, which is why a cropped cache leaves rejected drafts in the
recurrent state (transformers issue 49036; the public reference's decoder inherits it).

So a verify forward never writes the buffers. It reads them, computes the block's outputs, and
keeps the layer's inputs of the block (the convolution's input rows and q, k, v, g, beta): what
the recurrence needs to be replayed. `settle(n)` then puts each row at the end of its first n[r]
tokens: the recurrence runs again from the unchanged state over the block with g = 0 and beta = 0
beyond n[r] (an update with beta = 0 and g = 0 leaves the state exactly as it was), and the window
becomes the K-1 convolution inputs ending at token n[r]. This is the layer inputs replayed over the
accepted prefix: no second forward of the model, one more pass of the recurrence, and no
per-position copies of the state (a 27B target's state is 3 MB a row and layer; a copy per draft
position would be 2.4 GB a row). The prefill uses the same masking directly (right-padded prompts:
the state passes the padding unchanged), as do one-token rounds (rows still decoding keep their
token, finished ones none).

On a GPU the recurrence is flash-linear-attention's fused recurrent kernel (chunked for long
prompts) when it is installed; elsewhere, and as the reference the kernels are tested against, a
loop over the tokens in fp32, the same arithmetic as transformers' `torch_recurrent_gated_delta_rule`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from dflash_offline.targets.families import LAYER_KINDS, LINEAR

log = logging.getLogger("dflash.eval")

LINEAR_PARTS = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj"}
_CHUNKED_FROM = 64  # tokens: longer forwards (prefills) take the chunked kernel


class StateTile(NamedTuple):
    """How the in-place kernel shares out a head's [d_k, d_v] state: each program holds all d_k rows
    of `values` columns and runs on `warps` warps. fla's own call uses 8 x 1."""
    values: int
    warps: int

    @classmethod
    def parse(cls, text: str) -> "StateTile":
        """'32x4' -> StateTile(32, 4)."""
        values, warps = (int(x) for x in text.lower().split("x"))
        return cls(values, warps)

    def __str__(self) -> str:
        return f"{self.values}x{self.warps}"


# 64 columns on 4 warps: at the Qwen3.5-27B shape (128 x 128 heads) the kernel moved 64 rows' state
# in 6.42 ms a step against 7.88 at fla's 8 x 1 (H100; 16x2 7.28, 32x4 7.50, 128x4 and the 8-warp
# tiles slower), and was no slower at 1 and 32 rows (docs/benchmarks.md).
IN_PLACE_TILE = StateTile(64, 4)


class Kernels(NamedTuple):
    chunked: Callable  # fla's chunk_gated_delta_rule (long blocks: prefills)
    fused: Callable  # fla's fused_recurrent_gated_delta_rule (a few tokens)
    in_place: Callable | None  # fla's fused recurrent kernel launched with the state as its own output


def _fla() -> Kernels | None:
    """flash-linear-attention's gated-delta-rule kernels, or None when it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # not installed, or broken against this torch/triton
        return None
    kernel = None
    try:
        # The launch below follows fla 0.6's kernel (a 1-D grid); 0.5's takes the same arguments on
        # a 2-D grid and would silently update one head: only 0.6 and later get the in-place path.
        major, minor = (int(x) for x in importlib.metadata.version("fla-core").split(".")[:2])
        if (major, minor) >= (0, 6):
            from fla.ops.gated_delta_rule.fused_recurrent import (
                fused_recurrent_gated_delta_rule_fwd_kernel as kernel)
    except Exception:  # another layout or no version: the allocating call and a copy
        kernel = None
    return Kernels(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                   None if kernel is None else _in_place_launcher(kernel))


def _in_place_launcher(kernel):
    """The fused recurrent kernel writing the final state over the initial one. Each program loads
    its slice of the state once before the tokens and stores it once after them, so the two may be
    the same memory: a decode step then reads and writes the state once (the library's call writes
    a new tensor, and copying it back costs another read and write of what, on a 27B hybrid, is
    150 MB a row)."""
    import triton

    def run(q, k, v, g, beta, state):
        R, T, H, K = k.shape
        HV, V = v.shape[2], v.shape[3]
        BV = min(IN_PLACE_TILE.values, triton.next_power_of_2(V))
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        o = torch.empty_like(v)
        kernel[(triton.cdiv(V, BV) * R * HV,)](
            q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=None, dt_bias=None, o=o, h0=state, ht=state,
            cu_seqlens=None, scale=K ** -0.5, T=T, H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
            IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=True, APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False,
            STATE_V_FIRST=False, num_warps=IN_PLACE_TILE.warps, num_stages=3)
        return o

    return run


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) l2norm of q and k along the head dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrence_loop(q, k, v, g, beta, state):
    """The gated delta rule token by token in fp32. q, k [R, T, Hk, dk]; v [R, T, Hv, dv]; g, beta
    [R, T, Hv]; state [R, Hv, dk, dv] (not modified) -> (outputs [R, T, Hv, dv], final state)."""
    Hk, Hv = k.shape[2], v.shape[2]
    if Hv != Hk:  # grouped value heads: each key head serves Hv / Hk consecutive value heads
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # [R, Hv, T, ...]
    q, k = l2norm(q), l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    s = state.float()
    out = torch.empty_like(v)
    for t in range(v.shape[2]):
        s = s * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (s * k_t[..., None]).sum(-2)) * beta[:, :, t][..., None]
        s = s + k_t[..., None] * delta[..., None, :]
        out[:, :, t] = (s * q[:, :, t][..., None]).sum(-2)
    return out.transpose(1, 2), s


def recurrence(q, k, v, g, beta, state, kernels, final: bool = True):
    """The gated delta rule over a block from `state`: fla's kernels on CUDA when given, else the
    loop. -> (outputs, final state, or None where `final` is False and a kernel ran)."""
    if kernels is None or q.device.type != "cuda":
        return recurrence_loop(q, k, v, g, beta, state)
    run = kernels.chunked if q.shape[1] >= _CHUNKED_FROM else kernels.fused
    out, last = run(q, k, v, g=g, beta=beta, initial_state=state.float().contiguous(), output_final_state=final,
                    use_qk_l2norm_in_kernel=True)
    return out.float(), last


def advance_state(q, k, v, g, beta, state: torch.Tensor, kernels) -> torch.Tensor:
    """The gated delta rule over a block, `state` [R, Hv, dk, dv] (fp32, contiguous) moved to its
    end in place; -> the outputs."""
    if kernels is not None and kernels.in_place is not None and q.device.type == "cuda" \
            and q.shape[1] < _CHUNKED_FROM and state.is_contiguous():
        return kernels.in_place(q, k, v, g, beta, state).float()
    out, final = recurrence(q, k, v, g, beta, state, kernels)
    state.copy_(final)
    return out


def gates(m, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's decay g (fp32, log space) and write strength beta from its b and a projections."""
    return -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias), b.sigmoid()


def keep_first(g: torch.Tensor, beta: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g and beta [R, T, Hv] zeroed past each row's first keep[r] tokens: the state passes them unchanged."""
    kept = torch.arange(g.shape[1], device=g.device)[None, :] < keep[:, None]  # [R, T]
    return g * kept[..., None], beta * kept[..., None].to(beta.dtype)


def window_ending_at(x: torch.Tensor, keep: torch.Tensor, K: int) -> torch.Tensor:
    """The K-1 convolution inputs ending at each row's token keep[r]: x [R, K-1+T, C] holds the old
    window then the block, so they are rows keep[r] .. keep[r] + K-2."""
    at = keep[:, None] + torch.arange(K - 1, device=x.device)[None, :]
    return x.gather(1, at[..., None].expand(x.shape[0], K - 1, x.shape[-1]))


def gated_output(m, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The recurrence's output [R, T, Hv, dv] through the layer's gated norm (gate z [R, T, Hv*dv])
    and its output projection."""
    R, T = out.shape[:2]
    normed = m.norm(out.to(dtype).reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(R, T, -1)
    return m.out_proj(normed)


class GatedDeltaLayer:
    """One Gated DeltaNet layer of a transformers Qwen3.5 decoder over per-row window and state
    buffers (module docstring): `forward` for a block, `settle` to keep each row's first n tokens."""

    def __init__(self, module, rows: int, kernels):
        from transformers.activations import ACT2FN

        self.m, self.kernels = module, kernels
        self.act = ACT2FN[module.activation]
        self.K = module.conv1d.kernel_size[0]
        self.split = [module.key_dim, module.key_dim, module.value_dim]
        w = module.conv1d.weight
        self.window = torch.zeros((rows, self.K - 1, module.conv_dim), dtype=w.dtype, device=w.device)
        self.state = torch.zeros((rows, module.num_v_heads, module.head_k_dim, module.head_v_dim), dtype=torch.float32,
                                 device=w.device)
        self._pending = None  # the last deferred block's inputs: (conv inputs, q, k, v, g, beta)

    def buffers(self) -> list[torch.Tensor]:
        return [self.window, self.state]

    def reset(self) -> None:
        self.window.zero_()
        self.state.zero_()

    def forward(self, h: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """h [R, T, H]: the layer's normed input for the first R rows -> its output [R, T, H].
        keep [R]: the state moves past each row's first keep[r] tokens now; None: the buffers stay
        as they are until `settle`."""
        m = self.m
        R, T, _ = h.shape
        mixed = m.in_proj_qkv(h).to(self.window.dtype)
        x = torch.cat([self.window[:R], mixed], 1)  # [R, K-1+T, C]: the convolution's inputs
        conv = F.conv1d(x.transpose(1, 2), m.conv1d.weight, m.conv1d.bias, groups=x.shape[-1])
        conv = self.act(conv).to(h.dtype).transpose(1, 2)
        q, k, v = torch.split(conv, self.split, dim=-1)
        q = q.reshape(R, T, -1, m.head_k_dim)
        k = k.reshape(R, T, -1, m.head_k_dim)
        v = v.reshape(R, T, -1, m.head_v_dim)
        g, beta = gates(m, m.in_proj_b(h), m.in_proj_a(h))
        if keep is None:
            out, _ = recurrence(q, k, v, g, beta, self.state[:R], self.kernels, final=False)
            self._pending = (x, q, k, v, g, beta)
        else:
            out = self._advance(x, q, k, v, g, beta, keep)
        return gated_output(m, out, m.in_proj_z(h), h.dtype)

    def _advance(self, x, q, k, v, g, beta, keep: torch.Tensor) -> torch.Tensor:
        """Runs the block with g and beta zeroed past each row's keep[r] tokens, writes the final
        state and the window of convolution inputs ending at token keep[r]; -> the block's outputs
        (exact up to token keep[r])."""
        R = g.shape[0]
        out = advance_state(q, k, v, *keep_first(g, beta, keep), self.state[:R], self.kernels)
        self.window[:R].copy_(window_ending_at(x, keep, self.K))
        return out

    def settle(self, keep: torch.Tensor) -> None:
        """After a deferred forward: each row of it keeps its first keep[r] tokens (0: unchanged)."""
        if self._pending is None:
            raise RuntimeError("settle() without a deferred forward before it")
        self._advance(*self._pending, keep)
        self._pending = None


def kernels_for(device: torch.device):
    """The recurrence kernels this device runs: fla's on CUDA when installed (a warning when not)."""
    if device.type != "cuda":
        return None
    kernels = _fla()
    if kernels is None:
        _warn_no_fla()
    return kernels


@functools.cache
def _warn_no_fla() -> None:
    """Once a process (a decoder builds two static targets: its slots and its staging rows)."""
    fla = next(k for k in LAYER_KINDS[LINEAR].kernels if k.module == "fla")
    log.warning("%s is not installed: the Gated DeltaNet layers run a token-by-token PyTorch loop (slow); %s",
                fla.package, fla.install)
