"""`dflash-offline plan`: how big the cache gets, whether it fits, and how long each stage takes.

Reads what `extract` reads before any weights (config.json, the safetensors headers, every input
row), so its token count is exact. Sizes are exact functions of the token count (the bytes per
token of each storage mode). Times are estimates: the model FLOPs per token of each stage divided
by the bf16 peak of an H200 times the share of it this project's stages reached there
(docs/benchmarks.md): extraction 0.58-0.63 of peak for a Qwen3.5-27B and a Qwen3-8B shape
(0.58 used), training 0.44 for the 27B drafter. Other GPUs, kernels or shapes move them.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from dflash_offline.cache.location import Location
from dflash_offline.sizing_config import PlanConfig
from dflash_offline.options import where
from dflash_offline.extract.plan import bytes_per_token
from dflash_offline.runtime.paths import require_kind
from dflash_offline.runtime.units import human_bytes
from dflash_offline.targets import model as target
from dflash_offline.targets.folder import read_target, tensor_entries

H200_BF16_PEAK = 774e12  # measured dense bf16 matmul FLOP/s
EXTRACT_SHARE = 0.58  # of peak: the lower of the two measured shapes (docs/benchmarks.md)
TRAIN_SHARE = 0.44  # of peak, matmuls + attention: the 27B drafter (docs/benchmarks.md)
MODES = ("bfloat16", "float8_e4m3fn")


def decoder_matrix_params(info) -> int:
    """Parameters of the decoder layers' weight matrices (2-D tensors under `.layers.`), from the
    safetensors headers: what a forward multiplies per token. Vision towers and MTP heads excluded."""
    total = 0
    for name, entry in tensor_entries(info.weight_files).items():
        if name.startswith("model.layers.") and len(entry.shape) == 2 and int(name.split(".")[2]) < info.num_target_layers:
            total += math.prod(entry.shape)
    return total


def _text_config(info) -> dict:
    cfg = json.loads((info.path / "config.json").read_text())
    return cfg.get("text_config") or cfg


def drafter_flops_per_context_token(text: dict, n_captured: int, p: PlanConfig) -> float:
    """Training FLOPs per context token of the DFlash drafter with the target's widths: its layers
    forward + backward on the block tokens, the context key/value projections, fc, the frozen LM
    head (forward + input gradient), and attention over about half the context per block query
    (the same count as benchmarks/train_throughput.py, with attention estimated, not counted)."""
    H, F, V = text["hidden_size"], text["intermediate_size"], text["vocab_size"]
    hd = text.get("head_dim") or H // text["num_attention_heads"]
    qd, kvd = text["num_attention_heads"] * hd, text["num_key_value_heads"] * hd
    Q, S, L = p.num_anchors * p.block_size, p.seq_len, p.drafter_layers
    per_layer_block = 2 * H * qd + 2 * H * kvd + 3 * H * F
    row = (6 * L * per_layer_block * Q + 6 * L * 2 * H * kvd * S + 6 * n_captured * H * H * S + 4 * H * V * Q
           + 3 * L * 4 * Q * (S / 2 + p.block_size) * qd)
    return row / S


def make_plan(p: PlanConfig) -> dict:
    from dflash_offline.rows import reader as data

    p.validate()
    info = read_target(p.target, where(p, "target"))
    layer_ids = target.resolve_layers(info, p)
    target.check_topk(info, p.topk, where(p, "topk"))
    source = data.scan(p.data, info.vocab_size, where(p, "data"))
    data.require_trained(source, f"{where(p, 'data')} {' '.join(map(str, p.data))}")
    tokens = int(np.minimum(source.lengths, p.max_len).sum())
    free = None
    if p.cache:
        require_kind(p.cache, where(p, "cache"), True, "the folder the cache would go to")

        loc = Location(p.cache, where(p, "cache"))
        probe = loc
        if not loc.remote:
            path = loc.path()
            while path and not os.path.exists(path):
                path = os.path.dirname(path)
            probe = Location(path or "/")
        free = probe.free_bytes()
    text = _text_config(info)
    n = len(layer_ids)
    known = [x for x in (p.max_bytes, free) if x is not None]
    budget = min(known) if known else None
    modes = {}
    for mode in MODES:
        bpt = bytes_per_token(n, info.hidden_size, p.topk, mode)
        size = tokens * bpt
        modes[mode] = {"bytes_per_token": bpt, "bytes": size, "fits": None if budget is None else size <= budget}
    fwd = 2.0 * decoder_matrix_params(info) + (2.0 * info.hidden_size * info.vocab_size if p.topk else 0.0)
    ext_tps = EXTRACT_SHARE * H200_BF16_PEAK / fwd
    dr = drafter_flops_per_context_token(text, n, p)
    train_tps = TRAIN_SHARE * H200_BF16_PEAK / dr
    return {
        "target": str(info.path), "layer_ids": layer_ids, "topk": p.topk, "rows": int(source.rows), "tokens": tokens,
        "truncated_rows": int((source.lengths > p.max_len).sum()), "modes": modes,
        "max_bytes": p.max_bytes, "free_bytes": free,
        "extract": {"flops_per_token": fwd, "tokens_per_s_per_gpu": ext_tps, "gpus": p.extract_gpus,
                    "hours": tokens / (ext_tps * p.extract_gpus) / 3600},
        "train": {"flops_per_context_token": dr, "context_tokens_per_s_per_gpu": train_tps, "gpus": p.train_gpus,
                  "epochs": p.epochs, "hours": tokens * p.epochs / (train_tps * p.train_gpus) / 3600},
    }


def report(plan: dict) -> list[str]:
    lines = [f"input: {plan['rows']} rows, {plan['tokens']:,} tokens after truncation"
             + (f" ({plan['truncated_rows']} rows truncated)" if plan["truncated_rows"] else "")
             + f"; layers {plan['layer_ids']}, top-k {plan['topk']}"]
    budget = []
    if plan["max_bytes"] is not None:
        budget.append(f"--max-bytes {human_bytes(plan['max_bytes'])}")
    if plan["free_bytes"] is not None:
        budget.append(f"{human_bytes(plan['free_bytes'])} free at --cache")
    for mode, m in plan["modes"].items():
        fits = "" if m["fits"] is None else ("  fits" if m["fits"] else "  does NOT fit")
        lines.append(f"cache, {mode}: {human_bytes(m['bytes'])} ({m['bytes_per_token']:,} bytes/token){fits}")
    if budget:
        lines.append("budget: " + ", ".join(budget))
    e, t = plan["extract"], plan["train"]
    lines.append(f"extract (estimate): {e['tokens_per_s_per_gpu']:,.0f} tokens/s per H200, {e['hours']:.1f} h on "
                 f"{e['gpus']} GPUs")
    lines.append(f"train (estimate): {t['context_tokens_per_s_per_gpu']:,.0f} context tokens/s per H200, "
                 f"{t['epochs']} epochs in {t['hours']:.1f} h on {t['gpus']} GPUs")
    lines.append("estimates: model FLOPs over the share of the bf16 peak measured on an H200 (docs/benchmarks.md)")
    return lines
