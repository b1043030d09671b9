"""What an extract run will do, as pure functions of the input and the options: rows -> shards,
samples -> batches, and the bytes each shard takes on storage.

The plan (which rows make which shard, in which order) never depends on the number of workers:
shard j belongs to worker j % W, so one worker, two workers, or a resumed run all write the same
shards with the same contents. `Job` carries it to the workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_offline.config import ExtractConfig


@dataclass
class Job:
    """Everything a worker needs (it crosses a process spawn before the log opens: its fields are
    plain data and the config's light dataclass)."""

    cfg: ExtractConfig
    target_path: str
    layer_ids: list[int]
    hidden_size: int
    source: dict  # data.Source as plain fields
    shards: list[np.ndarray]  # global rows of each shard, in write order
    compute_dtype: str  # resolved: bfloat16 / float16 / float32
    shard_bytes: list[int]  # planned bytes of each shard on storage (the budget's reservation)


def pass_order(num_rows: int, p: int) -> np.ndarray:
    """The order in which pass p visits the input rows: the input order for pass 0, a fixed
    permutation of it for each later pass (extract --passes), so every pass is shuffled anew."""
    if p == 0:
        return np.arange(num_rows)
    return np.random.default_rng([p, 0x9A55]).permutation(num_rows)


def make_plan(lengths: np.ndarray, max_len: int, shard_tokens: int, sort_window: int,
              passes: int = 1) -> list[np.ndarray]:
    """Rows -> shards. Within each window of `sort_window` rows (in the pass's order), rows are
    ordered longest first (ties by row), then cut into shards of at most `shard_tokens` tokens (a
    single longer sample makes a shard of its own). Longest first: the first batch is the largest,
    so a batch that does not fit in memory fails in the first seconds, not hours in. With several
    passes the shards of pass p follow those of pass p - 1."""
    if passes > 1:
        return [s for p in range(passes) for s in pass_plan(lengths, max_len, shard_tokens, sort_window, p)]
    return pass_plan(lengths, max_len, shard_tokens, sort_window, 0)


def pass_plan(lengths: np.ndarray, max_len: int, shard_tokens: int, sort_window: int, p: int) -> list[np.ndarray]:
    """The shards of pass p alone (make_plan's rule); the manifest counts each pass's shards."""
    tl = np.minimum(lengths, max_len)
    order = pass_order(tl.shape[0], p)
    shards: list[np.ndarray] = []
    cur: list[int] = []
    cur_tokens = 0
    for w in range(0, tl.shape[0], sort_window):
        rows = order[w:w + sort_window]
        rows = rows[np.lexsort((np.arange(rows.shape[0]), -tl[rows]))]  # ties keep the pass's order
        for r in rows:
            t = int(tl[r])
            if cur and cur_tokens + t > shard_tokens:
                shards.append(np.asarray(cur, np.int64))
                cur, cur_tokens = [], 0
            cur.append(int(r))
            cur_tokens += t
    if cur:
        shards.append(np.asarray(cur, np.int64))
    return shards


def make_batches(lengths: list[int], batch_tokens: int) -> list[tuple[int, int]]:
    """Consecutive samples -> [start, end) batches with rows x longest row <= batch_tokens."""
    out, a = [], 0
    while a < len(lengths):
        b, longest = a, 0
        while b < len(lengths) and max(longest, lengths[b]) * (b - a + 1) <= batch_tokens:
            longest = max(longest, lengths[b])
            b += 1
        b = max(b, a + 1)
        out.append((a, b))
        a = b
    return out


def reserved_bytes(tokens: int, bpt: int, chunk_tokens: int) -> int:
    """What a shard of `tokens` tokens may take on storage: whole chunks (the last one is written
    full size) plus a little metadata. The budget reserves this before the shard starts."""
    return -(-tokens // chunk_tokens) * chunk_tokens * bpt + 64 * 1024


def bytes_per_token(cache_layers: int, hidden_size: int, topk: int, hidden_dtype: str = "bfloat16") -> int:
    """hidden (bf16: 2 bytes a value; fp8: 1 byte a value + a float32 scale a layer) + top-k ids
    (int32) and log-probs (fp16) + input_ids (int32) + loss_mask (uint8)."""
    hidden = cache_layers * hidden_size * 2 if hidden_dtype == "bfloat16" else cache_layers * (hidden_size + 4)
    return hidden + topk * 6 + 5
