"""A Hugging Face model folder read without torch: config, safetensors headers, fingerprint.

Both stages read the target's folder (stage one to run it, stage two for its widths, mask token,
embedding and LM head), so this lives beside them rather than inside either.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from dflash_offline.runtime.errors import UserError
from dflash_offline.targets import families
from dflash_offline.targets.tokenizer import read_tokenizer_files

# Checkpoint key prefixes of multimodal wrappers, mapped onto the text-only causal LM.
KEY_REWRITES = [
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
]


def checkpoint_name(key: str) -> str:
    """A safetensors key under the text model's name (multimodal wrappers keep it under a prefix)."""
    for old, new in KEY_REWRITES:
        if key.startswith(old):
            return new + key[len(old):]
    return key


@dataclass
class TargetInfo:
    path: Path
    model_type: str
    num_target_layers: int  # its decoder layers (config.json's num_hidden_layers)
    hidden_size: int
    vocab_size: int
    config_sha256: str
    weights_fingerprint: str | None  # None: read without its weights (read_target(weights=False))
    hybrid: bool
    weight_files: list[Path]
    tie_word_embeddings: bool
    max_positions: int | None = None  # max_position_embeddings: the longest sequence it was made for
    layer_types: tuple[str, ...] = ()  # its decoder layers' types, as its config lists them (targets/families.py)
    # How messages name the folder: the flag, or the recipe key and file the path came from.
    option: str = field(default="--target", compare=False)

    def manifest_entry(self) -> dict:
        return {
            "path": str(self.path), "model_type": self.model_type, "num_layers": self.num_target_layers,
            "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
            "config_sha256": self.config_sha256, "weights_fingerprint": self.weights_fingerprint,
        }


def safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise UserError(f"{path}: not a safetensors file (header length {n})")
        return f.read(n)


class TensorEntry(NamedTuple):
    file: str  # the safetensors file's name
    key: str  # the tensor's key in that file
    shape: tuple[int, ...]
    dtype: str = ""  # as the header names it: F32, BF16, F16, F8_E4M3, I8, ...


def tensor_entries(files: list[Path]) -> dict[str, TensorEntry]:
    """Every tensor of a target's safetensors files under its text-model name (`checkpoint_name`),
    from the headers alone (no tensor data is read): the one parser of those headers for callers
    that need names and shapes (the weight-shape check, plan's parameter count)."""
    found: dict[str, TensorEntry] = {}
    for f in files:
        for key, meta in json.loads(safetensors_header(f)).items():
            if key != "__metadata__":
                found[checkpoint_name(key)] = TensorEntry(f.name, key, tuple(meta["shape"]), str(meta.get("dtype", "")))
    return found


def target_tensors(info: "TargetInfo", wanted: set[str]):
    """(name, open safetensors file, its key) for the first tensor of each wanted name (names as
    `checkpoint_name` gives them) in the target's weight files; the caller reads what it needs (the
    tensor, or only its shape) while the file is open. Tensors come as torch tensors: safetensors is
    imported here, not with the module, which the torch-free checks import."""
    from safetensors import safe_open

    seen: set[str] = set()
    for f in info.weight_files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                name = checkpoint_name(key)
                if name in wanted and name not in seen:
                    seen.add(name)
                    yield name, sf, key


REDOWNLOAD = "the file is damaged or truncated (an interrupted download or copy?): re-download it"


def weights_damage(path: Path) -> str | None:
    """What is wrong with a target's safetensors file, or None: its 8-byte header length fits the
    file, the header is JSON naming tensors, and every tensor's bytes end within the file. Headers
    and sizes only: a 54 GB target is checked in a moment."""
    size = path.stat().st_size
    if size == 0:
        return "empty (0 bytes)"
    if size < 8:
        return f"{size} bytes, less than a safetensors file's 8-byte header length"
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            return f"cut short ({size} bytes, less than its own {n}-byte header)"
        try:
            header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "not a safetensors file (its header does not parse)"
    if 8 + n + max(ends, default=0) > size:
        return f"cut short ({size} bytes, its tensors end at byte {8 + n + max(ends)})"
    return None


def _read_json(path: Path) -> dict:
    """A JSON object from the target folder, or one line naming the file as damaged."""
    try:
        value = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        what = "empty (0 bytes)" if path.stat().st_size == 0 else f"not valid JSON ({str(e).splitlines()[0]})"
        raise UserError(f"{path}: {what}; {REDOWNLOAD}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: not a JSON object ({type(value).__name__}); {REDOWNLOAD}")
    return value


def _check_weight_files(root: Path, files: list[Path]) -> None:
    """Before any weights are read: every *.safetensors whole, every *.safetensors.index.json
    readable and naming only files that are there (a loader would fail on either much later)."""
    for f in files:
        what = weights_damage(f)
        if what:
            raise UserError(f"{f}: {what}; {REDOWNLOAD}")
    for index in sorted(root.glob("*.safetensors.index.json")):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: no weight_map object; {REDOWNLOAD}")
        missing = sorted({str(v) for v in weight_map.values()} - {f.name for f in files})
        if missing:
            raise UserError(f"{index}: names {missing[0]}, which is not in the folder ({len(missing)} file(s) "
                            "missing); the download is incomplete: re-download the missing files")


def _data_sample(path: Path, samples: int = 16, block: int = 1 << 16) -> bytes:
    """16 evenly spaced 64 KiB blocks of the tensor data: headers alone (names, shapes, dtypes)
    cannot tell a fine-tune from its base model; hashing 54 GB at every start is too slow."""
    size = path.stat().st_size
    out = []
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start = 8 + n
        span = max(size - start - block, 0)
        for i in range(samples):
            f.seek(start + span * i // (samples - 1))
            out.append(f.read(block))
    return b"".join(out)


def read_target(path: str, option: str = "--target", weights: bool = True) -> TargetInfo:
    """Read config.json and the safetensors headers; no torch, no weights. `option`: how messages
    name the folder (the flag, or the recipe key and file it was given in). `weights=False`: the
    config alone, for a command that only tokenizes (prepare): a folder of tokenizer files and
    config.json without weights is a target there; `weight_files` is empty and
    `weights_fingerprint` None."""
    root = Path(path)
    cfg_path = root / "config.json"
    if not root.is_dir():
        raise UserError(f"{option} {path}: no such folder (expected a Hugging Face model folder)")
    if not cfg_path.is_file():
        raise UserError(f"{option} {path}: no config.json in the folder")
    cfg = _read_json(cfg_path)
    text = cfg.get("text_config") or cfg
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if key not in text:
            raise UserError(f"{cfg_path}: missing {key!r}; is this a causal language model?")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "max_position_embeddings"):
        v = text.get(key)
        if key in text and (v is not None or key != "max_position_embeddings") and (
                isinstance(v, bool) or not isinstance(v, int) or (v < 1 and key != "num_hidden_layers")):
            raise UserError(f"{cfg_path}: {key} is {json.dumps(v)}, not a positive integer; the config is damaged: fix it or "
                            "download the model again")
    if int(text["num_hidden_layers"]) < 1:
        raise UserError(f"{cfg_path}: num_hidden_layers is {text['num_hidden_layers']}: the target has no decoder "
                        "layers whose hidden states could be captured; give a causal language model as the target")
    files = sorted(root.glob("*.safetensors")) if weights else []
    if weights and not files:
        raise UserError(f"{option} {path}: no *.safetensors weights in the folder")
    fingerprint = _fingerprint(root, files) if weights else None
    # Layers that keep a recurrent state (Gated DeltaNet): padding rules and decoders differ (targets/families.py).
    layer_types = tuple(families.layer_types_of(text))
    hybrid = families.recurrent(text)
    tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return TargetInfo(
        path=root.absolute(), model_type=str(text.get("model_type", cfg.get("model_type"))),
        num_target_layers=int(text["num_hidden_layers"]), hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        config_sha256=hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest(),
        weights_fingerprint=fingerprint, hybrid=hybrid, layer_types=layer_types, weight_files=files,
        tie_word_embeddings=tie,
        max_positions=int(text["max_position_embeddings"]) if text.get("max_position_embeddings") else None,
        option=option,
    )


def _fingerprint(root: Path, files: list[Path]) -> str:
    """The weights' identity: names, sizes, headers and sampled data blocks, after the files are checked whole."""
    _check_weight_files(root, files)
    fp = hashlib.sha256()
    for f in files:
        fp.update(f.name.encode())
        fp.update(str(f.stat().st_size).encode())
        fp.update(safetensors_header(f))
        fp.update(_data_sample(f))
    return "sha256:" + fp.hexdigest()


def eos_source(target_dir: str) -> tuple[set[int], Path | None]:
    """End-of-sequence ids from generation_config.json (else config.json) of the target folder, and
    the file they came from (None: nothing names any), so a message about them can name it; where
    neither config names one, the tokenizer's declared eos_token (tokenizer_config.json, as a
    server's chat completion stops at it). Read in their own type: a value that is not an integer
    (a string, a float, true) is refused naming the file, not converted."""
    root = Path(target_dir)
    for name in ("generation_config.json", "config.json"):
        f = root / name
        if f.is_file():
            cfg = _read_json(f)
            cfg = cfg if name == "generation_config.json" else (cfg.get("text_config") or cfg)
            eos = cfg.get("eos_token_id")
            if eos is not None:
                items = eos if isinstance(eos, list) else [eos]
                if not all(isinstance(e, int) and not isinstance(e, bool) for e in items):
                    raise UserError(f"{f}: eos_token_id {json.dumps(eos)} is not a token id or a list of token ids "
                                    "(integers); fix the file (generate --eos-token-ids and eval --ignore-eos "
                                    "override it)")
                return set(items), f

    eos = read_tokenizer_files(root).declared_id("eos_token")
    if eos is not None:
        return {eos}, root / "tokenizer_config.json"
    return set(), None


def eos_ids(target_dir: str) -> set[int]:
    """End-of-sequence ids of the target folder (`eos_source`)."""
    return eos_source(target_dir)[0]
