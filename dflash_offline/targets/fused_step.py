"""The one-token step of a static target in few kernels, for generate's continuous decoder
(`generate --step fused`, the default; `ContinuousDecoder(fused_step=False)` / `--step plain` runs the
layers' own modules: benchmarks/generate_throughput.py shape27b times both side by side).

A decode step of a large target should cost the bytes it must read (every weight once, the
recurrent states and the attention cache). Measured at the Qwen3.5-27B shape on one H100, the
step as the layers' own modules run it cost 35 ms at 32 rows against a bound of 15 ms, although the
whole step was one CUDA graph. Profiled on an H200, that step launched 4,820 kernels (a Gated
DeltaNet layer about 55, most of them elementwise on a few rows: norms in six kernels each, four
projections where one would do, the gates, the convolution window's gather), each holding the GPU
for a few microseconds however small. Run as below: 1,348 kernels, 20.0 ms a step against 29.5.

So the step runs here in four pieces a layer, each compiled once (torch.compile, static shapes)
and then replayed inside the decoder's CUDA graph:
- `linear_in` / `attn_in`: the input norm, ONE projection (the layer's input projections
  concatenated, `fuse_projections`), then what comes before the recurrence or the attention (the
  short convolution, the gates; q/k norms and the rotary embedding);
- the recurrence (flash-linear-attention's kernel, writing the state in place) or the attention
  over the key/value buffers, as in the plain forward;
- `linear_out` / `attn_out`: the output norm or gate, the output projection, the residual, the MLP
  (gate and up projections concatenated) and its residual.
That is about a dozen kernels a layer. The pieces call the layers' own modules (norms, activation,
rotary embedding), so each family keeps its own arithmetic; compiled, the elementwise work is
fused (rounding may differ from the modules' eager kernels in the last bit, as between two batch
shapes). On a CPU the same pieces run uncompiled: the tests check their arithmetic there.

The concatenated projections cost no memory: each module's weight becomes a view of its rows of
the concatenated matrix, so the modules still run the plain forward (prefills, eval) unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from dflash_offline.targets.recurrent import gated_output, gates, keep_first, window_ending_at


class Fused(NamedTuple):
    """Several linear maps of one input as one: y.split(sizes, -1) gives each map's output."""

    weight: torch.Tensor  # [sum(sizes), in]
    bias: torch.Tensor | None
    sizes: tuple[int, ...]


def project(f: Fused, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return F.linear(h, f.weight, f.bias).split(list(f.sizes), -1)


class LayerMaps(NamedTuple):
    """One decoder layer's concatenated input projections."""

    mixer: Fused  # attention: q (with its gate), k, v; Gated DeltaNet: qkv, z, b, a
    mlp: Fused  # gate, up


def _fuse(linears: list) -> Fused:
    """One matrix for these nn.Linear (same input), each module's weight (and bias) then a view of it."""
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        has_bias = [m.bias is not None for m in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("cannot concatenate linear maps with and without a bias")
        bias = torch.cat([m.bias for m in linears]) if all(has_bias) else None
        at = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = weight[at:at + n]
            if bias is not None:
                m.bias.data = bias[at:at + n]
            at += n
    return Fused(weight, bias, tuple(m.weight.shape[0] for m in linears))


def fuse_projections(layers, linear: list[bool]) -> list[LayerMaps]:
    """Each layer's input projections concatenated (linear[i]: layer i is Gated DeltaNet), once per
    model: a second call (a decoder's staging target) returns the first call's maps."""
    done = getattr(layers, "_dflash_maps", None)
    if done is not None:
        return done
    maps = []
    for layer, is_linear in zip(layers, linear):
        if is_linear:
            m = layer.linear_attn
            mixer = _fuse([m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a])
        else:
            a = layer.self_attn
            mixer = _fuse([a.q_proj, a.k_proj, a.v_proj])
        maps.append(LayerMaps(mixer, _fuse([layer.mlp.gate_proj, layer.mlp.up_proj])))
    layers._dflash_maps = maps  # a plain attribute of the ModuleList: not a parameter or a buffer
    return maps


def _mlp_block(layer, x: torch.Tensor, maps: LayerMaps) -> torch.Tensor:
    gate, up = project(maps.mlp, layer.post_attention_layernorm(x))
    return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)


class LinearInputs(NamedTuple):
    """What a Gated DeltaNet layer's recurrence takes for one block, and what its output needs."""

    q: torch.Tensor  # [R, T, Hk, dk], contiguous (as are k, v, g, beta)
    k: torch.Tensor
    v: torch.Tensor  # [R, T, Hv, dv]
    g: torch.Tensor  # [R, T, Hv] fp32, zero past each row's kept tokens
    beta: torch.Tensor  # [R, T, Hv], zero past each row's kept tokens
    z: torch.Tensor  # [R, T, Hv * dv]: the output norm's gate
    window: torch.Tensor  # [R, K-1, C]: the convolution inputs ending at each row's last kept token


def linear_in(layer, x: torch.Tensor, maps: LayerMaps, window: torch.Tensor, keep: torch.Tensor) -> LinearInputs:
    """A Gated DeltaNet layer before its recurrence (targets/recurrent.py, GatedDeltaLayer.forward
    and _advance, in one piece): x [R, T, H] the residual stream, window [R, K-1, C] the rows'
    convolution windows, keep [R] the tokens each row keeps."""
    m = layer.linear_attn
    R, T, _ = x.shape
    mixed, z, b, a = project(maps.mixer, layer.input_layernorm(x))
    K = m.conv1d.kernel_size[0]
    xs = torch.cat([window, mixed.to(window.dtype)], 1)  # [R, K-1+T, C]
    # The depthwise causal convolution as K products summed in fp32 (what a conv kernel accumulates).
    taps = xs.unfold(1, K, 1).float() * m.conv1d.weight[:, 0, :].float()  # [R, T, C, K]
    conv = taps.sum(-1) + (0 if m.conv1d.bias is None else m.conv1d.bias.float())
    conv = F.silu(conv).to(x.dtype)  # (StaticTarget takes this path only for a silu convolution)
    q, k, v = torch.split(conv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    g, beta = keep_first(*gates(m, b, a), keep)
    return LinearInputs(q.reshape(R, T, -1, m.head_k_dim).contiguous(), k.reshape(R, T, -1, m.head_k_dim).contiguous(),
                        v.reshape(R, T, -1, m.head_v_dim).contiguous(), g.contiguous(), beta.contiguous(), z,
                        window_ending_at(xs, keep, K))


def linear_out(layer, x: torch.Tensor, out: torch.Tensor, z: torch.Tensor, maps: LayerMaps) -> torch.Tensor:
    """A Gated DeltaNet layer after its recurrence (out [R, T, Hv, dv]), then the MLP: the next x."""
    return _mlp_block(layer, x + gated_output(layer.linear_attn, out, z, x.dtype), maps)


class AttentionInputs(NamedTuple):
    q: torch.Tensor  # [R, heads, T, d]
    k: torch.Tensor  # [R, kv_heads, T, d]
    v: torch.Tensor
    gate: torch.Tensor | None  # [R, T, heads * d] (Qwen3.5's output gate), or None


def attn_in(layer, x: torch.Tensor, maps: LayerMaps, cos, sin, head_dim: int, gated: bool,
            rope: Callable) -> AttentionInputs:
    """An attention layer before its attention, its q/k/v in one projection."""
    q, k, v = project(maps.mixer, layer.input_layernorm(x))
    return attention_inputs(layer.self_attn, q, k, v, cos, sin, head_dim, gated, rope)


def attention_inputs(a, q, k, v, cos, sin, head_dim: int, gated: bool, rope: Callable) -> AttentionInputs:
    """The attention module a's projections q, k, v [R, T, *] as heads: the output gate split off
    (Qwen3.5: q_proj makes a query and a gate per head), q/k norms, the rotary embedding."""
    R, T, _ = q.shape
    q = q.view(R, T, -1, head_dim * (2 if gated else 1))
    gate = None
    if gated:
        q, gate = torch.chunk(q, 2, dim=-1)
        gate = gate.reshape(R, T, -1)
    k = k.view(R, T, -1, head_dim)
    if hasattr(a, "q_norm"):
        q, k = a.q_norm(q), a.k_norm(k)
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return AttentionInputs(q, k, v.view(R, T, -1, head_dim).transpose(1, 2), gate)


def attn_out(layer, x: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None, maps: LayerMaps) -> torch.Tensor:
    """An attention layer after its attention (out [R, T, heads * d]), then the MLP: the next x."""
    return _mlp_block(layer, x + attention_output(layer.self_attn, out, gate), maps)


def attention_output(a, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The attention's output [R, T, heads * d] through its gate (if any) and output projection."""
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return a.o_proj(out)


class Pieces(NamedTuple):
    linear_in: Callable
    linear_out: Callable
    attn_in: Callable
    attn_out: Callable


@functools.cache
def pieces(compiled: bool) -> Pieces:
    """The four pieces, compiled once a process (static shapes; one graph per batch size serves
    every layer: the layers' parameters are the compiled graph's inputs, not its constants) or as
    they are."""
    plain = Pieces(linear_in, linear_out, attn_in, attn_out)
    if not compiled:
        return plain
    return Pieces(*(torch.compile(f, dynamic=False, fullgraph=True) for f in plain))
