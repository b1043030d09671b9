"""`verify CACHE --content N --target T`: what the cache holds against a fresh forward of the target.

Checksums prove that the bytes are the bytes written; this proves they are the target's. Steps:

1. The manifest's fingerprints of the target it was made with (config, weights) against --target's:
   a cache of another config or other weights is named in one line each.
2. N samples drawn evenly across the cache's samples (or N% of them), run through the target as
   extraction runs it (targets.model: the same loader, capture hooks and batched forward, batches of
   at most BATCH_TOKENS rows x longest sample), in the cache's compute dtype.
3. Per captured layer, each stored vector against the fresh one, relative L2 error
   |stored - fresh| / |fresh|, on the device; the largest over the samples against
   cache/bounds.py's bound (the storage's rounding plus the compute dtype's allowance). Each stored
   layer is also held against the target's layers before and after it: a stored layer closer to a
   neighbour than to itself is named whatever the bound (layer ids off by one, a capture of the
   wrong module; in a deep bf16 target neighbouring layers may lie within the bound of each other).
4. Top-k: the stored log-probabilities against the fresh log-probabilities of the same token ids
   (a near tie may swap two ids: their values still agree), within fp16's rounding plus the
   allowance; and the stored top-1 within that bound of the fresh maximum.

One line per failing layer (its id, the figure, the sample, the bound) and exit 1; else one line.
The chunks read are checked against their CRC32C on the way, as every read of the cache is. The
command imports this module only with --content: plain `verify` stays free of torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_offline.cache.bounds import feature_bound
from dflash_offline.cache.reader import CacheReader
from dflash_offline.runtime.errors import UserError
from dflash_offline.targets.folder import read_target
from dflash_offline.targets.model import LayerCapture, captured_forward, check_kernels, load_target

log = logging.getLogger("dflash.verify")

# Log-probabilities: stored in fp16 (half a step: 2^-11 of the value), and beyond that what the
# compute dtype's logits may add.
FP16_HALF_STEP = 2.0 ** -11
LOGPROB_ALLOWANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.05}
BATCH_TOKENS = 4096  # rows x longest sample of a fresh forward
LOGITS_CHUNK = 1024  # tokens whose full-vocabulary logits are alive at once


@dataclass
class LayerFinding:
    layer: int
    error: float  # largest relative L2 error of a vector
    sample: int  # the sample it was in
    bound: float
    matches: int | None = None  # another fresh layer the stored vectors match, if one does
    matches_error: float | None = None

    @property
    def ok(self) -> bool:
        return self.error <= self.bound and self.matches is None

    def line(self, storage: str, compute: str) -> str:
        out = (f"layer {self.layer}: stored vectors differ from a fresh forward of the target by up to "
               f"{self.error:.3g} (relative L2, sample {self.sample}; bound {self.bound:.3g} for {storage} storage of "
               f"a {compute} forward)")
        if self.matches is not None:
            shift = self.matches - self.layer
            out += (f"; they match the target's layer {self.matches} better ({self.matches_error:.3g}): the cache's layer "
                    f"ids are off by {shift:+d}, or the capture hooked the wrong module")
        elif self.error > 0.5:
            out += ("; no layer of the target matches them: another target, weights or config than at extraction, "
                    "or a forward that did not write this layer")
        return out


@dataclass
class ContentReport:
    storage: str  # the cache's hidden dtype
    compute: str  # the dtype of its (and the fresh) forward
    samples: int
    of_samples: int
    tokens: int
    layers: list[LayerFinding]
    topk_error: float | None = None
    topk_sample: int | None = None
    topk_bound: float | None = None
    fingerprints: list[str] = field(default_factory=list)  # one line each: another config, other weights
    kernels: str | None = None  # the loud warning of a hybrid on CUDA without its fast kernels (the slow path)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.fingerprints and all(f.ok for f in self.layers) and (
            self.topk_error is None or self.topk_error <= self.topk_bound)


def parse_amount(text: str, option: str = "--content") -> tuple[int | None, float | None]:
    """'N' (samples) or 'P%' (a share of the cache's samples) -> (N, None) or (None, P / 100)."""
    t = str(text).strip()
    try:
        if t.endswith("%"):
            p = float(t[:-1])
            if not 0 < p <= 100:
                raise ValueError
            return None, p / 100
        n = int(t)
        if n < 1:
            raise ValueError
        return n, None
    except ValueError:
        raise UserError(f"{option} {text}: a number of samples (e.g. 64) or a share of the cache's samples (e.g. 1%)")
    return None, None


def fingerprint_lines(manifest: dict, info) -> list[str]:
    """One line for each fingerprint of --target that is not the one the cache was made with."""
    made = manifest.get("target") or {}
    out = []
    if made.get("config_sha256") and made["config_sha256"] != info.config_sha256:
        out.append(f"--target {info.path}: its config is not the one the cache was made with (config sha256 "
                   f"{info.config_sha256[:12]}..., the manifest's {made['config_sha256'][:12]}..., made from "
                   f"{made.get('path')}): another model, or a config edited since (rope, layer types, widths)")
    if made.get("weights_fingerprint") and info.weights_fingerprint != made["weights_fingerprint"]:
        out.append(f"--target {info.path}: its weights are not the ones the cache was made with (fingerprint "
                   f"{info.weights_fingerprint}, the manifest's {made['weights_fingerprint']}): another checkpoint "
                   "of the same shapes")
    return out


def drawn(total: int, n: int | None, share: float | None) -> list[int]:
    """Indices of the samples checked: evenly spread over the cache's `total` samples."""
    want = n if n is not None else max(1, round(total * share))
    want = min(want, total)
    return sorted(set(np.linspace(0, total - 1, want).round().astype(int).tolist()))


def check_content(cache: str, target: str, amount: str, device: str = "cpu") -> ContentReport:
    """The check the module docstring describes; the report says what failed."""
    t0 = time.time()
    n, share = parse_amount(amount)
    reader = CacheReader(cache)
    m = reader.manifest
    info = read_target(target)
    cap = m["capture"]
    layer_ids, storage, compute, topk = list(cap["layer_ids"]), cap["hidden_dtype"], cap["compute_dtype"], cap["topk"]
    if info.hidden_size != m["target"]["hidden_size"] or max(layer_ids) >= info.num_target_layers:
        raise UserError(f"--target {target}: hidden size {info.hidden_size}, {info.num_target_layers} layers; the cache "
                        f"holds layers {layer_ids} of width {m['target']['hidden_size']}: give the target it was made with")
    where = [(name, k) for name in reader.shard_names for k in range(len(reader.shard(name)))]
    picks = [where[i] for i in drawn(len(where), n, share)]
    dev = f"cuda:{device}" if str(device).isdigit() else str(device)
    # Each captured layer and its two neighbours: a stored layer closer to a neighbour than to
    # itself is named (ids off by one), whatever the bound.
    fresh_ids = sorted({j for lid in layer_ids for j in (lid - 1, lid, lid + 1) if 0 <= j < info.num_target_layers})
    model = load_target(info, dev, compute, info.num_target_layers if topk else max(fresh_ids) + 1, bool(topk))
    capture = LayerCapture(model, fresh_ids)
    bound = feature_bound(storage, compute)
    layers = {lid: LayerFinding(lid, 0.0, -1, bound) for lid in layer_ids}
    against = {lid: {j: 0.0 for j in (lid - 1, lid, lid + 1) if j in fresh_ids} for lid in layer_ids}
    top = {"error": 0.0, "sample": None}
    tokens = 0
    batch: list = []
    for name, k in picks:
        s = reader.shard(name).sample(k)
        longest = max([len(s.input_ids), *(len(b.input_ids) for b in batch)])
        if batch and (len(batch) + 1) * longest > BATCH_TOKENS:  # rows x longest: padding stays bounded
            tokens += _compare(model, capture, batch, dev, layer_ids, fresh_ids, layers, against, top, topk)
            batch = []
        batch.append(s)
    if batch:
        tokens += _compare(model, capture, batch, dev, layer_ids, fresh_ids, layers, against, top, topk)
    for lid, f in layers.items():  # a neighbour within the bound, and nearer than the layer itself: a shift
        best = min(against[lid], key=against[lid].get)
        if best != lid and against[lid][best] <= bound:
            f.matches, f.matches_error = best, against[lid][best]
    capture.remove()
    report = ContentReport(storage=storage, compute=compute, samples=len(picks), of_samples=len(where), tokens=tokens,
                           layers=list(layers.values()), fingerprints=fingerprint_lines(m, info),
                           kernels=check_kernels(info, [dev]), seconds=time.time() - t0)
    if topk:
        report.topk_error, report.topk_sample = top["error"], top["sample"]
        report.topk_bound = LOGPROB_ALLOWANCE[compute]
    return report


def _compare(model, capture, batch, dev, layer_ids, fresh_ids, layers, against, top, topk) -> int:
    """One batch of stored samples against their fresh forward, on the device; updates the
    findings in place."""
    lens = [len(s.input_ids) for s in batch]
    S = max(lens)
    ids = torch.zeros((len(batch), S), dtype=torch.long)
    mask = torch.zeros((len(batch), S), dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, :lens[r]] = torch.from_numpy(s.input_ids.astype(np.int64))
        mask[r, :lens[r]] = 1
    flat = torch.from_numpy(np.concatenate([r * S + np.arange(t) for r, t in enumerate(lens)]))
    hidden, last = captured_forward(model, capture, ids.to(dev), mask.to(dev), flat.to(dev), last=bool(topk))
    column = {j: c for c, j in enumerate(fresh_ids)}
    a = 0
    with torch.inference_mode():
        for s, t in zip(batch, lens):
            stored = torch.from_numpy(s.hidden).to(dev)  # [t, n, H] float32
            for c, lid in enumerate(layer_ids):
                for j in against[lid]:
                    f = hidden[a:a + t, column[j]].float()
                    e = (stored[:, c] - f).norm(dim=-1) / f.norm(dim=-1).clamp_min(1e-30)
                    e = float(torch.nan_to_num(e, nan=float("inf")).max())  # a NaN stored: infinitely wrong
                    against[lid][j] = max(against[lid][j], e)
                    if j == lid and (e > layers[lid].error or layers[lid].sample < 0):
                        layers[lid].error, layers[lid].sample = e, s.sample_id
            if topk:
                e = _topk_error(model, last[a:a + t], s)
                if e > top["error"] or top["sample"] is None:
                    top["error"], top["sample"] = e, s.sample_id
            a += t
    return sum(lens)


def _topk_error(model, last, s) -> float:
    """The stored top-k log-probabilities against the fresh ones of the same token ids, beyond
    fp16's rounding of the stored value (half a step: 2^-11 of it), and the stored top-1 against
    the fresh maximum (a near tie may swap two ids: their values still agree); the logits a chunk
    at a time (a 27B target's vocabulary is 248K wide)."""
    head = model.get_output_embeddings()
    want_all = torch.from_numpy(s.topk_ids.astype(np.int64)).to(last.device)
    got_all = torch.from_numpy(s.topk_logprobs.astype(np.float32)).to(last.device)
    worst = 0.0
    for a in range(0, last.shape[0], LOGITS_CHUNK):
        lp = torch.log_softmax(head(last[a:a + LOGITS_CHUNK]).float(), dim=-1)
        want, got = want_all[a:a + LOGITS_CHUNK], got_all[a:a + LOGITS_CHUNK]
        err = torch.maximum(((lp.gather(1, want) - got).abs() - FP16_HALF_STEP * got.abs()).amax(dim=1),
                            lp.amax(dim=1) - lp.gather(1, want[:, :1])[:, 0])
        worst = max(worst, float(torch.nan_to_num(err, nan=float("inf")).max()))
    return worst


def report_lines(r: ContentReport, cache: str, target: str, device: str) -> tuple[list[str], list[str]]:
    """The summary line (stdout) and one line per failure (stderr): (lines, failures)."""
    head = (f"content: {r.samples} of {r.of_samples} samples ({r.tokens} tokens) of {cache} against a fresh forward of "
            f"{target} ({r.compute}, {device}) in {r.seconds:.1f}s")
    fails = list(r.fingerprints)
    fails += [f.line(r.storage, r.compute) for f in r.layers if not f.ok]
    if r.topk_error is not None and r.topk_error > r.topk_bound:
        fails.append(f"top-k: the stored log-probabilities differ from a fresh forward's by up to {r.topk_error:.3g} "
                     f"beyond fp16's rounding (sample {r.topk_sample}; bound {r.topk_bound:.3g}): another head or layer "
                     "than the target's last, or another target")
    ok = [f"layer {f.layer} within {f.bound:.3g} (largest {f.error:.3g})" for f in r.layers if f.ok]
    if r.topk_error is not None and r.topk_error <= r.topk_bound:
        ok.append(f"top-k within {r.topk_bound:.3g} (largest {r.topk_error:.3g})")
    lines = [head + (": " + "; ".join(ok) if ok else "")]
    if r.kernels:  # not a failure: the fresh forward took the slow path (extraction may have too)
        lines.append(f"warning: {r.kernels}")
    return lines, fails
