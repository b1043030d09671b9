"""A batch's evidence table, made on the extracting device from the layer outputs about to be
written (cache/evidence.py says what the columns are and what the shard writer does with them).

A few reductions over what the forward already holds: one pass per layer for the sums and the
vector tests, one comparison per pair of layers. On a 27B target's batch (16K tokens x 5 layers x
5120) that reads the 0.8 GB of hidden states about a dozen times, a few milliseconds against the
forward's seconds, and it stays on the device: the table is copied to the host with the batch, so
no check waits for the GPU.
"""

from __future__ import annotations

import torch

from dflash_offline.cache.evidence import (ABSMAX, COLUMNS, EQ_EMBED, FIRST_NONFINITE, NONFINITE, SAME_AS_FIRST, SUM,
                                           SUMSQ, ZERO, table_columns)


def batch_evidence(hidden: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """hidden [N, n, H] (the compute dtype), embeddings [N, H] (the token embeddings at the same
    positions) -> float64 [n, table_columns(n)] on their device."""
    N, n, _ = hidden.shape
    out = torch.zeros((n, table_columns(n)), dtype=torch.float64, device=hidden.device)
    index = torch.arange(N, device=hidden.device)
    for i in range(n):
        h = hidden[:, i]
        hf = h.float()
        out[i, SUM] = hf.sum(dtype=torch.float64)
        out[i, SUMSQ] = hf.square().sum(dtype=torch.float64)
        out[i, ABSMAX] = hf.abs().amax() if N else 0.0
        out[i, ZERO] = (h == 0).all(-1).sum()
        bad = ~torch.isfinite(h).all(-1)
        out[i, NONFINITE] = bad.sum()
        out[i, FIRST_NONFINITE] = torch.where(bad, index, N).amin() if N else 0
        out[i, SAME_AS_FIRST] = (h == h[:1]).all(-1).sum() if N else 0
        out[i, EQ_EMBED] = (h == embeddings).all(-1).sum()
        out[i, len(COLUMNS) + i] = N
        for j in range(i + 1, n):
            same = (h == hidden[:, j]).all(-1).sum()
            out[i, len(COLUMNS) + j] = same
            out[j, len(COLUMNS) + i] = same
    return out
