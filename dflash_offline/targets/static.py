"""The target over preallocated per-row buffers: what eval's static decoder (evaluate/graphed.py)
and generate's continuous batching (generate/continuous.py) run.

Every row of a batch owns positions 0..S-1 of each attention layer's key/value buffer [R, heads,
S, d]; a forward over tokens at positions `pos` [R, T] writes their keys and values at those
positions and attends to every position <= its own. Nothing is cropped or concatenated: a block
written at pos..pos+B-1 whose later tokens are rejected is overwritten by the next block before
any query can see it. Shapes never change within a batch, which is what lets a CUDA graph replay
a round.

`StaticTarget` runs a transformers causal LM's own submodules (embedding, norms, projections,
rotary embedding, MLP, head) in the layer order of its decoder, with grouped-query attention laid
along the query axis (no copy of the keys per query head). Its decoder layers are
"x + mixer(norm(x)); x + mlp(norm(x))", the mixer either full causal attention (optional q/k
norms, biases, and Qwen3.5's output gate) or a Gated DeltaNet layer over per-row state buffers
(targets/recurrent.py: a verify forward leaves the recurrent state as it was, and `settle` moves each
row past the tokens it committed). The registry in targets/families.py says which families run;
`unsupported_reason` says why another target is not one of them (sliding windows, other layer
layouts), and eval then decodes it through transformers' own forward.
"""

from __future__ import annotations

import sys

import torch

from dflash_offline.targets import families
from dflash_offline.targets.attention import grouped_query_attention, one_token_sdpa
from dflash_offline.targets.recurrent import LINEAR_PARTS, GatedDeltaLayer, advance_state, kernels_for
from dflash_offline.targets.fused_step import attention_inputs, attention_output, fuse_projections, pieces

_BESIDE_MIXER = {"mlp", "input_layernorm", "post_attention_layernorm"}  # a layer's other children
_ATTN_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
_MIXERS = {families.FULL: "self_attn", families.LINEAR: "linear_attn"}


def _layer_types(model) -> list[str]:
    """One type per decoder layer (a config that lists none: all full attention)."""
    types = families.layer_types_of(model.config)
    inner = getattr(model, "model", None)
    n = len(inner.layers) if inner is not None and hasattr(inner, "layers") else len(types)
    return types * n if len(types) == 1 else types


def unsupported_reason(model) -> str | None:
    """Why the static decoder cannot run this target (None: it can)."""
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    family = families.family_of(kind)
    if family is None or family.static_decoder is not None:
        # The registry (targets/families.py) says which families have pre-norm mixer + MLP layers
        # (full causal attention or Gated DeltaNet), optional q/k norms and biases, an unscaled embedding.
        runs = [t for f in families.FAMILIES if f.static_decoder is None for t in f.model_types]
        return (f"model type {kind!r} is not one of {', '.join(runs)}"
                + (f" ({family.name}: {family.static_decoder})" if family is not None else ""))
    types = _layer_types(model)
    if not set(types) <= set(_MIXERS):
        return f"its layers include {', '.join(sorted(set(types) - set(_MIXERS)))}"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "it uses sliding-window attention"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "its decoder lacks embed_tokens / layers / norm / rotary_emb"
    for layer, kind_of in zip(inner.layers, types):
        mixer = _MIXERS[kind_of]
        parts = {n for n, _ in layer.named_children()}
        inside = {n for n, _ in getattr(layer, mixer).named_children()} if hasattr(layer, mixer) else set()
        if kind_of == families.FULL:
            fits = {"q_proj", "k_proj", "v_proj", "o_proj"} <= inside <= _ATTN_PARTS
        else:
            fits = inside == LINEAR_PARTS
        if parts != _BESIDE_MIXER | {mixer} or not fits:
            return f"its decoder layer holds {sorted(parts)} / {mixer} {sorted(inside)}"
    return None


def causal_by_position(pos: torch.Tensor, capacity: int, groups: int) -> torch.Tensor:
    """[R, 1, groups*T, S] bool: the query at position pos[r, t] sees key positions <= it."""
    keys = torch.arange(capacity, device=pos.device)
    mask = keys[None, None, :] <= pos[:, :, None]
    return mask[:, None].repeat(1, 1, groups, 1)


class StaticTarget:
    """A target over per-row key/value buffers (attention layers) and window/state buffers (Gated
    DeltaNet layers): the module docstring."""

    def __init__(self, model, layer_ids: list[int], rows: int, capacity: int, fused_step: bool = False):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the static decoder cannot run this target: {reason}")
        cfg = model.config
        self.model, self.inner = model, model.model
        self.layer_ids = list(layer_ids)
        p = next(model.parameters())
        self.rows, self.capacity = rows, capacity
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        types = _layer_types(model)
        attn = next(layer.self_attn for layer, t in zip(self.inner.layers, types) if t == families.FULL)
        self.head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        # Qwen3.5's attention gates its output: q_proj makes a query and a gate per head.
        self.gated = attn.q_proj.out_features == 2 * self.heads * self.head_dim
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        kernels = kernels_for(p.device) if families.LINEAR in types else None
        # Per layer: (keys, values) of an attention layer, or the recurrent layer's buffers.
        self.mixers: list[tuple[torch.Tensor, torch.Tensor] | GatedDeltaLayer] = [
            (torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device))
            if t == families.FULL else GatedDeltaLayer(layer.linear_attn, rows, kernels)
            for layer, t in zip(self.inner.layers, types)]
        self.recurrent = [m for m in self.mixers if isinstance(m, GatedDeltaLayer)]
        # One-token forwards in a dozen kernels a layer (targets/fused_step.py), compiled on a GPU.
        self.maps = self.pieces = None
        self.pieces_compiled = False
        if fused_step and self._step_fits(types):
            self.maps = fuse_projections(self.inner.layers, [t == families.LINEAR for t in types])
            self.use_pieces(compiled=p.device.type == "cuda")

    def use_pieces(self, compiled: bool) -> None:
        self.pieces, self.pieces_compiled = pieces(compiled), compiled

    def _step_fits(self, types: list[str]) -> bool:
        """Whether targets/fused_step.py's pieces can run these layers: a gate/up MLP, a silu convolution."""
        for layer, t in zip(self.inner.layers, types):
            if not all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                return False
            if t == families.LINEAR and layer.linear_attn.activation not in ("silu", "swish"):
                return False
        return True

    def buffers(self) -> list[torch.Tensor]:
        """Every per-row buffer (first dimension: the row)."""
        out = []
        for m in self.mixers:
            out += m.buffers() if isinstance(m, GatedDeltaLayer) else list(m)
        return out

    def copy_rows(self, other: "StaticTarget", m: int, rows: torch.Tensor, length: int) -> None:
        """The first m rows of `other` (the same model) into `rows` of this one: key/value entries of
        positions 0..length-1, the recurrent layers' whole state."""
        for mine, theirs in zip(self.mixers, other.mixers):
            if isinstance(mine, GatedDeltaLayer):
                for a, b in zip(mine.buffers(), theirs.buffers()):
                    a.index_copy_(0, rows, b[:m])
            else:
                for a, b in zip(mine, theirs):
                    a[rows, :, :length] = b[:m, :, :length]

    def reset(self) -> None:
        """Fresh recurrent state for every row (before a prefill; key/value entries need none:
        each is written before any query can see it)."""
        for m in self.recurrent:
            m.reset()

    def settle(self, keep: torch.Tensor) -> None:
        """After a forward with keep=None: each row keeps its first keep[r] tokens in the recurrent layers."""
        for m in self.recurrent:
            m.settle(keep)

    def _attend(self, a, h, pos, cos, sin, mask, keys, values) -> torch.Tensor:
        at = attention_inputs(a, a.q_proj(h), a.k_proj(h), a.v_proj(h), cos, sin, self.head_dim, self.gated, self.rope)
        return attention_output(a, self._attention(at.q, at.k, at.v, pos, mask, keys, values), at.gate)

    def _attention(self, q, k, v, pos, mask, keys, values) -> torch.Tensor:
        """Writes the block's keys and values at their positions, then attends: [R, T, heads * d]."""
        R, _, T, _ = q.shape
        where = pos[:, None, :, None].expand(R, self.kv_heads, T, self.head_dim)
        keys.scatter_(2, where, k.to(keys.dtype))
        values.scatter_(2, where, v.to(values.dtype))
        with one_token_sdpa(q):  # a decode step's kernel (fixed in a CUDA graph at its capture)
            out = grouped_query_attention(q.to(v.dtype), keys, values, mask, self.scale)
        return out.transpose(1, 2).reshape(R, T, -1)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, features: bool, keep: torch.Tensor | None = None,
                span: int | None = None):
        """ids/pos [R, T] (the first R rows of the buffers) -> (final-normed hidden [R, T, H], raw
        layer outputs [R, T, n*H] or None). keep [R]: the recurrent layers move past each row's
        first keep[r] tokens; None: they stay until `settle` (a verify). span: every position is
        below it (a prefill): attention reads only the buffers' first `span` positions."""
        R, T = ids.shape
        S = self.capacity if span is None else span
        x = self.inner.embed_tokens(ids)
        # Qwen3.5's multimodal rotary embedding takes (3, R, T) positions (text: three equal rows);
        # transformers >= 5.18 also takes [R, T], 5.17 does not.
        rope_pos = pos[None].expand(3, R, T) if hasattr(self.inner.rotary_emb, "mrope_section") else pos
        cos, sin = self.inner.rotary_emb(x, rope_pos)
        mask = causal_by_position(pos, S, self.heads // self.kv_heads)
        # One-token forwards that move the recurrent state go through targets/fused_step.py's pieces.
        layer_forward = self._piece_layer if self.pieces is not None and T == 1 and keep is not None \
            else self._plain_layer
        captured = {}
        for i, (layer, mixer) in enumerate(zip(self.inner.layers, self.mixers)):
            x = layer_forward(i, layer, mixer, x, pos, keep, cos, sin, mask, S)
            if features and i in self.layer_ids:
                captured[i] = x
        feats = torch.cat([captured[i] for i in self.layer_ids], -1) if features else None
        return self.inner.norm(x), feats

    def _plain_layer(self, i, layer, mixer, x, pos, keep, cos, sin, mask, S) -> torch.Tensor:
        """Decoder layer i through its own modules: x + mixer(norm(x)), then x + mlp(norm(x))."""
        R = x.shape[0]
        h = layer.input_layernorm(x)
        if isinstance(mixer, GatedDeltaLayer):
            x = x + mixer.forward(h, keep)
        else:
            x = x + self._attend(layer.self_attn, h, pos, cos, sin, mask, mixer[0][:R, :, :S], mixer[1][:R, :, :S])
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _piece_layer(self, i, layer, mixer, x, pos, keep, cos, sin, mask, S) -> torch.Tensor:
        """Decoder layer i through targets/fused_step.py's pieces (the same output)."""
        R, run, maps = x.shape[0], self.pieces, self.maps[i]
        if isinstance(mixer, GatedDeltaLayer):
            a = run.linear_in(layer, x, maps, mixer.window[:R], keep)
            mixer.window[:R].copy_(a.window)
            out = advance_state(a.q, a.k, a.v, a.g, a.beta, mixer.state[:R], mixer.kernels)
            return run.linear_out(layer, x, out, a.z, maps)
        a = run.attn_in(layer, x, maps, cos, sin, self.head_dim, self.gated, self.rope)
        out = self._attention(a.q, a.k, a.v, pos, mask, mixer[0][:R, :, :S], mixer[1][:R, :, :S])
        return run.attn_out(layer, x, out, a.gate, maps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()


