"""The DFlash drafter over preallocated buffers: the static decoder's drafter half (the target's is
targets/static.py).

`DrafterBuffers` keeps, per row and position, the DFlash drafter's context keys/values of each
committed position (written where the target's buffers are: a rejected draft's entry is
overwritten before it is read), and a drafted block written at the anchor's positions (bidirectional within the block,
limited to a row's `block_len`: the last round of an output drafts only what it can still commit,
as the reference implementation does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_offline.drafter.model import rope_cos_sin


class DrafterBuffers:
    """The drafter's context keys/values per row and position, and its drafted blocks."""

    def __init__(self, drafter, rows: int, capacity: int):
        self.drafter, cfg = drafter, drafter.cfg
        self.block_size, self.mask_id = cfg.block_size, cfg.mask_token_id
        self.rows, self.capacity = rows, capacity
        self.dtype = drafter.fc.weight.dtype
        dev = drafter.fc.weight.device
        shape = (rows, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in drafter.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in drafter.layers]
        self.steps = torch.arange(cfg.block_size, device=dev)

    def _write(self, i: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        R, Hkv, T, d = k.shape
        where = pos[:, None, :, None].expand(R, Hkv, T, d)
        self.keys[i][:R].scatter_(2, where, k.to(self.dtype))
        self.values[i][:R].scatter_(2, where, v.to(self.dtype))

    def add_context(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        """The target's features [R, T, n*H] at positions pos [R, T] become context there."""
        d = self.drafter
        ctx = d.hidden_norm(d.fc(feats.to(self.dtype)))
        cos, sin = rope_cos_sin(pos, d.cfg.head_dim, d.cfg.rope_theta)
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.context_kv(ctx, cos, sin)
            self._write(i, k, v, pos)

    def draft_logits(self, anchor: torch.Tensor, pos: torch.Tensor, block_len: torch.Tensor) -> torch.Tensor:
        """The block [anchor, MASK x (B-1)] at positions pos.. [R] over the context before pos;
        block_len [R]: how many block tokens exist (>= 2). -> logits [R, B-1, V] (float32)."""
        h = self.draft_hidden(anchor, pos, block_len)
        return F.linear(h[:, 1:], self.drafter.lm_head.weight.to(h.dtype)).float()

    def draft_hidden(self, anchor: torch.Tensor, pos: torch.Tensor, block_len: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states [R, B, H] of the block (draft_logits says which); a
        DSpark drafter's slot j predicts the token after the anchor's j-th successor."""
        d, B = self.drafter, self.block_size
        R = anchor.shape[0]
        block = torch.full((R, B), self.mask_id, dtype=torch.long, device=anchor.device)
        block[:, 0] = anchor
        bpos = pos[:, None] + self.steps
        keys = torch.arange(self.capacity, device=anchor.device)
        visible = (keys[None, :] < pos[:, None]) | ((keys[None, :] >= pos[:, None])
                                                     & (keys[None, :] < (pos + block_len)[:, None]))
        mask = visible[:, None, None, :].expand(R, 1, B, self.capacity)
        x = d.embed_tokens(block).to(self.dtype)
        cos, sin = rope_cos_sin(bpos, d.cfg.head_dim, d.cfg.rope_theta)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            k, v = a.context_kv(h, cos, sin)  # the same projection serves the block
            self._write(i, k, v, bpos)
            x = x + a.attend(h, self.keys[i][:R], self.values[i][:R], cos, sin, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return d.norm(x)
