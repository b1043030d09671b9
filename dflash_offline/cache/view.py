"""A typed, read-only view of a cache manifest: what its readers ask of it.

The manifest is a JSON document (cache-contract.md) that `cache/manifest.py` writes and commits;
readers (train's preflight and held-out walk, eval's cache estimate) read the same few facts from
it: its state, the target it came from, the captured layers and their storage, the plan. They read
them here, by name, instead of indexing nested dicts, so a key is spelled once and a missing or
renamed one fails in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Totals(NamedTuple):
    """The committed shards' sums."""

    samples: int
    tokens: int
    bytes: int


@dataclass(frozen=True)
class ManifestView:
    status: str  # "extracting" | "complete"
    target_path: str  # the model folder extract read (for information; not compared)
    model_type: str
    hidden_size: int  # the target's
    vocab_size: int  # the target's
    num_target_layers: int  # the target's decoder layers
    weights_fingerprint: str | None
    config_sha256: str | None
    layer_ids: tuple[int, ...]  # the captured layers, in the cache's order
    hidden_dtype: str  # storage of the hidden states (bfloat16 or float8_e4m3fn)
    topk: int  # top-k log-probabilities per token (0: none)
    num_shards: int  # shards the plan makes
    shards_committed: int
    plan_tokens: int | None  # tokens the plan holds (None: a cache from before the plan counted them)
    released: int  # shards a streaming trainer consumed and deleted
    budget_bytes: int | None
    max_shard_bytes: int | None
    consumers: tuple[str, ...]  # trainers registered to consume it (train --follow)
    chat: dict | None  # how the training text was rendered (prepare's chat settings), carried to the export
    compute_dtype: str | None  # the dtype the target ran in (None: a cache from before it was recorded)
    max_len: int | None  # samples were cut to this many tokens
    totals: Totals
    source_rows: int | None  # input rows extract read
    source_files: int  # input files extract read

    def missing_layers(self, want) -> list[int]:
        """The layers of `want` the cache did not capture."""
        return [int(i) for i in want if int(i) not in self.layer_ids]

    def layer_columns(self, want) -> list[int] | None:
        """Where layers `want` sit on the cache's layer axis (hidden is [tokens, n, H]), in `want`'s
        order; None when `want` is every captured layer in the cache's order (the rows as stored).
        The one place a drafter's layers become columns: train (--target-layers) and eval's walk
        ask it. Refuse `missing_layers(want)` first."""
        want = [int(i) for i in want]
        return None if want == list(self.layer_ids) else [self.layer_ids.index(i) for i in want]

    @classmethod
    def of(cls, m: dict) -> "ManifestView":
        target, capture, plan, totals, source = m["target"], m["capture"], m["plan"], m["totals"], m.get("source") or {}
        return cls(
            status=m["status"], target_path=str(target.get("path", "")), model_type=str(target.get("model_type", "")),
            hidden_size=int(target["hidden_size"]), vocab_size=int(target["vocab_size"]),
            num_target_layers=int(target["num_layers"]),
            weights_fingerprint=target.get("weights_fingerprint"), config_sha256=target.get("config_sha256"),
            layer_ids=tuple(capture["layer_ids"]), hidden_dtype=capture["hidden_dtype"],
            topk=int(capture.get("topk") or 0), num_shards=int(plan["num_shards"]),
            shards_committed=len(m.get("shards") or []), plan_tokens=plan.get("tokens"),
            released=len(m.get("released") or []), budget_bytes=m.get("budget_bytes"),
            max_shard_bytes=m.get("max_shard_bytes"), consumers=tuple(m.get("consumers") or {}), chat=m.get("chat"),
            compute_dtype=capture.get("compute_dtype"), max_len=capture.get("max_len"),
            totals=Totals(int(totals["samples"]), int(totals["tokens"]), int(totals["bytes"])),
            source_rows=source.get("rows"), source_files=len(source.get("files") or []),
        )
