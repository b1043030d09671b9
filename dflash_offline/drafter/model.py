"""The DFlash drafter: a short Qwen3-style decoder stack that drafts a whole block in one pass.

Context features (n captured target layers, concatenated) are fused once, `hidden_norm(fc(.))`, and
injected into *every* layer as extra keys/values beside the block's own (KV injection); they are
never updated across layers. Token embedding and LM head are the target's, frozen. Layout and
weight names follow the reference inference code (z-lab/dflash `dflash/model.py`), so an export
loads there and in the serving engines unchanged; see `dflash-method.md`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.paths import ordinary_mode
from dflash_offline.target.folder import checkpoint_name, read_target

log = logging.getLogger("dflash.drafter")

FROZEN_PREFIXES = ("embed_tokens.", "lm_head.")
EXPORT_CONFIG = "config.json"
EXPORT_WEIGHTS = "model.safetensors"


# ----------------------------------------------------------------------------------------------
# Configuration


def _rope_theta(text: dict) -> float:
    """rope_theta of a (text) config: top level (transformers 4), or inside `rope_parameters` /
    `rope_scaling` (transformers 5), possibly keyed per layer type."""
    if text.get("rope_theta") is not None:
        return float(text["rope_theta"])
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key) or {}
        if isinstance(params.get("full_attention"), dict):  # per-layer-type form
            params = params["full_attention"]
        if params.get("rope_theta") is not None:
            if params.get("rope_type", "default") != "default":
                log.warning("target uses %s RoPE scaling; the drafter uses plain RoPE", params["rope_type"])
            return float(params["rope_theta"])
    return 10000.0  # transformers' default for Qwen-family configs


def _mask_token_from_tokenizer(root: Path) -> int | None:
    """The mask token's id from the tokenizer files, or None when the tokenizer declares none."""
    return _mask_id(*_tokenizer_vocab(root)[:2])


def _mask_id(declared_names: list, vocab: dict[str, int]) -> int | None:
    for declared in declared_names:
        if declared and declared in vocab:
            return vocab[declared]
    return vocab.get("<|MASK|>")


def _tokenizer_vocab(root: Path) -> tuple[list, dict[str, int], dict[int, str]]:
    """(declared mask token names, content -> id, id -> content of the added/special tokens)."""

    def load(name: str) -> dict:
        p = root / name
        try:
            return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
        except json.JSONDecodeError as e:
            raise UserError(f"{p}: not valid JSON ({e})") from None

    tok_cfg, special, tok_json = load("tokenizer_config.json"), load("special_tokens_map.json"), load("tokenizer.json")
    vocab: dict[str, int] = {}  # content -> id, from every place a tokenizer lists added tokens
    model_vocab = (tok_json.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab.update({str(k): int(v) for k, v in model_vocab.items()})
    for t in tok_json.get("added_tokens") or []:
        vocab[str(t.get("content"))] = int(t["id"])
    for i, t in (tok_cfg.get("added_tokens_decoder") or {}).items():
        vocab[str(t.get("content") if isinstance(t, dict) else t)] = int(i)
    declared = [d.get("content") if isinstance(d, dict) else d for d in (tok_cfg.get("mask_token"), special.get("mask_token"))]
    return declared, vocab, {v: k for k, v in vocab.items()}


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    mask_token: str | None = None
    """The mask token's text (SGLang resolves `dflash_config.mask_token`); None when the tokenizer
    does not list the id."""
    target: dict | None = None
    """The target it was trained for: folder name, model type, config and weights fingerprints
    (model_folder.TargetInfo); `eval` warns when it decodes against another."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} heads is not a multiple of {self.num_key_value_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotate-half RoPE")
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size}: a block needs an anchor and at least one mask token")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")

    @classmethod
    def from_target(cls, target_dir: str, target_layer_ids: list[int], block_size: int = 16, num_layers: int = 5,
                    mask_token_id: int | None = None) -> "DrafterConfig":
        """Widths equal to the target's (the DFlash drafter shares its embedding and LM head)."""
        info = read_target(target_dir)
        cfg = json.loads((info.path / "config.json").read_text(encoding="utf-8"))
        text = cfg.get("text_config") or cfg
        bad = [i for i in target_layer_ids if not 0 <= i < info.num_layers]
        if bad or not target_layer_ids:
            raise UserError(f"target layer ids {list(target_layer_ids)}: the target has layers 0..{info.num_layers - 1}")
        declared, vocab, by_id = _tokenizer_vocab(info.path)  # read once: a 27B tokenizer.json is large
        if mask_token_id is None:
            mask_token_id = _mask_id(declared, vocab)
            if mask_token_id is None:
                raise UserError(f"{target_dir}: the tokenizer declares no mask token (mask_token or <|MASK|>); "
                                f"pass --mask-token-id")
        if not 0 <= mask_token_id < info.vocab_size:
            raise UserError(f"--mask-token-id {mask_token_id}: outside the target's vocabulary (0..{info.vocab_size - 1})")
        heads = int(text["num_attention_heads"])
        # MoE targets may carry no dense intermediate_size; 3x hidden is what released drafters use.
        inter = text.get("intermediate_size") or 3 * info.hidden_size
        return cls(
            hidden_size=info.hidden_size, intermediate_size=int(inter), num_hidden_layers=num_layers,
            num_attention_heads=heads, num_key_value_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or info.hidden_size // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(text),
            vocab_size=info.vocab_size, max_position_embeddings=int(text.get("max_position_embeddings", 40960)),
            block_size=block_size, target_layer_ids=list(target_layer_ids), mask_token_id=int(mask_token_id),
            num_target_layers=info.num_layers, mask_token=by_id.get(int(mask_token_id)),
            target=target_identity(info),
        )

    def to_export_dict(self) -> dict:
        """config.json of the export: a Qwen3 config plus the DFlash fields the loaders read."""
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dtype": "bfloat16",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": None,
            # transformers 5 reads rope_parameters; older readers take rope_theta above.
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "layer_types": ["full_attention"] * self.num_hidden_layers, "sliding_window": None,
            "use_sliding_window": False, "max_window_layers": self.num_hidden_layers,
            "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            # block_size twice: SGLang reads it from dflash_config, the reference from either place.
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size,
                              **({"mask_token": self.mask_token} if self.mask_token is not None else {})},
            **({"dflash_offline": {"target": self.target}} if self.target else {}),
        }

    @classmethod
    def from_export_dict(cls, d: dict) -> "DrafterConfig":
        dc = d.get("dflash_config") or {}
        names = [f for f in cls.__dataclass_fields__
                 if f not in ("target_layer_ids", "mask_token_id", "rope_theta", "mask_token", "target")]
        missing = [n for n in names if n not in d] + [n for n in ("target_layer_ids", "mask_token_id") if dc.get(n) is None]
        if missing:
            raise UserError(f"drafter config.json: missing {missing}")
        return cls(**{n: d[n] for n in names}, rope_theta=_rope_theta(d),
                   target_layer_ids=list(dc["target_layer_ids"]), mask_token_id=int(dc["mask_token_id"]),
                   mask_token=dc.get("mask_token"), target=(d.get("dflash_offline") or {}).get("target"))


def target_identity(info) -> dict:
    """What names a target: its folder's last two path parts, model type, and the fingerprints of its config and
    weights (the same ones a cache's manifest records)."""
    name = "/".join(info.path.absolute().parts[-2:])  # e.g. "pycode/target", "Qwen/Qwen3.6-27B"
    return {"name": name, "model_type": info.model_type, "config_sha256": info.config_sha256,
            "weights_fingerprint": info.weights_fingerprint}


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

    def _attend(self, h: Tensor, k: Tensor, v: Tensor, cos_q: Tensor, sin_q: Tensor, mask) -> Tensor:
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
        return self._attend(h, k, v, cos[:, -Q:], sin[:, -Q:], mask)

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Inference: the keys/values the context contributes to this layer. They depend on the
        fused features alone (never on the layer's input), so they are computed once per committed
        position and cached."""
        return self._kv(ctx, cos, sin)

    def draft(self, h: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Inference: one block over the cached context. Every cached position lies before the
        anchor and the block is bidirectional, so no mask is needed."""
        k, v = self._kv(h, cos, sin)
        return self._attend(h, torch.cat([ctx_k, k.to(ctx_k.dtype)], dim=2), torch.cat([ctx_v, v.to(ctx_v.dtype)], dim=2),
                            cos, sin, None)


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

    def draft(self, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn.draft(self.input_layernorm(x), ctx_k, ctx_v, cos, sin)
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
        for name, p in self.named_parameters():
            if name.startswith(FROZEN_PREFIXES):
                p.requires_grad_(False)
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)  # transformers' Qwen3 init (initializer_range)

    # -- parameters ------------------------------------------------------------------------------

    def compile_layers(self, backend: str = "inductor") -> None:
        """Run each decoder layer of the *training* forward through one compiled function (static
        shapes; all layers share its graph, their weights are its inputs). Eager, a small drafter's
        step is bound by unfused elementwise kernels (norms, RoPE, SiLU x up, casts); Inductor fuses
        them with the flex kernels. Inference (eval, the held-out walk) and no-grad calls keep the
        uncompiled module: their shapes change every call."""
        self._compiled_layer = torch.compile(_run_layer, dynamic=False, backend=backend)

    def init_layers_from_target(self, target_dir: str, target_layers: list[int]) -> None:
        """Start drafter layer i from target layer target_layers[i] (every tensor of the layer:
        attention, q/k norms, MLP, both layer norms), for targets whose decoder layers have the
        drafter's shapes (dense Qwen3-like ones). The target's layers already hold the circuits a
        drafter needs (previous-token and copying heads), which a random start must rediscover."""
        found = read_layer_tensors(target_dir, target_layers, self)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name in found:
                    p.copy_(found[name].to(device=p.device, dtype=p.dtype))
        log.info("drafter layers initialised from target layers %s", list(target_layers))

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith(FROZEN_PREFIXES)]

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The export names: the module tree mirrors the reference's, minus the frozen parts."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(FROZEN_PREFIXES)}

    def load_frozen_from_target(self, target_dir: str) -> None:
        """Copy the target's embedding and LM head (exactly, in the checkpoint's dtype) from its
        safetensors; no other tensor is read and the target model is never built."""
        from safetensors import safe_open

        info = read_target(target_dir)
        want = {"model.embed_tokens.weight"} | (set() if info.tie_word_embeddings else {"lm_head.weight"})
        found: dict[str, Tensor] = {}
        for f in info.weight_files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for key in sf.keys():
                    name = checkpoint_name(key)
                    if name in want and name not in found:
                        found[name] = sf.get_tensor(key)
        missing = sorted(want - found.keys())
        if missing:
            raise UserError(f"--target {target_dir}: no {missing} in its safetensors")
        expected = (self.cfg.vocab_size, self.cfg.hidden_size)
        for name, t in found.items():
            if tuple(t.shape) != expected:
                raise UserError(f"--target {target_dir}: {name} has shape {tuple(t.shape)}, the drafter expects {expected}")
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
        decoder appends them along dim 2 as tokens are committed (see evaluate.DFlashProposer)."""
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        return [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    @torch.no_grad()
    def draft_hidden(self, kv: list[tuple[Tensor, Tensor]], block_ids: Tensor, block_positions: Tensor) -> Tensor:
        """Final-normed hidden states [R, B, H] of one block [anchor, MASK x (B-1)] over the cached
        context `kv` (every cached position precedes the anchor). Equal to the training forward of
        the same block under the training mask (tests/test_evaluate.py)."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = rope_cos_sin(block_positions, self.cfg.head_dim, self.cfg.rope_theta)
        for layer, (k, v) in zip(self.layers, kv):
            x = layer.draft(x, k, v, cos, sin)
        return self.norm(x)


def read_layer_tensors(target_dir: str, target_layers: list[int], drafter: "DFlashDrafter | None" = None,
                       cfg: DrafterConfig | None = None) -> dict[str, Tensor]:
    """The target tensors that start the drafter's layers: {drafter parameter name: tensor}, one
    target layer per drafter layer. Checks (one line each) that there is one id per drafter layer,
    that each exists, and that every tensor of the drafter's layer is in the target with its shape;
    with `drafter=None` only the shapes are read (a preflight check: no tensor is loaded)."""
    from safetensors import safe_open

    cfg = drafter.cfg if drafter is not None else cfg
    info = read_target(target_dir)
    flag = "--init-layers"
    if len(target_layers) != cfg.num_hidden_layers:
        raise UserError(f"{flag} {','.join(map(str, target_layers))}: one target layer per drafter layer, "
                        f"{cfg.num_hidden_layers} expected (--num-layers)")
    bad = [j for j in target_layers if not 0 <= j < info.num_layers]
    if bad:
        raise UserError(f"{flag}: layer ids {bad} are outside the target's layers 0..{info.num_layers - 1}")
    shapes = {name: tuple(t.shape) for name, t in (drafter or DFlashDrafter.meta(cfg)).named_parameters()
              if name.startswith("layers.")}
    want: dict[str, str] = {}  # target key -> drafter name
    for name in shapes:
        i, rest = name[len("layers."):].split(".", 1)
        want[f"model.layers.{target_layers[int(i)]}.{rest}"] = name
    found: dict[str, Tensor] = {}
    got_shapes: dict[str, tuple] = {}
    for f in info.weight_files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                tkey = checkpoint_name(key)
                if tkey in want and tkey not in got_shapes:
                    got_shapes[tkey] = tuple(sf.get_slice(key).get_shape())
                    if drafter is not None and got_shapes[tkey] == shapes[want[tkey]]:
                        found[want[tkey]] = sf.get_tensor(key)
    missing = sorted(k for k in want if k not in got_shapes)
    if missing:
        raise UserError(f"{flag}: the target has no {missing[0]} ({len(missing)} drafter tensors missing): its "
                        "layers are not shaped like the drafter's (a hybrid or gated-attention target); leave "
                        f"{flag} out")
    for tkey, name in want.items():
        if got_shapes[tkey] != shapes[name]:
            raise UserError(f"{flag}: target {tkey} has shape {got_shapes[tkey]}, the drafter's {name} "
                            f"{shapes[name]}; leave {flag} out")
    return found


# ----------------------------------------------------------------------------------------------
# Export


def check_export_dest(out: Path) -> None:
    """An export replaces only an earlier export (config.json of a DFlashDraftModel and its weights,
    nothing else) or an empty folder: anything else, e.g. a Hugging Face model folder, is refused."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is a file, not a drafter export; refusing to replace it (choose another "
                        "export folder)")
    from dflash_offline.runtime.paths import unwritable_folder

    why = unwritable_folder(out.absolute().parent)  # the export is written beside it, then renamed
    if why:
        raise UserError(f"{out}: {why}; choose another export folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        arch = json.loads((out / EXPORT_CONFIG).read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        arch = None
    others = sorted(p.name for p in out.iterdir() if p.name not in (EXPORT_CONFIG, EXPORT_WEIGHTS))
    if arch != ["DFlashDraftModel"] or others:
        why = (f"it also holds {', '.join(others[:3])}" if arch == ["DFlashDraftModel"]
               else f"its config.json names architectures {arch}" if arch is not None else "it has no drafter config.json")
        raise UserError(f"{out}: exists and is not a drafter export ({why}); refusing to replace it: choose a new or "
                        "empty export folder (nothing was changed)")


def export_drafter(drafter: DFlashDrafter, out_dir: str) -> Path:
    """config.json + model.safetensors (bf16, trainable weights only). Written to a sibling temp
    folder and renamed into place, so out_dir is either the previous export or the new one."""
    from safetensors.torch import save_file

    out = Path(out_dir).absolute()
    check_export_dest(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{out}: cannot write there ({e.strerror or e}); choose another export folder") from None
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in drafter.trainable_state_dict().items()}
        save_file(tensors, str(tmp / EXPORT_WEIGHTS), metadata={"format": "pt"})
        ordinary_mode(tmp / EXPORT_WEIGHTS)  # safetensors leaves 0600: a serving process of another user reads it
        (tmp / EXPORT_CONFIG).write_text(json.dumps(drafter.cfg.to_export_dict(), indent=2) + "\n", encoding="utf-8")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)  # a rename cannot overwrite a non-empty folder: move the old one aside
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("drafter exported to %s (%d tensors)", out, len(tensors))
    return out








def load_exported(out_dir: str, target_dir: str | None = None) -> DFlashDrafter:
    """Rebuild a drafter from an export (float32 trainable weights); frozen parts from target_dir."""
    from safetensors import safe_open

    root = Path(out_dir)
    try:
        d = json.loads((root / EXPORT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{root}: no readable drafter config.json ({e})") from None
    if "DFlashDraftModel" not in (d.get("architectures") or []):
        raise UserError(f"{root / EXPORT_CONFIG}: not a DFlashDraftModel config")
    drafter = DFlashDrafter(DrafterConfig.from_export_dict(d))
    wanted = drafter.trainable_state_dict()
    with safe_open(str(root / EXPORT_WEIGHTS), framework="pt", device="cpu") as sf:
        keys = set(sf.keys())
        if keys != set(wanted):
            raise UserError(f"{root / EXPORT_WEIGHTS}: missing {sorted(set(wanted) - keys)[:3]}, "
                            f"unexpected {sorted(keys - set(wanted))[:3]}")
        with torch.no_grad():
            for k, dst in wanted.items():
                t = sf.get_tensor(k)
                if t.shape != dst.shape:
                    raise UserError(f"{root / EXPORT_WEIGHTS}: {k} has shape {tuple(t.shape)}, config implies {tuple(dst.shape)}")
                dst.copy_(t)
    if target_dir is not None:
        drafter.load_frozen_from_target(target_dir)
    return drafter
