"""`plan`'s options: the extract and train settings it sizes, with both stages' defaults as its own
(one source of truth: read from ExtractConfig and TrainConfig, not copied). Its own module, so that
extract's, generate's and prepare's config module does not import train's."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_offline.config import ExtractConfig, check_distinct_layers
from dflash_offline.options import Configured, check_at_least, check_positive, opt
from dflash_offline.runtime.errors import UserError
from dflash_offline.train.config import TrainConfig

_E, _T = ExtractConfig(), TrainConfig()  # the stages' defaults: one source of truth for plan's


@dataclass
class PlanConfig(Configured):
    """`plan`: what extract would write (its target, data, layers, top-k, max length) and what
    training would read; the GPU counts only divide the estimated hours."""
    target: str = opt("", "Hugging Face model folder (config.json + *.safetensors).")
    data: list[str] | None = opt(None, "Parquet file or folder of *.parquet; repeat for several.")
    cache: str | None = opt(None, "Where the cache would go: its free space is the budget.")
    max_bytes: int | None = opt(None, "A budget for the cache (e.g. 64GB).", size=True)
    capture_layers: list[int] | None = opt(None, "Target layer ids to capture.", default_text="the DFlash rule", old=("layers",))
    capture_count: int = opt(_E.capture_count, "How many layers the DFlash rule picks.", default_text="extract's", old=("num_layers",))
    topk: int = opt(_E.topk, "Top-k log-probabilities per token.", default_text="extract's")
    max_len: int = opt(_E.max_len, "Truncation length.", default_text="extract's")
    extract_gpus: int = opt(5, "GPUs extracting, >= 1 (they divide the estimated hours).")
    train_gpus: int = opt(3, "GPUs training, >= 1 (they divide the estimated hours).")
    epochs: int = opt(_T.epochs, "Training epochs.", default_text="train's")
    drafter_layers: int = _T.drafter_layers
    seq_len: int = _T.seq_len
    num_anchors: int = _T.num_anchors
    block_size: int = _T.block_size

    def validate(self) -> None:
        if not self.target or not self.data:
            raise UserError("plan: --target and --data are required")
        check_positive(self, "max_bytes", "capture_count", "max_len", "extract_gpus", "train_gpus", "epochs",
                       "drafter_layers", "seq_len", "num_anchors", "block_size")
        check_at_least(self, "topk", 0, "0 = store no top-k")
        check_distinct_layers(self)
