"""Typed configuration of each stage, and the TOML recipes that fill it.

One source of truth per value: the dataclass field holds the default, the CLI option names the
same field, and a recipe (`stages/<deployment>/<stage>.toml`) uses the same names. Command-line
values win over the recipe, the recipe over the defaults.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .runtime import UserError

HIDDEN_DTYPES = ("bfloat16",)


@dataclass
class ExtractConfig:
    target: str = ""
    """Local Hugging Face model folder (config.json + *.safetensors)."""
    data: list[str] = field(default_factory=list)
    """Parquet files or folders of *.parquet (cache-contract.md, Input)."""
    cache: str = ""
    """Cache location: a local path or an fsspec URL."""
    devices: str = "cpu"
    """`0,1,2,3,4` for one worker per GPU, `cpu` or `cpu,cpu` for CPU workers."""
    layers: list[int] | None = None
    """Target decoder layer ids to capture; None = the DFlash rule with `num_layers` layers."""
    num_layers: int = 5
    """How many layers the DFlash rule picks when `layers` is not given."""
    topk: int = 32
    """Top-k log-probabilities stored per token; 0 stores none and skips the LM head."""
    max_len: int = 4096
    """Samples longer than this are truncated to their first max_len tokens."""
    batch_tokens: int = 16384
    """Token budget of one forward batch, padding included (rows x longest row)."""
    shard_tokens: int = 65536
    """Tokens per shard (a shard is the unit of commit and of resume)."""
    sort_window: int = 8192
    """Rows are length-sorted within windows of this many input rows (keeps reads local)."""
    chunk_tokens: int = 1024
    """Zarr chunk length along the token axis."""
    logits_chunk_tokens: int = 2048
    """Tokens per LM-head chunk when computing top-k (bounds the full-vocabulary logits)."""
    hidden_dtype: str = "bfloat16"
    """Storage dtype of hidden states."""
    compute_dtype: str = "auto"
    """Target weights/activations: auto = bfloat16 on GPU, float32 on CPU."""
    max_bytes: int | None = None
    """Refuse to start when the estimated cache size exceeds this many bytes."""
    log_dir: str | None = None
    """Where process logs go; default CACHE/logs (a local folder `dflash-logs` for URL caches)."""
    progress: bool = True
    """Show a progress bar on the terminal."""

    def validate(self) -> None:
        if not self.target:
            raise UserError("no target: pass --target DIR (a Hugging Face model folder) or set `target` in --config")
        if not self.data:
            raise UserError("no input: pass --data PATH (Parquet files or folders) or set `data` in --config")
        if not self.cache:
            raise UserError("no cache location: pass --cache PATH|URL or set `cache` in --config")
        for name in ("max_len", "batch_tokens", "shard_tokens", "sort_window", "chunk_tokens",
                     "logits_chunk_tokens", "num_layers"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.topk < 0:
            raise UserError(f"--topk must be >= 0, got {self.topk}")
        if self.batch_tokens < self.max_len:
            raise UserError(
                f"--batch-tokens {self.batch_tokens} is smaller than --max-len {self.max_len}: "
                "one batch must hold the longest sample; raise --batch-tokens or lower --max-len"
            )
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise UserError(f"--hidden-dtype {self.hidden_dtype!r} is not supported; choose one of {HIDDEN_DTYPES}")
        if self.compute_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise UserError(f"--compute-dtype {self.compute_dtype!r}: choose auto, bfloat16, float16 or float32")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise UserError(f"--layers {self.layers} lists a layer twice")


def parse_int_list(text: str | list | None) -> list[int] | None:
    """`"1,9,17"` or `[1, 9, 17]` -> [1, 9, 17]; None or "" or "auto" -> None."""
    if text is None or (isinstance(text, str) and text.strip() in ("", "auto")):
        return None
    if isinstance(text, list):
        items = text
    else:
        items = [s for s in str(text).replace(" ", "").split(",") if s]
    try:
        return [int(s) for s in items]
    except (TypeError, ValueError):
        raise UserError(f"--layers {text!r}: expected comma-separated integers like 1,9,17,25,33") from None


def load_recipe(path: str | Path, cls: type) -> dict[str, Any]:
    """Read a TOML recipe into {field: value}; unknown keys are an error naming the key and file."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"--config {path}: file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"--config {path}: not valid TOML ({e})") from None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise UserError(
                f"--config {path}: unknown key {key!r}; known keys: {', '.join(sorted(fields))}"
            )
        out[name] = value
    # Relative paths in a recipe are relative to the directory the command runs in, like CLI paths.
    if "data" in out and isinstance(out["data"], str):
        out["data"] = [out["data"]]
    if "layers" in out:
        out["layers"] = parse_int_list(out["layers"])
    return out


def merge(cls: type, recipe: dict[str, Any], cli_given: dict[str, Any]):
    """Defaults < recipe < values given on the command line."""
    values = {**recipe, **cli_given}
    return cls(**values)
