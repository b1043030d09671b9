"""Look inside a cache from a notebook or a terminal: `open_cache(path)`, `dflash-offline inspect`.

Reads with numpy and zarr only: opening a cache never imports torch (so a notebook beside a
running job does not touch its GPU). Tables are pandas DataFrames and plots matplotlib figures,
both imported only when asked for (`pip install 'dflash-offline[notebook]'`).

    from dflash_offline import open_cache
    cache = open_cache("/dev/shm/cache")
    cache.shards                   # one row per committed shard: samples, tokens, bytes, ids
    s = cache.sample(cache.sample_ids[0])
    s.hidden[16]                   # float32 [tokens, hidden] of captured layer 16
    cache.layer_stats()            # mean, std, absmax, rms and outlier channels per layer
    cache.plot_norms(s.sample_id); cache.plot_distributions()
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_offline.cache.reader import CacheReader, bf16_bits_to_float32
from dflash_offline.runtime.errors import UserError

# A channel is an outlier when its RMS over tokens exceeds this multiple of the layer's median
# channel RMS (massive activations of LLM residual streams sit at 10-1000x).
OUTLIER_RATIO = 6.0


def open_cache(path: str) -> "CacheView":
    """A read-only view of a committed (or still extracting) cache at a path or fsspec URL."""
    return CacheView(path)


@dataclass
class SampleView:
    sample_id: int
    shard: str
    input_ids: np.ndarray  # int32 [t]
    loss_mask: np.ndarray  # uint8 [t]
    hidden: dict[int, np.ndarray]  # layer id -> float32 [t, H]
    topk_ids: np.ndarray | None  # int32 [t, k]
    topk_logprobs: np.ndarray | None  # float32 [t, k]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def norms(self) -> dict[int, np.ndarray]:
        """L2 norm over channels of each captured layer at every position: {layer: [t]}."""
        return {lid: np.linalg.norm(h, axis=-1) for lid, h in self.hidden.items()}


class CacheView:
    def __init__(self, path: str):
        self.path = str(path)
        self._reader = CacheReader(self.path)
        self.manifest = self._reader.manifest
        cap = self.manifest["capture"]
        self.layer_ids: list[int] = list(cap["layer_ids"])
        self.topk: int = int(cap["topk"])
        self.hidden_size: int = int(self.manifest["target"]["hidden_size"])
        self.status: str = self.manifest["status"]

    def __repr__(self) -> str:
        t = self.manifest["totals"]
        return (f"<cache {self.path}: {self.status}, {len(self.manifest['shards'])}/{self.manifest['plan']['num_shards']} "
                f"shards, {t['samples']} samples, {t['tokens']} tokens, layers {self.layer_ids}>")

    # -- tables ---------------------------------------------------------------------------------

    def shard_records(self) -> list[dict]:
        out = []
        for s in self.manifest["shards"]:
            ranges = s["sample_ids"]
            out.append({"shard": s["name"], "samples": s["samples"], "tokens": s["tokens"], "bytes": s["bytes"],
                        "bytes_per_token": s["bytes"] / max(s["tokens"], 1),
                        "first_id": ranges[0][0] if ranges else None, "last_id": ranges[-1][1] if ranges else None,
                        "id_ranges": len(ranges)})
        return out

    @property
    def shards(self):
        """pandas DataFrame, one row per committed shard."""
        return _frame(self.shard_records())

    @property
    def sample_ids(self) -> np.ndarray:
        """Every committed sample id, shard by shard (from the manifest: nothing is read)."""
        ids = [np.arange(a, b + 1) for s in self.manifest["shards"] for a, b in s["sample_ids"]]
        return np.concatenate(ids) if ids else np.zeros(0, np.int64)

    # -- samples --------------------------------------------------------------------------------

    def sample(self, sample_id: int) -> SampleView:
        """One sample by its input id: tokens, loss mask, float32 hidden states per layer, top-k."""
        try:
            got = self._reader.sample(int(sample_id))
        except KeyError:
            raise UserError(f"{self.path}: no committed sample with id {sample_id}") from None
        h = got.hidden
        return SampleView(
            sample_id=int(sample_id), shard=got.shard, input_ids=got.input_ids, loss_mask=got.loss_mask,
            hidden={lid: h[:, j] for j, lid in enumerate(self.layer_ids)}, topk_ids=got.topk_ids,
            topk_logprobs=None if got.topk_logprobs is None else got.topk_logprobs.astype(np.float32))

    def _token_sample(self, max_tokens: int, seed: int) -> np.ndarray:
        """float32 [T, n, H] hidden states of whole samples drawn at random (seeded) across the
        cache until max_tokens: statistics over a bounded read, whatever the cache size."""
        rng = np.random.default_rng(seed)
        refs = [(s["name"], k) for s in self.manifest["shards"] for k in range(s["samples"])]
        if not refs:
            raise UserError(f"{self.path}: no committed samples yet")
        parts, total = [], 0
        for i in rng.permutation(len(refs)):
            name, k = refs[i]
            sh = self._reader.shard(name)
            a, b = int(sh.offsets[k]), int(sh.offsets[k + 1])
            take = min(b - a, max_tokens - total)
            parts.append(bf16_bits_to_float32(sh.group["hidden"][a:a + take]))
            total += take
            if total >= max_tokens:
                break
        return np.concatenate(parts)

    # -- statistics -----------------------------------------------------------------------------

    def layer_stat_records(self, max_tokens: int = 16384, seed: int = 0) -> list[dict]:
        h = self._token_sample(max_tokens, seed)
        out = []
        for j, lid in enumerate(self.layer_ids):
            x = h[:, j].astype(np.float64)
            ch_rms = np.sqrt((x ** 2).mean(0))
            med = float(np.median(ch_rms))
            ratio = ch_rms / max(med, 1e-30)
            outliers = np.flatnonzero(ratio > OUTLIER_RATIO)
            outliers = outliers[np.argsort(-ratio[outliers])]
            out.append({
                "layer": lid, "tokens": int(x.shape[0]), "mean": float(x.mean()), "std": float(x.std()),
                "absmax": float(np.abs(x).max()), "rms": float(np.sqrt((x ** 2).mean())),
                "token_norm_mean": float(np.linalg.norm(x, axis=1).mean()),
                "outlier_channels": [int(c) for c in outliers[:8]],
                "outlier_ratio_max": float(ratio.max()),
            })
        return out

    def layer_stats(self, max_tokens: int = 16384, seed: int = 0):
        """pandas DataFrame: per captured layer mean, std, absmax, rms, mean token norm, and the
        outlier channels (RMS > OUTLIER_RATIO x the median channel's) over a seeded sample."""
        return _frame(self.layer_stat_records(max_tokens, seed))

    # -- plots ----------------------------------------------------------------------------------

    def plot_norms(self, sample_id: int, ax=None):
        """Norm of each captured layer's state along one sample; the response (loss mask) shaded."""
        import matplotlib.pyplot as plt

        s = self.sample(sample_id)
        if ax is None:
            _, ax = plt.subplots(figsize=(9, 3.5))
        for lid, n in s.norms().items():
            ax.plot(n, label=f"layer {lid}", lw=1)
        resp = np.flatnonzero(s.loss_mask)
        if resp.size:
            ax.axvspan(resp[0], resp[-1], color="0.9", zorder=0, label="response")
        ax.set(xlabel="position", ylabel="L2 norm", yscale="log", title=f"sample {sample_id} ({s.shard})")
        ax.legend(fontsize=7, ncol=min(6, len(s.hidden) + 1))
        return ax.figure

    def plot_distributions(self, max_tokens: int = 16384, seed: int = 0, bins: int = 120):
        """Per layer: histogram of values (log counts) and RMS per channel (outliers stand out)."""
        import matplotlib.pyplot as plt

        h = self._token_sample(max_tokens, seed)
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
        for j, lid in enumerate(self.layer_ids):
            x = h[:, j].ravel()
            lim = float(np.percentile(np.abs(x), 99.99)) or 1.0
            a.hist(x, bins=bins, range=(-lim, lim), histtype="step", log=True, label=f"layer {lid}")
            b.plot(np.sqrt((h[:, j].astype(np.float64) ** 2).mean(0)), lw=0.7, label=f"layer {lid}")
        a.set(xlabel="value (to the 99.99th percentile of |x|)", ylabel="count", title="values")
        b.set(xlabel="channel", ylabel="RMS over tokens", yscale="log", title="channels")
        a.legend(fontsize=7)
        fig.tight_layout()
        return fig

    # -- text -----------------------------------------------------------------------------------

    def summary(self, stats: bool = True, max_tokens: int = 16384) -> str:
        m = self.manifest
        t, tg = m["totals"], m["target"]
        lines = [
            repr(self),
            f"target: {tg['path']} ({tg['model_type']}, {tg['num_layers']} layers, hidden {tg['hidden_size']}, "
            f"vocabulary {tg['vocab_size']})",
            f"capture: layers {self.layer_ids}, top-k {self.topk}, {m['capture']['hidden_dtype']}"
            + (f", computed in {m['capture']['compute_dtype']}" if m["capture"].get("compute_dtype") else "")
            + f", max length {m['capture']['max_len']}",
            f"source: {m['source']['rows']} rows in {len(m['source']['files'])} files; "
            f"{t['bytes'] / 1e9:.3f} GB on storage ({t['bytes'] / max(t['tokens'], 1):.0f} bytes/token)",
        ]
        recs = self.shard_records()
        if recs:
            lines.append(f"{'shard':<16} {'samples':>8} {'tokens':>10} {'MB':>9}  ids")
            show = recs if len(recs) <= 12 else recs[:6] + [None] + recs[-5:]
            for r in show:
                if r is None:
                    lines.append(f"  ... {len(recs) - 11} more")
                    continue
                lines.append(f"{r['shard']:<16} {r['samples']:>8} {r['tokens']:>10} {r['bytes'] / 1e6:>9.1f}  "
                             f"{r['first_id']}..{r['last_id']} ({r['id_ranges']} range{'s' if r['id_ranges'] > 1 else ''})")
            if stats:
                lines.append(f"per layer, over {min(max_tokens, t['tokens'])} tokens of random samples:")
                lines.append(f"{'layer':>5} {'mean':>9} {'std':>9} {'absmax':>9} {'rms':>9} {'|token|':>9}  outlier channels")
                for r in self.layer_stat_records(max_tokens):
                    oc = ", ".join(map(str, r["outlier_channels"])) or "-"
                    lines.append(f"{r['layer']:>5} {r['mean']:>9.4f} {r['std']:>9.4f} {r['absmax']:>9.2f} {r['rms']:>9.4f} "
                                 f"{r['token_norm_mean']:>9.2f}  {oc}")
        return "\n".join(lines)


def _frame(records: list[dict]):
    try:
        import pandas as pd
    except ImportError:
        raise UserError("tables need pandas: pip install 'dflash-offline[notebook]'") from None
    return pd.DataFrame.from_records(records)
