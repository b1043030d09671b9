"""The DFlash drafter: a short Qwen3-style decoder stack that drafts a whole block in one pass.

Context features (n captured target layers, concatenated) are fused once, `hidden_norm(fc(.))`, and
injected into *every* layer as extra keys/values beside the block's own (KV injection); they are
never updated across layers. Token embedding and LM head are the target's, frozen. Layout and
weight names follow the reference inference code (z-lab/dflash `dflash/model.py`), so an export
loads there unchanged (tests/test_reference_parity.py; serving engines: docs/serving.md); see `dflash-method.md`.

The drafter reads the target tensors it starts from here too: the frozen embedding and LM head,
and with `train --init-layers` what fits of target layers (drafter.warm_start plans which tensor
starts which; train's preflight makes the same plan from the headers alone, to refuse a start that
cannot fit before any process starts). The config is drafter.config; the serving export, drafter.export.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.dspark import ConfidenceHead, MarkovHead
from dflash_offline.drafter.warm_start import load_start, plan_start
from dflash_offline.runtime.errors import UserError
from dflash_offline.targets.folder import read_target, target_tensors

log = logging.getLogger("dflash.drafter")

FROZEN_PREFIXES = ("embed_tokens.", "lm_head.")


# ----------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # As Qwen3: normalise in float32 (bf16 loses the mean-square's precision), cast back, then
        # scale; with fp32 master weights the product promotes to float32, as in transformers.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin [..., head_dim] for integer positions; float32 throughout because bf16 cannot
    represent positions (or their angles) beyond a few hundred exactly."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [R, H, L, D]; cos/sin [R, L, D]. Standard rotate-half (GPT-NeoX / Qwen) convention."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (k-normed, rotated at their positions) and values [R, Hkv, L, D] of x [R, L, H]."""
        R, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(R, L, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(R, L, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def attend(self, h: Tensor, k: Tensor, v: Tensor, cos_q: Tensor, sin_q: Tensor, mask) -> Tensor:
        from dflash_offline.drafter.masks import attention

        R, Q, _ = h.shape
        q = self.q_norm(self.q_proj(h).view(R, Q, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos_q, sin_q)
        # q/k come out of an fp32-weighted norm while v is the projection's (autocast) dtype;
        # attention kernels want one dtype.
        out = attention(q.to(v.dtype), k.to(v.dtype), v, mask, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.n_heads * self.head_dim))

    def forward(self, h: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, mask) -> Tensor:
        """Training: all blocks of a row at once over [context | blocks], `mask` says who sees what."""
        Q = h.shape[1]
        # One projection over [context | block]: the same k/v weights serve both streams (KV
        # injection). The context arrives as hidden_norm(fc(.)), *not* through input_layernorm,
        # exactly as in the reference, where only the block stream is normed by the layer.
        # Keys rotate at their own positions (context keeps its absolute positions); queries at
        # the block's, the last Q entries of the joint position list.
        k, v = self._kv(torch.cat([ctx.to(h.dtype), h], dim=1), cos, sin)
        return self.attend(h, k, v, cos[:, -Q:], sin[:, -Q:], mask)

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Inference: the keys/values the context contributes to this layer. They depend on the
        fused features alone (never on the layer's input), so they are computed once per committed
        position and cached."""
        return self._kv(ctx, cos, sin)

    def draft(self, h: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor,
              ctx_mask: Tensor | None = None, block_len: Tensor | None = None) -> Tensor:
        """Inference: one block over the cached context. Every cached position lies before the
        anchor and the block is bidirectional, so no mask is needed; a batched decoder whose cache
        has unused slots (rejected drafts, padding) passes `ctx_mask` [R, S] (True = a context
        position), and one whose rows' blocks are shorter than the block (an output's last round)
        passes `block_len` [R]: block positions from there on are not keys."""
        k, v = self._kv(h, cos, sin)
        mask = None
        if ctx_mask is not None or block_len is not None:
            R, Q = h.shape[0], h.shape[1]
            ctx = ctx_mask if ctx_mask is not None else torch.ones(R, ctx_k.shape[2], dtype=torch.bool, device=h.device)
            own = (torch.arange(Q, device=h.device)[None, :] < block_len[:, None] if block_len is not None
                   else ctx.new_ones(R, Q))
            mask = torch.cat([ctx, own], dim=1)[:, None, None, :].expand(R, 1, Q, -1)
        return self.attend(h, torch.cat([ctx_k, k.to(ctx_k.dtype)], dim=2), torch.cat([ctx_v, v.to(ctx_v.dtype)], dim=2),
                            cos, sin, mask)


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, mask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def draft(self, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor,
              ctx_mask: Tensor | None = None, block_len: Tensor | None = None) -> Tensor:
        x = x + self.self_attn.draft(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, ctx_mask, block_len)
        return x + self.mlp(self.post_attention_layernorm(x))


def _run_layer(layer: DFlashLayer, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, mask) -> Tensor:
    return layer(x, ctx, cos, sin, mask)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self._compiled_layer = None  # compile_layers(): the training forward's fused layer
        n, h = len(cfg.target_layer_ids), cfg.hidden_size
        self.fc = nn.Linear(n * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # Placeholders until load_frozen_from_target; bf16 halves a 250K x 5K table's memory.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h, dtype=torch.bfloat16)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False, dtype=torch.bfloat16)
        # DSpark's heads (drafter/dspark.py), where the config asks for them.
        self.markov_head = self.confidence_head = None
        if cfg.markov_rank:
            self.markov_head = MarkovHead(cfg.vocab_size, h, cfg.markov_rank, cfg.markov_head_type)
        if cfg.confidence_head:
            self.confidence_head = ConfidenceHead(h, cfg.markov_rank)
        for name, p in self.named_parameters():
            if name.startswith(FROZEN_PREFIXES):
                p.requires_grad_(False)
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)  # transformers' Qwen3 init (initializer_range)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)  # the heads' biases, as transformers' init

    # -- parameters ------------------------------------------------------------------------------

    def compile_layers(self, backend: str = "inductor") -> None:
        """Run each decoder layer of the *training* forward through one compiled function (static
        shapes; all layers share its graph, their weights are its inputs). Eager, a small drafter's
        step is bound by unfused elementwise kernels (norms, RoPE, SiLU x up, casts); Inductor fuses
        them with the flex kernels. Inference (eval, the held-out walk) and no-grad calls keep the
        uncompiled module: their shapes change every call."""
        self._compiled_layer = torch.compile(_run_layer, dynamic=False, backend=backend)

    def init_layers_from_target(self, target_dir: str, init_layers: list[int]) -> None:
        """Start drafter layer i from target layer init_layers[i]: every tensor of a dense Qwen3-like
        target's layer, what fits of a hybrid's (drafter.warm_start); the rest keep their random
        start. The target's layers already hold the circuits a drafter needs (previous-token and
        copying heads, the MLPs' token features), which a random start must rediscover."""
        plan = plan_start(target_dir, init_layers, self.cfg)
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, t in load_start(plan).items():
                params[name].copy_(t.to(device=params[name].device, dtype=params[name].dtype))
        log.info(plan.summary())

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith(FROZEN_PREFIXES)]

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The export names: the module tree mirrors the reference's, minus the frozen parts."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(FROZEN_PREFIXES)}

    def load_frozen_from_target(self, target_dir: str, option: str = "--target") -> None:
        """Copy the target's embedding and LM head (exactly, in the checkpoint's dtype) from its
        safetensors; no other tensor is read and the target model is never built. `option`: how a
        message names the target folder (the flag, or the recipe key and file it came from)."""
        info = read_target(target_dir)
        want = {"model.embed_tokens.weight"} | (set() if info.tie_word_embeddings else {"lm_head.weight"})
        found = {name: sf.get_tensor(key) for name, sf, key in target_tensors(info, want)}
        missing = sorted(want - found.keys())
        if missing:
            raise UserError(f"{option} {target_dir}: no {missing} in its safetensors")
        expected = (self.cfg.vocab_size, self.cfg.hidden_size)
        for name, t in found.items():
            if tuple(t.shape) != expected:
                raise UserError(f"{option} {target_dir}: {name} has shape {tuple(t.shape)}, the drafter expects {expected}")
        embed = found["model.embed_tokens.weight"]
        # Tied: a copy, not a shared Parameter, so the two stay independent tensors in state_dict.
        head = embed.clone() if info.tie_word_embeddings else found["lm_head.weight"]
        device = self.fc.weight.device
        self.embed_tokens.weight = nn.Parameter(embed.to(device), requires_grad=False)
        self.lm_head.weight = nn.Parameter(head.to(device), requires_grad=False)
        log.info("frozen embedding and LM head loaded from %s (%s, tied %s)", info.path, embed.dtype,
                 info.tie_word_embeddings)

    @staticmethod
    def meta(cfg: DrafterConfig) -> "DFlashDrafter":
        """A drafter without storage: its parameter names and shapes."""
        with torch.device("meta"):
            return DFlashDrafter(cfg)

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, target_hidden: Tensor, block_ids: Tensor, ctx_positions: Tensor, block_positions: Tensor,
                mask) -> Tensor:
        """-> [R, Q, H] final-normed hidden states of the block queries (no LM head)."""
        cfg = self.cfg
        if target_hidden.dim() != 3 or not target_hidden.is_floating_point():
            raise ValueError(f"target_hidden must be a float [R, S, n*H] tensor, got {target_hidden.dtype} {tuple(target_hidden.shape)}")
        R, S, width = target_hidden.shape
        if width != self.fc.in_features:
            raise ValueError(f"target_hidden has {width} features; {len(cfg.target_layer_ids)} layers x "
                             f"{cfg.hidden_size} = {self.fc.in_features} expected")
        for name, t, length in (("block_ids", block_ids, None), ("ctx_positions", ctx_positions, S),
                                ("block_positions", block_positions, None)):
            if t.dim() != 2 or t.dtype.is_floating_point or t.dtype == torch.bool or t.shape[0] != R:
                raise ValueError(f"{name} must be an integer [R={R}, .] tensor, got {t.dtype} {tuple(t.shape)}")
            if length is not None and t.shape[1] != length:
                raise ValueError(f"{name} has {t.shape[1]} positions, target_hidden {length}")
        Q = block_ids.shape[1]
        if block_positions.shape[1] != Q or Q == 0:
            raise ValueError(f"block_positions {tuple(block_positions.shape)} must match block_ids {tuple(block_ids.shape)}")
        if isinstance(mask, Tensor) and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2:] != (Q, S + Q)
                                         or mask.shape[0] not in (1, R) or mask.shape[1] != 1):
            raise ValueError(f"mask must be bool [R, 1, {Q}, {S + Q}], got {mask.dtype} {tuple(mask.shape)}")

        dtype = self.fc.weight.dtype
        # Under autocast the matmul casts anyway; an explicit cast of [R, S, n*H] to fp32 would
        # only double the largest input. Without autocast, Linear needs matching dtypes.
        if not torch.is_autocast_enabled(target_hidden.device.type):
            target_hidden = target_hidden.to(dtype)
        ctx = self.hidden_norm(self.fc(target_hidden))
        # The residual stream starts in the trainable dtype, whatever the frozen table's dtype.
        x = self.embed_tokens(block_ids).to(dtype)
        cos, sin = rope_cos_sin(torch.cat([ctx_positions, block_positions], dim=1), cfg.head_dim, cfg.rope_theta)
        run = _run_layer
        if self._compiled_layer is not None and self.training and torch.is_grad_enabled():
            run = self._compiled_layer
            # The embedding is frozen, so the first layer's input alone would not require grad: a
            # second graph (a recompile). A leaf that does costs one unused [R, Q, H] gradient.
            x = x.detach().requires_grad_()
        for layer in self.layers:
            x = run(layer, x, ctx, cos, sin, mask)
        return self.norm(x)


    # -- inference (speculative decoding) ---------------------------------------------------------

    @torch.no_grad()
    def context_kv(self, target_hidden: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer, the (keys, values) [R, Hkv, T, D] that T newly committed positions add to the
        drafter's context: target_hidden [R, T, n*H] (raw layer outputs), positions [R, T]. A
        decoder appends them along dim 2 as tokens are committed (see evaluate.speculative.DFlashProposer)."""
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        return [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    @torch.no_grad()
    def draft_hidden(self, kv: list[tuple[Tensor, Tensor]], block_ids: Tensor, block_positions: Tensor,
                     ctx_mask: Tensor | None = None, block_len: Tensor | None = None) -> Tensor:
        """Final-normed hidden states [R, B, H] of one block [anchor, MASK x (B-1)] over the cached
        context `kv` (every cached position precedes the anchor; `ctx_mask` [R, S], if given, says
        which cached slots hold context; `block_len` [R], if given, how many block tokens each row
        has: a block cut short, as the reference drafts an output's last round). Equal to the training forward of the same block under
        the training mask (tests/test_evaluate.py)."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = rope_cos_sin(block_positions, self.cfg.head_dim, self.cfg.rope_theta)
        for layer, (k, v) in zip(self.layers, kv):
            x = layer.draft(x, k, v, cos, sin, ctx_mask, block_len)
        return self.norm(x)
