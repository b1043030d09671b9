"""What extraction keeps of each shard's content, and the refusal of a degenerate layer before the
shard commits.

The checksums prove that a shard's bytes are the bytes written, not that they are right: a forward
that skipped a layer (vLLM's extraction wrote all-zero states for Qwen3.5 targets), overflowed, or
captured the wrong module writes intact shards that train a drafter which then serves at tau 1.2.
So for every batch the extracting device reduces the layer outputs it is about to write to a small
table, one row per captured layer (extract/evidence.py makes it; the columns are COLUMNS, then one
per captured layer: how many of the batch's vectors equal that layer's); it travels to the shard's
writer process with the batch. The writer checks each table as it lands (`check_batch`): a layer
whose vectors are all zero, all the same vector, non-finite anywhere, or all equal to another
layer's or to the token embeddings (the layer's input, never a real layer's output) ends the run
with one line naming the layer and the first sample, and nothing of the shard is committed. The
tables added up over the shard (`LayerEvidence`) are written into the shard's attributes as
`layer_stats`: per layer id its mean, std and absmax over every element, and the counts of its
all-zero, non-finite and embedding-equal vectors. No torch here: the writer processes import this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

COLUMNS = ("sum", "sumsq", "absmax", "zero_vectors", "nonfinite_vectors", "first_nonfinite", "same_as_first",
           "equal_to_embeddings")
(SUM, SUMSQ, ABSMAX, ZERO, NONFINITE, FIRST_NONFINITE, SAME_AS_FIRST, EQ_EMBED) = range(len(COLUMNS))


def table_columns(layers: int) -> int:
    """Columns of a batch's table: COLUMNS, then one per captured layer."""
    return len(COLUMNS) + layers


class DegenerateLayer(Exception):
    """A captured layer's outputs cannot be a real layer's (one line: which layer, sample, shard)."""


# What each kind of degenerate layer points at, and what to do; nothing of the shard is committed.
NOT_WRITTEN = ("the target's forward did not write this layer (a model class or kernel that skips it, a capture on "
               "the wrong module); nothing of the shard was committed: run the target alone on that sample and "
               "look at the layer's output, or capture other layers (--capture-layers)")
OVERFLOW = ("the forward overflowed or diverged there (a compute dtype too narrow for the target's activations, a "
            "broken kernel); nothing of the shard was committed: extract with --compute-dtype float32 or bfloat16, "
            "or run the target alone on that sample")


def check_batch(table: np.ndarray, layer_ids: list[int], samples: list[tuple[int, int]], shard: str,
                one_token: bool = False) -> None:
    """Raise DegenerateLayer for the first degenerate layer of a batch: `table` [n, table_columns],
    `samples` the batch's (sample id, tokens) in row order. `one_token`: every token of the batch
    is the same id, where a real target does give one vector at every position (its attention
    averages equal values): the repeated-vector rule is not applied then."""
    n_vec = sum(t for _, t in samples)
    first = samples[0][0]

    def sample_at(index: int) -> int:
        ends = np.cumsum([t for _, t in samples])
        return samples[int(np.searchsorted(ends, index, side="right"))][0]

    for i, lid in enumerate(layer_ids):
        row = table[i]
        where = f"{shard}, sample {first}'s batch of {n_vec} tokens"
        if row[NONFINITE] > 0:
            s = sample_at(int(row[FIRST_NONFINITE]))
            raise DegenerateLayer(f"layer {lid} holds non-finite values (NaN or inf) in {int(row[NONFINITE])} of "
                                  f"{n_vec} vectors, the first in sample {s} ({shard}): {OVERFLOW}")
        if row[ZERO] == n_vec:
            raise DegenerateLayer(f"layer {lid} is all zeros ({where}): {NOT_WRITTEN}")
        if n_vec > 1 and not one_token and row[SAME_AS_FIRST] == n_vec:
            raise DegenerateLayer(f"layer {lid} is one vector repeated at every position ({where}): {NOT_WRITTEN}")
        if row[EQ_EMBED] == n_vec:
            raise DegenerateLayer(f"layer {lid} equals the token embeddings, its input ({where}): {NOT_WRITTEN}")
        for j, other in enumerate(layer_ids):
            if j != i and row[len(COLUMNS) + j] == n_vec:
                raise DegenerateLayer(f"layer {lid} equals layer {other} at every position ({where}): {NOT_WRITTEN}")


@dataclass
class LayerEvidence:
    """A shard's tables added up: `summary()` is its `layer_stats` attribute."""

    layer_ids: list[int]
    hidden_size: int
    vectors: int = 0
    table: np.ndarray | None = field(default=None, repr=False)

    def add(self, table: np.ndarray, vectors: int) -> None:
        t = np.asarray(table, np.float64)
        if self.table is None:
            self.table = np.zeros_like(t)
            self.table[:, ABSMAX] = 0.0
        self.table[:, [SUM, SUMSQ, ZERO, NONFINITE, EQ_EMBED]] += t[:, [SUM, SUMSQ, ZERO, NONFINITE, EQ_EMBED]]
        self.table[:, ABSMAX] = np.maximum(self.table[:, ABSMAX], t[:, ABSMAX])
        self.table[:, len(COLUMNS):] += t[:, len(COLUMNS):]
        self.vectors += vectors

    def summary(self) -> dict:
        """{layer id: {mean, std, absmax, vectors, zero_vectors, nonfinite_vectors, equal_to_embeddings}}
        (JSON: keys are strings); std over every element of the layer in the shard."""
        if self.table is None:
            return {}
        out = {}
        elems = max(self.vectors * self.hidden_size, 1)
        for i, lid in enumerate(self.layer_ids):
            row = self.table[i]
            mean = row[SUM] / elems
            var = max(row[SUMSQ] / elems - mean * mean, 0.0)
            out[str(lid)] = {"mean": _num(mean), "std": _num(var ** 0.5), "absmax": _num(row[ABSMAX]),
                             "vectors": self.vectors, "zero_vectors": int(row[ZERO]),
                             "nonfinite_vectors": int(row[NONFINITE]), "equal_to_embeddings": int(row[EQ_EMBED])}
        return out


def _num(x: float) -> float | str:
    """A JSON number, or its name where JSON has none (a NaN sum of a layer that was refused)."""
    x = float(x)
    return x if np.isfinite(x) else str(x)
