"""`eval --cache HELD-OUT --parity N`: does the drafter decode as its training said it would?

On the first N samples of a held-out cache of the target's own greedy completions, three figures
that must agree for a drafter that is trained and served on the same computation:

  every anchor   1 + accepted drafts, averaged over every anchor of the completions: what the
                 training metric `tau` (teacher-forced blocks at random anchors) estimates;
  walk           decoding's rounds picked out of those anchors (blocks.walk.walk_acceptance);
  decoding       real greedy speculative decoding of the same prompts against the target, with
                 as many new tokens as the completions hold, checked token for token against them.

Walk and decoding should agree to rounding (the cache stores bf16 or fp8 features where decoding
gives the drafter the target's own); every-anchor is higher, since decoding spends more of its
rounds on hard stretches. When walk and decoding disagree by more than `tolerance`, the report
names what it can check: the mask token against the target's tokenizer, RoPE theta against the
target's config, the features each decoder path feeds the drafter (a prefill, then verify
forwards of its block, teacher-forced: evaluate/serving_features.py) against those the cache stores
within cache/bounds.py's bound (another target, dtype, layer definition or decoder path), the block
size, and whether decoding was lossless at all.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from dflash_offline.cache.bounds import feature_bound
from dflash_offline.drafter.config import config_rope_theta, mask_token_from_tokenizer

log = logging.getLogger("dflash.eval")

TOLERANCE = 0.05  # relative difference of walk and decoding tau that counts as a disagreement


def check_parity(target_dir: str, drafter, cache: str, samples: int, device: str, dtype: str,
                 tolerance: float = TOLERANCE) -> dict:

    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.evaluate.speculative import (
        DFlashProposer,
        TargetSession,
        load_target_for_decoding,
        speculative_decode,
        summarize,
    )
    from dflash_offline.blocks.walk import cache_layer_columns, walk_acceptance
    from dflash_offline.evaluate.serving_features import paths_for, relative_errors, served

    t0 = time.time()
    cfg = drafter.cfg
    walk = walk_acceptance(cache, drafter, device, max_samples=samples, per_sample=True)
    reader = CacheReader(cache)
    layer_columns = cache_layer_columns(reader.manifest, cfg, cache) or list(range(len(cfg.target_layer_ids)))
    model, _ = load_target_for_decoding(target_dir, device, dtype)
    session = TargetSession(model, cfg.target_layer_ids)
    proposer = DFlashProposer(drafter, device, dtype)
    runs, mismatched, same_rounds = [], [], 0
    # The train-to-serve check (evaluate/serving_features.py): what each decoder path feeds the
    # drafter, teacher-forced in its verify blocks, against what the cache stores.
    paths = paths_for(model)
    block = cfg.block_size + cfg.label_offset  # a verify forward: the anchor and the drafts
    gaps = {p: np.zeros(len(cfg.target_layer_ids)) for p in paths}
    for entry in walk["per_sample"]:
        s = reader.sample(entry["id"])
        ids = s.input_ids.astype(np.int64).tolist()
        p0 = int(np.flatnonzero(s.loss_mask)[0])
        completion = ids[p0:]
        out = speculative_decode(session, proposer, ids[:p0], len(completion), set())
        runs.append(out)
        if out.tokens != completion:
            mismatched.append(entry["id"])
        same_rounds += out.accepted == entry["accepted"]
        stored = s.hidden[:, layer_columns]
        for p in paths:
            got = served(model, p, cfg.target_layer_ids, ids, p0, block)
            gaps[p] = np.maximum(gaps[p], relative_errors(stored, got))
    dec = summarize(runs, cfg.block_size)
    capture = reader.manifest["capture"]
    made_in = capture.get("compute_dtype", dtype)
    bound = feature_bound(capture["hidden_dtype"], dtype, made_in)
    err = np.max(np.stack(list(gaps.values())), axis=0)
    walk_tau, dec_tau = walk["tau_pooled"], dec.tau
    gap = (dec_tau - walk_tau) / walk_tau
    causes = []
    want_mask = mask_token_from_tokenizer(Path(target_dir))
    if want_mask is not None and want_mask != cfg.mask_token_id:
        causes.append(f"mask token id {cfg.mask_token_id}, but the target's tokenizer names {want_mask} as its "
                      "mask token: train with that id (--mask-token-id) or serve with the one trained")
    text = json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8"))
    theta = config_rope_theta(text.get("text_config") or text)
    if abs(theta - cfg.rope_theta) > 1e-6 * max(theta, 1.0):
        causes.append(f"RoPE theta {cfg.rope_theta:g} in the drafter, {theta:g} in the target's config")
    causes += gap_causes(gaps, cfg.target_layer_ids, bound, capture["hidden_dtype"], dtype, made_in)
    if mismatched:
        causes.append(f"{len(mismatched)} of {len(runs)} decodes differ from the cache's completions (ids "
                      f"{mismatched[:5]}): the cache is not this target's greedy decode in {dtype}; compare like "
                      "with like (--dtype float32, a cache of `generate` output)")
    agree = abs(gap) <= tolerance
    if not agree and not causes:
        causes.append(f"nothing checkable differs (block size {cfg.block_size}, layers {cfg.target_layer_ids}, mask "
                      f"{cfg.mask_token_id}); with few samples the figures are noisy: try a larger --parity")
    report = {
        "samples": len(runs), "every_anchor_tau": walk["tau_all_anchors"], "walk_tau": walk_tau,
        "walk_tau_per_prompt_mean": walk["tau_per_prompt_mean"], "decoding_tau": dec_tau,
        "decoding_tau_per_prompt_mean": dec.tau_per_prompt_mean, "relative_gap": gap, "agree": agree,
        "tolerance": tolerance, "same_rounds_samples": same_rounds, "lossless": not mismatched,
        "feature_relative_error": [float(e) for e in err], "feature_bound": bound,
        "feature_gap": {p: [float(e) for e in g] for p, g in gaps.items()}, "causes": causes, "seconds": time.time() - t0,
    }
    log.info("parity on %d samples: every anchor %.3f, walk %.3f, decoding %.3f (%+.1f%%)%s", len(runs),
             report["every_anchor_tau"], walk_tau, dec_tau, 100 * gap, "" if agree else "; " + "; ".join(causes))
    return report


def gap_causes(gaps: dict, layer_ids: list[int], bound: float, storage: str, dtype: str, made_in: str) -> list[str]:
    """One line per decoder path whose features lie beyond the bound at some layer (`made_in`: the
    dtype the cache's forward ran in, `dtype` the eval's)."""
    out = []
    for path, errors in gaps.items():
        bad = [(lid, e) for lid, e in zip(layer_ids, errors) if e > bound]
        if bad:
            out.append(f"the {path} decoder feeds the drafter other features than the cache holds: at layers "
                       f"{[lid for lid, _ in bad]} up to {max(e for _, e in bad):.3g} (relative L2; bound {bound:.3g} "
                       f"for the cache's {storage} of a {made_in} forward against a {dtype} one): another target, dtype "
                       "or layer definition "
                       "than at extraction, or a decoder path that computes them otherwise (features are the layers' "
                       "raw outputs)")
    return out
