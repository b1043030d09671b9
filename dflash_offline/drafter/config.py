"""The drafter's shape (`DrafterConfig`): read from the target's config and tokenizer, saved as config.json.

A drafter takes its widths, RoPE theta and mask token from the target it drafts for, and records
which target that is (`target_identity`), so that `eval` can warn when it decodes against another.
The same config round-trips through an export's config.json, in the form the reference inference
code and the serving engines read. The readers of the target's config and tokenizer live here
with the config they fill in; the parity check reads the target's values through them too. No
torch: the modules (drafter.model) and the export (drafter.export) import this, not the reverse.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.runtime.errors import UserError
from dflash_offline.targets.folder import read_target
from dflash_offline.targets.tokenizer import TokenizerFiles, read_tokenizer_files

log = logging.getLogger("dflash.drafter")

METHODS = ("dflash", "dspark")  # drafter/dspark.py says how DSpark differs
DSPARK_ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's, which vLLM and SGLang route to their DSpark models
MARKOV_HEADS = ("vanilla", "gated")  # DSpark's Markov head variants
DSPARK_NUM_ANCHORS = 512  # written as DeepSpec's config carries it (to_export_dict)


def config_rope_theta(text: dict) -> float:
    """rope_theta of a (text) config: top level (transformers 4), or inside `rope_parameters` /
    `rope_scaling` (transformers 5), possibly keyed per layer type."""
    if text.get("rope_theta") is not None:
        return float(text["rope_theta"])
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key) or {}
        if isinstance(params.get("full_attention"), dict):  # per-layer-type form
            params = params["full_attention"]
        if params.get("rope_theta") is not None:
            if params.get("rope_type", "default") != "default":
                log.warning("target uses %s RoPE scaling; the drafter uses plain RoPE", params["rope_type"])
            return float(params["rope_theta"])
    return 10000.0  # transformers' default for Qwen-family configs


def mask_token_from_tokenizer(root: Path) -> int | None:
    """The mask token's id from the tokenizer files, or None when the tokenizer declares none."""
    return _mask_id(read_tokenizer_files(root))


def _mask_id(files: TokenizerFiles) -> int | None:
    """The declared mask token (mask_token), else `<|MASK|>` where the vocabulary has it."""
    found = files.declared_id("mask_token")
    return found if found is not None else files.vocab.get("<|MASK|>")


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    mask_token: str | None = None
    """The mask token's text (SGLang resolves `dflash_config.mask_token`); None when the tokenizer
    does not list the id."""
    target: dict | None = None
    """The target it was trained for: folder name, model type, config and weights fingerprints
    (target.folder.TargetInfo); `eval` warns when it decodes against another."""
    chat: dict | None = None
    """How its training conversations were rendered (chat template sha256, thinking mode, system
    prompt; `prepare` records them, the cache carries them); `eval` warns when its prompts were
    rendered another way: a drafter trained in one thinking mode loses much of its tau in the other."""
    method: str = "dflash"
    """dflash: slot j of a block predicts the token at anchor + j (slot 0 unscored); dspark
    (drafter/dspark.py): slot j predicts anchor + 1 + j, with a Markov head and a confidence head."""
    markov_rank: int = 0
    """DSpark's Markov head rank (0: none)."""
    markov_head_type: str = "vanilla"
    confidence_head: bool = False

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """The parameter shapes of one decoder layer (drafter.model.DFlashLayer), by name under
        `layers.i.`: what a target layer must hold to start it (drafter.warm_start), known without
        building the module (train's preflight imports no torch)."""
        h, d, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        return {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (d,),
                "self_attn.k_norm.weight": (d,), "post_attention_layernorm.weight": (h,),
                "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}

    @property
    def label_offset(self) -> int:
        """Slot j of a block at anchor p predicts the token at p + j + label_offset."""
        return 1 if self.method == "dspark" else 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r}: one of {', '.join(METHODS)}")
        if self.method == "dflash" and (self.markov_rank or self.confidence_head):
            raise ValueError("a DFlash drafter has no Markov or confidence head (those are DSpark's)")
        if self.markov_rank < 0 or self.markov_head_type not in MARKOV_HEADS:
            raise ValueError(f"markov head {self.markov_head_type!r} of rank {self.markov_rank}: a rank >= 0 and one "
                             f"of {', '.join(MARKOV_HEADS)}")
        if self.confidence_head and not self.markov_rank:
            raise ValueError("the confidence head reads the Markov head's embedding: it needs markov_rank > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} heads is not a multiple of {self.num_key_value_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotate-half RoPE")
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size}: a block needs an anchor and at least one mask token")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")

    @classmethod
    def from_target(cls, target_dir: str, target_layer_ids: list[int], block_size: int = 16, drafter_layers: int = 5,
                    mask_token_id: int | None = None, mask_flag: str = "--mask-token-id") -> "DrafterConfig":
        """Widths equal to the target's (the DFlash drafter shares its embedding and LM head).
        `mask_flag`: how a given mask_token_id was given (a flag, or a recipe's key), for messages."""
        info = read_target(target_dir)
        cfg = json.loads((info.path / "config.json").read_text(encoding="utf-8"))
        text = cfg.get("text_config") or cfg
        bad = [i for i in target_layer_ids if not 0 <= i < info.num_target_layers]
        if bad or not target_layer_ids:
            raise UserError(f"target layer ids {list(target_layer_ids)}: the target has layers 0..{info.num_target_layers - 1}")
        files = read_tokenizer_files(info.path)  # read once: a 27B tokenizer.json is large
        by_id = files.by_id
        given = mask_token_id is not None
        if not given:
            mask_token_id = _mask_id(files)
            if mask_token_id is None:
                raise UserError(f"{target_dir}: the tokenizer declares no mask token (mask_token or <|MASK|>); "
                                f"pass --mask-token-id")
        if not 0 <= mask_token_id < info.vocab_size:
            # Say where the id came from: the option the user gave, or the target's tokenizer files.
            where = (f"{mask_flag} {mask_token_id}" if given else
                     f"{info.path}: the tokenizer's mask token {by_id.get(mask_token_id, '?')!r} has id {mask_token_id}, which is")
            fix = "" if given else "; pass --mask-token-id with an id of the model's vocabulary"
            raise UserError(f"{where} outside the target's vocabulary (0..{info.vocab_size - 1}, config.json's "
                            f"vocab_size){fix}")
        heads = int(text["num_attention_heads"])
        # MoE targets may carry no dense intermediate_size; 3x hidden is what released drafters use.
        inter = text.get("intermediate_size") or 3 * info.hidden_size
        return cls(
            hidden_size=info.hidden_size, intermediate_size=int(inter), num_hidden_layers=drafter_layers,
            num_attention_heads=heads, num_key_value_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or info.hidden_size // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=config_rope_theta(text),
            vocab_size=info.vocab_size, max_position_embeddings=int(text.get("max_position_embeddings", 40960)),
            block_size=block_size, target_layer_ids=list(target_layer_ids), mask_token_id=int(mask_token_id),
            num_target_layers=info.num_target_layers, mask_token=by_id.get(int(mask_token_id)),
            target=target_identity(info),
        )

    def to_export_dict(self) -> dict:
        """config.json of the export: a Qwen3 config plus the DFlash fields the loaders read (DSpark:
        the fields DeepSpec's checkpoints carry, which vLLM's and SGLang's DSpark loaders read)."""
        d = self._dflash_export_dict()
        if self.method != "dspark":
            return d
        d.pop("dflash_config")
        d["architectures"] = [DSPARK_ARCHITECTURE]
        # num_anchors: DeepSpec's loader asserts the key (its training's anchors per sequence; its
        # recipes and the method use 512; no engine reads it when serving). sample_from_anchor: every
        # slot drafts, the anchor's predicting the next token (speculators-format readers default false).
        d.update(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids),
                 markov_rank=self.markov_rank, enable_confidence_head=self.confidence_head,
                 num_anchors=DSPARK_NUM_ANCHORS, sample_from_anchor=True)
        if self.markov_rank:
            d["markov_head_type"] = self.markov_head_type
        if self.confidence_head:
            d["confidence_head_with_markov"] = True
        if self.mask_token is not None or self.chat:
            d.setdefault("dflash_offline", {}).update({**({"mask_token": self.mask_token} if self.mask_token else {}),
                                                       **({"chat": self.chat} if self.chat else {})})
        return d

    def _dflash_export_dict(self) -> dict:
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dtype": "bfloat16",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": None,
            # transformers 5 reads rope_parameters; older readers take rope_theta above.
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "layer_types": ["full_attention"] * self.num_hidden_layers, "sliding_window": None,
            "use_sliding_window": False, "max_window_layers": self.num_hidden_layers,
            "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            # block_size twice: SGLang reads it from dflash_config, the reference from either place.
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size,
                              **({"mask_token": self.mask_token} if self.mask_token is not None else {}),
                              **({"chat": self.chat} if self.chat else {})},
            **({"dflash_offline": {"target": self.target}} if self.target else {}),
        }

    @classmethod
    def saved_problem(cls, d: dict) -> str | None:
        """What is wrong with a config a checkpoint saved (`dataclasses.asdict` in state.json), as
        "drafter.KEY ...", or None: every field there, in its own type (a hand-edited "8" is not 8)."""
        def whole(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name, f in cls.__dataclass_fields__.items():
            if name not in d:
                if f.default is dataclasses.MISSING:
                    return f"drafter.{name} is missing"
                continue
            v, kind = d[name], str(f.type)
            ok = (whole(v) if kind == "int" else isinstance(v, (int, float)) and not isinstance(v, bool)
                  if kind == "float" else isinstance(v, list) and all(whole(i) for i in v) if kind == "list[int]"
                  else True)
            if not ok:
                return f"drafter.{name} is {json.dumps(v)}, not {'a list of integers' if kind == 'list[int]' else 'an integer' if kind == 'int' else 'a number'}"
        return None

    @classmethod
    def from_saved(cls, d: dict, source: str) -> "DrafterConfig":
        """The config a checkpoint saved, checked (`saved_problem`); `source` names the file."""
        problem = cls.saved_problem(d)
        if problem:
            raise UserError(f"{source}: {problem}; the checkpoint is damaged: use another checkpoint of the run")
        try:
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except ValueError as e:  # the config's own consistency checks (__post_init__)
            raise UserError(f"{source}: {e}; the checkpoint is damaged: use another checkpoint of the run") from None

    @classmethod
    def from_export_dict(cls, d: dict, source: str = "drafter config.json") -> "DrafterConfig":
        """The config of an export's config.json (`source`: its path, for messages). Every value is
        checked for its type and range here, so a hand-edited or foreign file is one line naming the
        file and key, not an exception inside the model's construction."""
        if not isinstance(d, dict):
            raise UserError(f"{source}: holds a JSON {type(d).__name__}, not an object; not a DFlash drafter export")
        dspark = d.get("architectures") == [DSPARK_ARCHITECTURE]
        if dspark:  # DeepSpec's layout: the DFlash fields at the top level, the heads' beside them
            if d.get("sample_from_anchor", True) is not True:
                raise UserError(f"{source}: sample_from_anchor {d['sample_from_anchor']!r}: this tool's DSpark drafters "
                                "draft from the anchor's slot on (true); a drafter of the bonus-anchor layout is "
                                "not supported")
            if d.get("enable_confidence_head") and d.get("confidence_head_with_markov") is False:
                raise UserError(f"{source}: a confidence head without the Markov embedding in its input "
                                "(confidence_head_with_markov false) is not supported")
            own = d.get("dflash_offline") or {}
            dc = {"target_layer_ids": d.get("target_layer_ids"), "mask_token_id": d.get("mask_token_id"),
                  **({k: own[k] for k in ("mask_token", "chat") if k in own} if isinstance(own, dict) else {})}
        else:
            dc = d.get("dflash_config") or {}
        if not isinstance(dc, dict) or not isinstance(d.get("dflash_offline") or {}, dict):
            raise UserError(f"{source}: dflash_config and dflash_offline must be objects; not a DFlash drafter export")
        names = [f for f in cls.__dataclass_fields__
                 if f not in ("target_layer_ids", "mask_token_id", "rope_theta", "mask_token", "target", "chat", "method",
                              "markov_rank", "markov_head_type", "confidence_head")]
        missing = [n for n in names if n not in d] + [n for n in ("target_layer_ids", "mask_token_id") if dc.get(n) is None]
        if missing:
            raise UserError(f"{source}: missing {missing}; not a complete {'DSpark' if dspark else 'DFlash'} drafter "
                            "export")

        def whole(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for n in names:
            kind = str(cls.__dataclass_fields__[n].type)
            ok = whole(d[n]) and d[n] > 0 if kind == "int" else \
                isinstance(d[n], (int, float)) and not isinstance(d[n], bool) and d[n] > 0
            if not ok:
                raise UserError(f"{source}: key {n!r} must be a positive {'integer' if kind == 'int' else 'number'}, "
                                f"got {d[n]!r}")
        ids, mask = dc["target_layer_ids"], dc["mask_token_id"]
        where_in = "" if dspark else "dflash_config."  # DeepSpec's layout keeps them at the top level
        if not isinstance(ids, list) or not ids or not all(whole(i) and 0 <= i < d["num_target_layers"] for i in ids):
            raise UserError(f"{source}: key '{where_in}target_layer_ids' must list layer ids of the target "
                            f"(0..{d['num_target_layers'] - 1}), got {ids!r}")
        if not whole(mask):
            raise UserError(f"{source}: key '{where_in}mask_token_id' must be an integer token id, got {mask!r}")
        if dc.get("block_size") is not None and dc["block_size"] != d["block_size"]:
            raise UserError(f"{source}: block_size {d['block_size']!r} and dflash_config.block_size "
                            f"{dc['block_size']!r} disagree; the two must be equal")
        heads = {}
        if dspark:
            rank, kind, conf = d.get("markov_rank", 0), d.get("markov_head_type", "vanilla"), d.get("enable_confidence_head", False)
            if not whole(rank) or rank < 0 or kind not in MARKOV_HEADS or not isinstance(conf, bool):
                raise UserError(f"{source}: markov_rank {rank!r}, markov_head_type {kind!r}, enable_confidence_head "
                                f"{conf!r}: a rank >= 0, one of {', '.join(MARKOV_HEADS)}, a boolean")
            heads = {"method": "dspark", "markov_rank": rank, "markov_head_type": kind, "confidence_head": conf}
        try:
            return cls(**{n: d[n] for n in names}, rope_theta=config_rope_theta(d), target_layer_ids=list(ids),
                       mask_token_id=mask, mask_token=dc.get("mask_token"),
                       target=(d.get("dflash_offline") or {}).get("target"), chat=dc.get("chat"), **heads)
        except ValueError as e:  # the config's own consistency checks (__post_init__)
            raise UserError(f"{source}: {e}") from None


def target_identity(info) -> dict:
    """What names a target: its folder's last two path parts, model type, and the fingerprints of its config and
    weights (the same ones a cache's manifest records)."""
    name = "/".join(info.path.absolute().parts[-2:])  # e.g. "pycode/target", "Qwen/Qwen3.6-27B"
    return {"name": name, "model_type": info.model_type, "config_sha256": info.config_sha256,
            "weights_fingerprint": info.weights_fingerprint}
