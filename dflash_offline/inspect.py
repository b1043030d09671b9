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
    print(s.text())                # the tokens as text (the target's tokenizer.json), trained spans in [[ ]]
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import click
import numpy as np

from dflash_offline.cache.view import ManifestView
from dflash_offline.cache.reader import CacheReader, ShardUnreadable, bf16_bits_to_float32, damage_words
from dflash_offline.runtime.errors import UserError
from dflash_offline.status import folder_hint, held
from dflash_offline.text import TRAINED_MARKS, decode_spans, load_tokenizer, render, render_ansi, use_color

# A channel is an outlier when its RMS over tokens exceeds this multiple of the layer's median
# channel RMS (massive activations of LLM residual streams sit at 10-1000x).
OUTLIER_RATIO = 6.0


def open_cache(path: str, tokenizer: str | None = None) -> "CacheView":
    """A read-only view of a committed (or still extracting) cache at a path or fsspec URL.
    `tokenizer`: the folder (or tokenizer.json) that decodes its tokens, when the target folder the
    manifest names has moved."""
    return CacheView(path, tokenizer)


class DamagedShard(UserError):
    """A committed shard of the cache cannot be read back as written (the message names it and
    says to run `verify`)."""


@dataclass
class SampleView:
    sample_id: int
    shard: str
    input_ids: np.ndarray  # int32 [t]
    loss_mask: np.ndarray  # uint8 [t]
    hidden: dict[int, np.ndarray]  # layer id -> float32 [t, H]
    topk_ids: np.ndarray | None  # int32 [t, k]
    topk_logprobs: np.ndarray | None  # float32 [t, k]
    cache: "CacheView | None" = field(default=None, repr=False, compare=False)  # where its tokenizer comes from

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def norms(self) -> dict[int, np.ndarray]:
        """L2 norm over channels of each captured layer at every position: {layer: [t]}."""
        return {lid: np.linalg.norm(h, axis=-1) for lid, h in self.hidden.items()}

    def spans(self, tokenizer=None) -> list[tuple[str, bool]]:
        """[(text, trained)] for each maximal run of tokens with the same loss mask, each decoded on
        its own with the target's tokenizer (special tokens shown). `tokenizer`: a folder, a
        tokenizer.json or a `tokenizers.Tokenizer`; default the cache's (its manifest's target)."""
        if self.cache is not None and (tokenizer is None or isinstance(tokenizer, (str, os.PathLike))):
            tokenizer = self.cache.tokenizer(tokenizer)
        elif tokenizer is None:
            raise UserError(f"sample {self.sample_id}: no cache to take a tokenizer from; give tokenizer=DIR")
        elif isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer, "give the model folder that holds tokenizer.json")
        return decode_spans(tokenizer, self.input_ids.tolist(), self.loss_mask.tolist())

    def text(self, marks: tuple[str, str] | None = TRAINED_MARKS, tokenizer=None) -> str:
        """The sample as text, each trained span (loss_mask 1) between marks[0] and marks[1]
        (default [[ and ]]; None: no marks). `tokenizer` as for `spans`."""
        return render(self.spans(tokenizer), marks)


class CacheView:
    def __init__(self, path: str, tokenizer: str | None = None):
        self.path = str(path)
        self.tokenizer_path = tokenizer  # None: the target folder the manifest names
        self._tokenizers: dict = {}
        self._reader = CacheReader(self.path)
        self.manifest = self._reader.manifest  # the shard entries are read from it; every other fact from `view`
        self.view = ManifestView.of(self.manifest)
        self.layer_ids: list[int] = list(self.view.layer_ids)
        self.topk: int = self.view.topk
        self.hidden_size: int = self.view.hidden_size
        self.status: str = self.view.status

    def __repr__(self) -> str:
        v, t = self.view, self.view.totals
        return (f"<cache {self.path}: {self.status}, {v.shards_committed}/{v.num_shards} "
                f"shards, {t.samples} samples, {t.tokens} tokens, layers {self.layer_ids}>")

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

    def _ids_hint(self, wanted: int) -> str:
        """Which ids there are, near `wanted`: a chat cache's are sparse (each conversation's
        id, then id + k x 2^40 for its later turns), so a count of samples is no guide."""
        ids = np.sort(self.sample_ids)
        if not len(ids):
            return "the cache holds no committed sample yet"
        i = int(np.searchsorted(ids, wanted))
        near = [int(x) for x in ids[max(i - 1, 0):i + 1]]
        return (f"its {len(ids)} ids run from {int(ids[0])} to {int(ids[-1])} (not every number is one); the nearest: "
                f"{', '.join(map(str, near))}")

    # -- samples --------------------------------------------------------------------------------

    def sample(self, sample_id: int) -> SampleView:
        """One sample by its input id: tokens, loss mask, float32 hidden states per layer, top-k."""
        try:
            got = self._reader.sample(int(sample_id))
        except KeyError:
            raise UserError(f"{self.path}: no committed sample with id {sample_id}; {self._ids_hint(int(sample_id))}") from None
        except ShardUnreadable as e:
            raise self._damaged(e.shard, e.problem, f"sample {sample_id} cannot be read") from None
        h = got.hidden
        return SampleView(
            sample_id=int(sample_id), shard=got.shard, input_ids=got.input_ids, loss_mask=got.loss_mask,
            hidden={lid: h[:, j] for j, lid in enumerate(self.layer_ids)}, topk_ids=got.topk_ids,
            topk_logprobs=None if got.topk_logprobs is None else got.topk_logprobs.astype(np.float32), cache=self)

    def tokenizer(self, where: str | None = None):
        """The `tokenizers.Tokenizer` of the cache's target (tokenizer.json in the folder the
        manifest names, or in `where` / open_cache's `tokenizer`), loaded once."""
        where = str(where or self.tokenizer_path or self.view.target_path)
        if where not in self._tokenizers:
            self._tokenizers[where] = load_tokenizer(
                where, "give the model folder that holds tokenizer.json with --tokenizer DIR (in Python: "
                "open_cache(path, tokenizer=DIR))",
                "the target folder the cache's manifest names" if where == self.view.target_path else "")
        return self._tokenizers[where]

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
            try:
                sh = self._reader.shard(name)
                a, b = int(sh.offsets[k]), int(sh.offsets[k + 1])
                take = min(b - a, max_tokens - total)
                parts.append(bf16_bits_to_float32(sh.group["hidden"][a:a + take]))
            except ShardUnreadable as e:
                raise self._damaged(name, e.problem, "the per-layer statistics cannot be computed") from None
            except Exception as e:  # a chunk that fails its CRC32C, a shard shorter than its entry
                raise self._damaged(name, damage_words(e), "the per-layer statistics cannot be computed") from None
            total += take
            if total >= max_tokens:
                break
        return np.concatenate(parts)

    def _damaged(self, shard: str, problem: str, what: str) -> "DamagedShard":
        """The one line for a committed shard whose data cannot be read back as written."""
        return DamagedShard(f"{self.path}: shard {shard} is damaged, {what} ({problem}); run `dflash-offline verify "
                            f"{self.path}` to find every damaged shard and how to re-make it, or extract into a new cache")

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
        v, t = self.view, self.view.totals
        lines = [
            repr(self),
            f"target: {v.target_path} ({v.model_type}, {v.num_target_layers} layers, hidden {v.hidden_size}, "
            f"vocabulary {v.vocab_size})",
            f"capture: layers {self.layer_ids}, top-k {self.topk}, {v.hidden_dtype}"
            + (f", computed in {v.compute_dtype}" if v.compute_dtype else "")
            + f", max length {v.max_len}",
            f"source: {v.source_rows} rows in {v.source_files} files; "
            f"{t.bytes / 1e9:.3f} GB on storage ({t.bytes / max(t.tokens, 1):.0f} bytes/token)",
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
                lines.append(f"per layer, over {min(max_tokens, t.tokens)} tokens of random samples:")
                lines.append(f"{'layer':>5} {'mean':>9} {'std':>9} {'absmax':>9} {'rms':>9} {'|token|':>9}  outlier channels")
                for r in self.layer_stat_records(max_tokens):
                    oc = ", ".join(map(str, r["outlier_channels"])) or "-"
                    lines.append(f"{r['layer']:>5} {r['mean']:>9.4f} {r['std']:>9.4f} {r['absmax']:>9.2f} {r['rms']:>9.4f} "
                                 f"{r['token_norm_mean']:>9.2f}  {oc}")
        return "\n".join(lines)


def sample_text(s: SampleView, color: bool | None = None) -> str:
    """`inspect --sample ID --text`: a header line, then the sample as text, its trained spans in
    colour (ANSI; None: when stdout is a terminal) or between TRAINED_MARKS."""
    spans = s.spans()
    color = use_color(color)
    where = s.cache.tokenizer_path or s.cache.view.target_path
    head = (f"sample {s.sample_id} of {s.cache.path} ({s.shard}): {len(s)} tokens, {int(s.loss_mask.sum())} trained "
            + ("(in green)" if color else "(between {} and {})".format(*TRAINED_MARKS)) + f"; decoded with {where}")
    return head + "\n" + (render_ansi(spans) if color else render(spans))


def _frame(records: list[dict]):
    try:
        import pandas as pd
    except ImportError:
        raise UserError("tables need pandas: pip install 'dflash-offline[notebook]'") from None
    return pd.DataFrame.from_records(records)


# ----------------------------------------------------------------------------------------------
# The `inspect` and `verify` commands (cli.py parses their options)


def inspect_command(cache: str, sample_id: int | None, stats: bool, max_tokens: int, as_text: bool,
                    tokenizer: str | None, color: bool | None) -> None:
    """Summary of a cache (or of each cache a folder holds), and one sample, as tables or as text."""
    caches = held(cache, kinds=("cache",))
    if not caches:
        hint = folder_hint(cache, "inspect")  # a folder that holds runs only: how to look at them
        if hint:
            raise UserError(hint)
        caches = [cache]
    if as_text and sample_id is None:
        raise UserError("inspect --text shows one sample as text: give --sample ID")
    views = [open_cache(c, tokenizer) for c in caches]
    samples = [None] * len(views)
    if sample_id is not None:  # an unknown id, before the statistics' reads
        if len(views) == 1:
            samples = [views[0].sample(sample_id)]
        else:  # each cache that holds the id shows it; none holding it is refused
            samples = [_sample_or_none(v, sample_id) for v in views]
            if not any(s is not None for s in samples):
                raise UserError(f"{cache}: no committed sample with id {sample_id} in {', '.join(caches)}")
    for k, (view, s) in enumerate(zip(views, samples)):
        if as_text:  # the sample as text, instead of the summary
            if s is not None:
                click.echo(("\n" if k else "") + sample_text(s, color), color=True)  # ANSI only if colour is on
            continue
        click.echo(("\n" if k else "") + view.summary(stats=stats, max_tokens=max_tokens))
        if s is not None:
            _echo_sample(view, s)


def _sample_or_none(view, sample_id: int):
    try:
        return view.sample(sample_id)
    except DamagedShard:  # it holds the id, and cannot read it back: said, not skipped
        raise
    except UserError:  # this cache does not hold it
        return None


def _echo_sample(view, s) -> None:
    print(f"sample {s.sample_id} ({s.shard}): {len(s)} tokens, {int(s.loss_mask.sum())} in the response")
    print(f"  input_ids: {s.input_ids[:24].tolist()}{' ...' if len(s) > 24 else ''}")
    for lid, n in s.norms().items():
        print(f"  layer {lid:>3}: norm mean {n.mean():.2f}, min {n.min():.2f}, max {n.max():.2f} (position {int(n.argmax())})")
    if s.topk_ids is not None:
        print(f"  top-{view.topk} at position 0: {s.topk_ids[0].tolist()}")


def verify_cache(cache: str) -> int:
    """Re-read every committed shard against its checksum; print what is damaged and how to re-make
    it. Returns the exit status: 1 if any shard is damaged."""
    from tqdm import tqdm

    hint = folder_hint(cache, "verify")  # a folder that holds caches: name them
    if hint:
        raise UserError(hint)
    reader = CacheReader(cache)
    bad = {}
    for name in tqdm(reader.shard_names, unit="shard", desc="verify"):
        problem = reader.verify_shard(name)
        if problem is not None:
            bad[name] = problem
    m = reader.manifest
    print(f"{len(reader.shard_names) - len(bad)}/{len(reader.shard_names)} shards match their checksums "
          f"({m['status']}, {m['totals']['samples']} samples, {m['totals']['tokens']} tokens)", flush=True)
    if not bad:
        return 0
    for name, problem in bad.items():
        print(f"damaged: {name}: {problem}", file=sys.stderr)
    denied = [n for n, p in bad.items() if "PermissionError" in p]
    if denied:  # nothing is damaged there: deleting the entries would throw away good data
        print(f"{len(denied)} shard(s) cannot be read for lack of permission ({', '.join(denied[:5])}): give "
              "this user read access to their files, then verify again", file=sys.stderr)
    if len(denied) < len(bad):
        print(f"{len(bad) - len(denied)} damaged shard(s): to re-make them, delete their entries from "
              "manifest.json's shards (keep a copy) and run the extract command that made the cache again "
              "(it re-makes exactly those); or extract into a new cache", file=sys.stderr)
    return 1
