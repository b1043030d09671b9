"""What training rows pack: pieces of the cache's samples, and what a rule leaves out of them.

A sample of at most `seq_len` tokens is one piece, the whole sample. A longer one cannot be one
document of a row. `--long-samples split` (the default) cuts it into pieces of at most `seq_len`
tokens, each packed as its own document, that hold every trained token (loss_mask 1) exactly once
(`split_trained`); `--long-samples truncate` keeps its first `seq_len` tokens, the rule of earlier
versions. A piece's hidden states were computed by the target over the sample's whole context, so
they still carry its prefix; what a piece loses is the drafter's attention to context keys before
its start.

Everything here is a pure function of the cache's content and the options, as the packing is: a
resumed run, any rank and any loader process rebuild the same pieces. When every sample fits, each
sample is its one piece and the rows are those earlier versions packed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

SPLIT, TRUNCATE = "split", "truncate"


class Piece(NamedTuple):
    """Tokens [start, start + length) of sample `sample` (an index into the run's refs)."""

    sample: int
    start: int
    length: int


@dataclass(frozen=True)
class Pieces:
    """Every piece of a run's samples, sample by sample: sample s's pieces are
    `first[s]:first[s + 1]`, in token order (none for a long sample with no trained token)."""

    sample: np.ndarray  # int64 [P]
    start: np.ndarray  # int64 [P]
    length: np.ndarray  # int64 [P]
    first: np.ndarray  # int64 [samples + 1]

    @classmethod
    def make(cls, lengths: np.ndarray, seq_len: int, splits: dict[int, list[tuple[int, int]]] | None = None) -> "Pieces":
        """One piece per sample, its first min(length, seq_len) tokens, except the samples in `splits`
        (sample -> its (start, length) pieces)."""
        lengths = np.asarray(lengths, np.int64)
        counts = np.ones(lengths.shape[0], np.int64)
        for s, parts in (splits or {}).items():
            counts[s] = len(parts)
        first = np.zeros(lengths.shape[0] + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        sample = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), counts)
        start = np.zeros(sample.shape[0], np.int64)
        length = np.minimum(lengths, seq_len)[sample]
        for s, parts in (splits or {}).items():
            at = slice(int(first[s]), int(first[s + 1]))
            start[at] = [a for a, _ in parts]
            length[at] = [n for _, n in parts]
        return cls(sample, start, length, first)

    def __len__(self) -> int:
        return int(self.sample.shape[0])

    def in_order(self, order: np.ndarray) -> np.ndarray:
        """Indices of the pieces, sample by sample in `order`, each sample's in token order."""
        order = np.asarray(order, np.int64)
        counts = (self.first[1:] - self.first[:-1])[order]
        # piece j of the k-th sample in order sits at first[order[k]] + (j - its pieces before)
        return np.repeat(self.first[order] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))


def split_trained(loss_mask: np.ndarray, seq_len: int) -> list[tuple[int, int]]:
    """(start, length) pieces of a sample longer than `seq_len`, in token order: every trained token
    in exactly one piece, as few pieces as can hold them, each as much context as `seq_len` allows.

    Built from the sample's end: a piece ends at the last trained token not yet held and reaches
    back `seq_len` tokens (or to the sample's start). A prompt followed by its completion thus
    keeps the prompt tokens right before the completion, and a span of untrained tokens longer
    than a row (a long prompt, a turn not trained on) starts no piece of its own. A sample with no
    trained token has no piece."""
    trained = np.flatnonzero(np.asarray(loss_mask))
    parts: list[tuple[int, int]] = []
    k = trained.shape[0]
    while k > 0:
        end = int(trained[k - 1]) + 1
        start = max(0, end - seq_len)
        parts.append((start, end - start))
        k = int(np.searchsorted(trained, start))  # the trained tokens before this piece
    return parts[::-1]


def pack_pieces(pieces: Pieces, order: np.ndarray, seq_len: int) -> list[list[Piece]]:
    """Greedy packing of the pieces, sample by sample in `order`: a piece that does not fit in the
    rest of the current row starts a new row (a piece is never cut across rows: a block must never
    see context from another row)."""
    idx = pieces.in_order(order)
    rows: list[list[Piece]] = []
    cur: list[Piece] = []
    used = 0
    for s, a, n in zip(pieces.sample[idx].tolist(), pieces.start[idx].tolist(), pieces.length[idx].tolist()):
        if used + n > seq_len:
            rows.append(cur)
            cur, used = [], 0
        cur.append(Piece(s, a, n))
        used += n
    if cur:
        rows.append(cur)
    return rows


@dataclass(frozen=True)
class LongSamples:
    """What the rule did with the samples longer than `seq_len`, in counts: for the one line
    preflight says about them (`line`)."""

    rule: str  # SPLIT or TRUNCATE
    seq_len: int
    samples: int  # the cache's (or the window's)
    long: int  # of them longer than seq_len
    longest: int  # tokens of the longest sample
    pieces: int  # the long samples' pieces in the rows
    trained: int  # trained tokens of all the samples (0 when no sample is long: not counted)
    trained_long: int  # of them in the long samples
    lost: int  # trained tokens no piece holds (truncate)
    empty: int  # long samples whose pieces hold no trained token (split: none packed; truncate: packed)

    def line(self, flag: str, again: str, option: str) -> str | None:
        """One line for the terminal, None when every sample fits. `flag`: how --seq-len was given
        (`again`: the same, named a second time), `option`: how --long-samples is named."""
        if not self.long:
            return None
        head = f"{self.long:,} of {self.samples:,} samples are longer than {flag} {self.seq_len} (up to {self.longest:,} tokens)"
        whole = f"{again} {self.longest} keeps every sample whole"
        if self.rule == TRUNCATE:
            share = 100 * self.lost / max(self.trained, 1)
            empty = f"; {self.empty:,} of them keep no trained token and train nothing" if self.empty else ""
            return (f"{head} and keep their first {self.seq_len} tokens ({option} {TRUNCATE}): {self.lost:,} of the "
                    f"{self.trained:,} trained tokens ({share:.1f}%) are not trained{empty}; {option} {SPLIT} trains "
                    f"them all, or {whole}")
        empty = f"; {self.empty:,} of them hold no trained token and are left out" if self.empty else ""
        return (f"{head}: split into {self.pieces:,} pieces of at most {self.seq_len} tokens, each packed as its own "
                f"document, so all {self.trained_long:,} of their trained tokens are trained{empty}; a piece's blocks "
                f"see no context before its start: {whole}")


@dataclass(frozen=True)
class SampleTable:
    """A run's samples (an epoch's: the cache's; a --follow window's: its shards'), as the loaders
    read them and the packing orders them."""

    refs: list  # (shard, sample, first token)
    lengths: np.ndarray  # int64 tokens of each sample
    ids: list[int]  # each sample's id
    pieces: Pieces
    long: LongSamples


def scan_samples(shards, seq_len: int, rule: str = SPLIT) -> SampleTable:
    """The SampleTable of `shards` ((name, cache.reader.Shard), in order). Reads the sample offsets,
    and the loss masks only when a sample is longer than `seq_len` (one byte a token: to place the
    pieces, and to count the trained tokens the line about them gives)."""
    shards = list(shards)
    refs, lengths, ids = [], [], []
    for name, sh in shards:
        offs = sh.offsets
        lengths.extend((offs[1:] - offs[:-1]).tolist())
        refs.extend((name, k, int(offs[k])) for k in range(len(offs) - 1))
        ids.extend(int(i) for i in sh.ids)
    lengths = np.asarray(lengths, np.int64)
    long = np.flatnonzero(lengths > seq_len)
    if not long.size:
        counts = LongSamples(rule, seq_len, len(refs), 0, int(lengths.max(initial=0)), 0, 0, 0, 0, 0)
        return SampleTable(refs, lengths, ids, Pieces.make(lengths, seq_len), counts)
    splits: dict[int, list[tuple[int, int]]] = {}
    trained = trained_long = lost = empty = 0
    base = 0
    for name, sh in shards:
        mask = sh.group["loss_mask"][:]
        trained += int(np.count_nonzero(mask))
        offs = sh.offsets
        for s in long[(long >= base) & (long < base + len(offs) - 1)].tolist():
            m = mask[int(offs[s - base]):int(offs[s - base + 1])]
            held = int(np.count_nonzero(m))
            trained_long += held
            if rule == SPLIT:
                splits[s] = split_trained(m, seq_len)
            else:
                lost += held - int(np.count_nonzero(m[:seq_len]))
            empty += not np.count_nonzero(m if rule == SPLIT else m[:seq_len])
        base += len(offs) - 1
    pieces = Pieces.make(lengths, seq_len, splits if rule == SPLIT else None)
    n_pieces = int((pieces.first[long + 1] - pieces.first[long]).sum())
    counts = LongSamples(rule, seq_len, len(refs), int(long.size), int(lengths.max()), n_pieces, trained,
                         trained_long, lost, empty)
    return SampleTable(refs, lengths, ids, pieces, counts)
