"""`verify CACHE --content N --target T`: what the cache holds against a fresh forward of the target.

Checksums prove that the bytes are the bytes written; this proves they are the target's. Steps:

1. The manifest's fingerprints of the target it was made with (config, weights) against --target's:
   a cache of another config or other weights is named in one line each.
2. N samples drawn evenly across the cache's samples (or N% of them), run through the target as
   extraction runs it (targets.model: the same loader, capture hooks and batched forward), in the
   cache's compute dtype, every layer up to one past the deepest captured one.
3. Per captured layer, each stored vector against the fresh one, relative L2 error
   |stored - fresh| / |fresh|; the largest over the samples against cache/bounds.py's bound (the
   storage's rounding plus the compute dtype's allowance). A failing layer is held against every
   fresh layer: when another one matches, the line says which (layer ids shifted by one, a capture
   of the wrong module).
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
BATCH_TOKENS = 4096


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
        return self.error <= self.bound

    def line(self, storage: str, compute: str) -> str:
        out = (f"layer {self.layer}: stored vectors differ from a fresh forward of the target by up to "
               f"{self.error:.3g} (relative L2, sample {self.sample}; bound {self.bound:.3g} for {storage} storage of "
               f"a {compute} forward)")
        if self.matches is not None:
            shift = self.matches - self.layer
            out += (f"; they match the target's layer {self.matches} ({self.matches_error:.3g}): the cache's layer ids are "
                    f"off by {shift:+d}, or the capture hooked the wrong module")
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
    # Every layer up to one past the deepest captured one: a stored layer that fails is held
    # against all of them (ids shifted by one, the wrong module).
    fresh_ids = list(range(min(max(layer_ids) + 2, info.num_target_layers)))
    model = load_target(info, dev, compute, info.num_target_layers if topk else len(fresh_ids), bool(topk))
    capture = LayerCapture(model, fresh_ids)
    bound = feature_bound(storage, compute)
    layers = {lid: LayerFinding(lid, 0.0, -1, bound) for lid in layer_ids}
    against = {lid: np.zeros(len(fresh_ids)) for lid in layer_ids}  # worst error against each fresh layer
    top = {"error": 0.0, "sample": None}
    tokens = 0
    batch: list = []
    for name, k in picks:
        batch.append(reader.shard(name).sample(k))
        if sum(len(s.input_ids) for s in batch) >= BATCH_TOKENS or (name, k) == picks[-1]:
            tokens += _compare(model, capture, batch, dev, layer_ids, fresh_ids, layers, against, top, topk, compute)
            batch = []
    for lid, f in layers.items():
        if not f.ok:
            best = int(np.argmin(against[lid]))
            if fresh_ids[best] != lid and against[lid][best] <= 4 * bound:
                f.matches, f.matches_error = fresh_ids[best], float(against[lid][best])
    capture.remove()
    report = ContentReport(storage=storage, compute=compute, samples=len(picks), of_samples=len(where), tokens=tokens, layers=list(layers.values()),
                           fingerprints=fingerprint_lines(m, info), kernels=check_kernels(info, [dev]),
                           seconds=time.time() - t0)
    if topk:
        report.topk_error, report.topk_sample = top["error"], top["sample"]
        report.topk_bound = LOGPROB_ALLOWANCE[compute]
    return report


def _compare(model, capture, batch, dev, layer_ids, fresh_ids, layers, against, top, topk, compute) -> int:
    """One batch of stored samples against their fresh forward; updates the findings in place."""
    lens = [len(s.input_ids) for s in batch]
    S = max(lens)
    ids = torch.zeros((len(batch), S), dtype=torch.long)
    mask = torch.zeros((len(batch), S), dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, :lens[r]] = torch.from_numpy(s.input_ids.astype(np.int64))
        mask[r, :lens[r]] = 1
    flat = torch.from_numpy(np.concatenate([r * S + np.arange(t) for r, t in enumerate(lens)]))
    hidden, last = captured_forward(model, capture, ids.to(dev), mask.to(dev), flat.to(dev), last=bool(topk))
    fresh = hidden.float().cpu().numpy()  # [N, len(fresh_ids), H]
    a = 0
    for s, t in zip(batch, lens):
        f = fresh[a:a + t]
        norms = np.maximum(np.linalg.norm(f, axis=-1), 1e-30)  # [t, L]
        stored = s.hidden  # [t, n, H] float32
        for c, lid in enumerate(layer_ids):
            per_fresh = (np.linalg.norm(stored[:, c, None, :] - f, axis=-1) / norms).max(axis=0)  # [L]
            per_fresh = np.nan_to_num(per_fresh, nan=np.inf)  # a NaN stored: infinitely wrong, not "not above"
            against[lid] = np.maximum(against[lid], per_fresh)
            e = float(per_fresh[fresh_ids.index(lid)])
            if e > layers[lid].error or layers[lid].sample < 0:
                layers[lid].error, layers[lid].sample = e, s.sample_id
        if topk:
            with torch.inference_mode():
                logits = model.get_output_embeddings()(last[a:a + t]).float()
                lp = torch.log_softmax(logits, dim=-1)
                want = torch.from_numpy(s.topk_ids.astype(np.int64)).to(lp.device)
                got = torch.from_numpy(s.topk_logprobs.astype(np.float32)).to(lp.device)
                # the stored values against the fresh ones of the same ids, and the stored top-1
                # against the fresh maximum (a near tie may swap two ids; their values still agree)
                # beyond fp16's rounding of the stored value (half a step: 2^-11 of it)
                err = torch.maximum(((lp.gather(1, want) - got).abs() - FP16_HALF_STEP * got.abs()).amax(dim=1),
                                    lp.amax(dim=1) - lp.gather(1, want[:, :1])[:, 0])
                e = float(torch.nan_to_num(err, nan=float("inf")).max())
            if e > top["error"] or top["sample"] is None:
                top["error"], top["sample"] = e, s.sample_id
        a += t
    return sum(lens)


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
