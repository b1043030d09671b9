"""Attention and cache plumbing of transformers targets, shared by the stages that decode with them
(generate's batched decoder, eval's transformers decoders, eval's static decoder).

`grouped_query_attention` lays the G query heads of one key/value head along the query axis, so
grouped-query attention never copies the keys and values once per query head; `grouped_sdpa`
serves it to transformers' attention interface (`use_grouped_attention`), where a padding mask
would otherwise make transformers expand the whole cache per query head before SDPA.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F

SDPA_BACKENDS = ("default", "cudnn", "efficient", "math")  # default: SDPA's own choice; all take a mask

# The SDPA kernel for one-token queries on a GPU (the static decoder's decode steps). Laid out per
# key/value head, one token's queries are G rows (G query heads per KV head: 6 at the 27B shape);
# the memory-efficient kernel tiles queries by 32 rows where cuDNN's, SDPA's choice in bf16, takes
# 64: at the Qwen3.5-27B shape with 64 rows it attended in 0.41 ms a step against 0.94 (H100).
ONE_TOKEN_SDPA = "efficient"


def one_token_sdpa(q: torch.Tensor):
    """A context that gives SDPA ONE_TOKEN_SDPA's kernel for the one-token query q (math where that
    kernel cannot take the shapes); elsewhere (CPU, longer blocks, "default") SDPA's own choice."""
    if q.device.type != "cuda" or q.shape[2] != 1 or ONE_TOKEN_SDPA == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "math": SDPBackend.MATH}[ONE_TOKEN_SDPA]
    return sdpa_kernel([first, SDPBackend.MATH])


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                            scale: float | None) -> torch.Tensor:
    """q [B, H, T, d] over k/v [B, Hkv, S, d] with mask [B, 1, G*T, S] (G = H / Hkv: the mask laid
    out for the G query heads of each key/value head, along the query axis): [B, H, T, d], with no
    copy of the keys and values per query head."""
    B, H, T, d = q.shape
    Hkv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, (H // Hkv) * T, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, H, T, d)


def cache_argument(model) -> str:
    """transformers >= 5.18 names the cache argument `cache` (`past_key_values` is deprecated there)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


GROUPED_ATTENTION = "dflash_grouped_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                 **kwargs):
    """transformers' SDPA attention without copying keys and values once per query head.

    With a padding mask, transformers expands grouped-query keys and values to every query head
    before SDPA (`repeat_kv`): in batched decoding that copy, over the whole cache, costs more than
    the attention itself (a Qwen3 with 3 query heads per KV head: 3x the cache's bytes per step).
    Here the G query heads of one KV head are laid along the query axis instead, [B, Hkv, G * q, d],
    and the mask is repeated for them: the same scores, no copy of the cache.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    H, q = query.shape[1], query.shape[2]
    groups = H // key.shape[1]
    if groups == 1 or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask.repeat(1, 1, groups, 1) if attention_mask.shape[2] == q and q > 1 else attention_mask
    return grouped_query_attention(query, key, value, mask, scaling).transpose(1, 2).contiguous(), None


def use_grouped_attention(model) -> None:
    """Route the model's attention layers through grouped_sdpa (masks as for SDPA)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_ATTENTION, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)
    model.config._attn_implementation = GROUPED_ATTENTION
