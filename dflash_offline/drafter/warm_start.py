"""Target layers as the drafter's start (`train --init-layers`): which target tensor starts which
drafter tensor, and how it is read.

A drafter layer is a Qwen3 decoder layer (drafter.model), the layer every engine's DFlash and DSpark
loader builds (docs/serving.md). Drafter layer i starts from target layer init_layers[i]:

- a dense Qwen3-like target's layer holds the drafter layer's tensors, with their shapes and meaning:
  every one is copied;
- a Qwen3.5/3.6 hybrid's layer gives what fits (targets/families.py says how the family's checkpoints
  differ from Qwen3's): any layer's MLP and its two norms; a full-attention layer also its k/v/o
  projections, its q/k norms and the query half of its q_proj (per head the query's rows, then the
  output gate's, which a Qwen3 layer has no place for: the gate is dropped). A Gated DeltaNet layer's
  token mixer has no counterpart, so that drafter layer's attention keeps its random start. The
  family's norms scale by 1 + w where the drafter's scale by w: they start as 1 + w, in float32, as
  transformers computes the scale. Its RoPE turns a quarter of each head (partial_rotary_factor), the
  drafter's the whole head (as the engines serve it): copied query/key projections bring their
  content, and relearn their positions.

The plan (`plan_start`) is made from the safetensors headers alone, so train's preflight refuses what
cannot fit, in one line, before any process starts (no torch here); the drafter then copies in what
`load_start` reads (DFlashDrafter.init_layers_from_target).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.runtime.errors import UserError
from dflash_offline.targets import families
from dflash_offline.targets.folder import TargetInfo, read_target, target_tensors, tensor_entries

# How a target tensor becomes the drafter's.
COPY = "copy"
QUERY_ROWS = "query rows"  # the query half of a gated q_proj (each head's first head_dim rows of its 2 x head_dim)
NORM_PLUS_ONE = "1 + w"  # a zero-centred RMSNorm weight, as a plain RMSNorm's scale

# The safetensors dtypes a start is copied from (others are quantised: their scales live elsewhere).
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# Token mixers whose tensors a drafter layer's attention can start from.
ATTENTION_TYPES = (families.FULL, families.SLIDING)


class Source(NamedTuple):
    drafter: str  # the drafter's parameter, e.g. layers.0.self_attn.q_proj.weight
    target: str  # the target tensor's checkpoint name, e.g. model.layers.3.self_attn.q_proj.weight
    how: str  # COPY, QUERY_ROWS or NORM_PLUS_ONE


@dataclass
class LayerStart:
    """Which target tensor starts each drafter layer parameter, and which stay random (and why)."""

    target: TargetInfo
    init_layers: list[int]
    layer_types: tuple[str, ...]  # the target's, one per layer
    heads: int  # the drafter's attention heads (a gated q_proj is split per head)
    sources: list[Source]
    random: list[str]  # drafter layer parameters no target tensor fits: their random start stays

    def summary(self) -> str:
        """One line for the log: what each drafter layer took."""
        if not self.random and all(s.how == COPY for s in self.sources):
            return f"drafter layers started from target layers {self.init_layers} (every tensor copied)"
        with_attention = sorted({int(s.drafter.split(".")[1]) for s in self.sources if ".self_attn." in s.drafter})
        without = [i for i in range(len(self.init_layers)) if i not in with_attention]
        hows = sorted({s.how for s in self.sources} - {COPY})
        line = (f"drafter layers started from target layers {self.init_layers}: the MLP and norms of each; attention "
                f"in drafter layers {with_attention or 'none'}")
        if without:
            kinds = sorted({self.layer_types[self.init_layers[i]] for i in without})
            line += f", random in {without} (target layers of type {', '.join(kinds)})"
        if hows:
            line += f"; read as {', '.join(hows)} where the family stores them so"
        return line


def layer_types(info: TargetInfo) -> tuple[str, ...]:
    """The target's layer types, one per layer (a config that lists none: all full attention)."""
    if len(info.layer_types) == info.num_target_layers:
        return info.layer_types
    return (families.FULL,) * info.num_target_layers


def plan_start(target_dir: str, init_layers: list[int], cfg: DrafterConfig,
               flags: tuple[str, str] = ("--init-layers", "--drafter-layers")) -> LayerStart:
    """The target tensors that start the drafter's layers, one target layer per drafter layer, from
    the safetensors headers alone (no tensor is read). Checks, one line each: one id per drafter
    layer, each id a layer of the target, every tensor planned present with the shape it needs.
    `flags`: how the layer ids and the drafter's depth were given (flags or recipe keys)."""
    info = read_target(target_dir)
    flag, depth = flags
    if len(init_layers) != cfg.num_hidden_layers:
        raise UserError(f"{flag} {','.join(map(str, init_layers))}: one target layer per drafter layer, "
                        f"{cfg.num_hidden_layers} expected ({depth})")
    bad = [j for j in init_layers if not 0 <= j < info.num_target_layers]
    if bad:
        raise UserError(f"{flag}: layer ids {bad} are outside the target's layers 0..{info.num_target_layers - 1}")
    family = families.family_of(info.model_type)
    zero_centred = family is not None and family.zero_centred_norms
    gated = family is not None and family.gated_query
    types = layer_types(info)
    shapes = {f"layers.{i}.{rest}": shape for i in range(cfg.num_hidden_layers) for rest, shape in cfg.layer_shapes().items()}
    sources, random = [], []
    for name in shapes:
        i, rest = name[len("layers."):].split(".", 1)
        j = init_layers[int(i)]
        if rest.startswith("self_attn.") and types[j] not in ATTENTION_TYPES:
            random.append(name)  # a Gated DeltaNet (or unknown) token mixer: nothing of it fits
            continue
        how = COPY
        if zero_centred and rest.endswith("norm.weight"):
            how = NORM_PLUS_ONE
        elif gated and rest == "self_attn.q_proj.weight":
            how = QUERY_ROWS
        sources.append(Source(name, f"model.layers.{j}.{rest}", how))
    entries = tensor_entries(info.weight_files)
    missing = [s.target for s in sources if s.target not in entries]
    if missing:
        raise UserError(f"{flag}: the target has no {missing[0]} ({len(missing)} drafter tensors without a source): "
                        f"its layers do not hold a Qwen3 decoder layer's tensors ({info.model_type}); leave {flag} out")
    quantised = [s.target for s in sources if entries[s.target].dtype not in FLOAT_DTYPES]
    if quantised:  # same shapes, other meaning: copied without their scales they would be a wrong start
        e = entries[quantised[0]]
        raise UserError(f"{flag}: the target's {quantised[0]} is stored as {e.dtype} (a quantised checkpoint): without "
                        f"its scales it cannot start the drafter; give an unquantised copy of the target, or leave {flag} out")
    for s in sources:
        want = shapes[s.drafter]
        if s.how == QUERY_ROWS:  # the query's rows and the gate's
            want = (2 * want[0], *want[1:])
        got = entries[s.target].shape
        if got != want:
            raise UserError(f"{flag}: target {s.target} has shape {got}, the drafter's {s.drafter} needs {want}"
                            f"{' (query and output gate)' if s.how == QUERY_ROWS else ''}; leave {flag} out")
    return LayerStart(target=info, init_layers=list(init_layers), layer_types=types, heads=cfg.num_attention_heads,
                      sources=sources, random=random)


def load_start(plan: LayerStart) -> dict:
    """{drafter parameter: its starting tensor} for every source of the plan (one target tensor may
    start several drafter layers: `--init-layers 3,3,7,7`)."""
    by_target: dict[str, list[Source]] = {}
    for s in plan.sources:
        by_target.setdefault(s.target, []).append(s)
    found = {}  # name -> torch tensor
    for name, sf, key in target_tensors(plan.target, set(by_target)):
        t = sf.get_tensor(key)
        for s in by_target[name]:
            found[s.drafter] = read_as(t, s.how, plan.heads)
    return found


def read_as(t, how: str, heads: int):
    """A target tensor as the drafter reads it (`how`: COPY, QUERY_ROWS, NORM_PLUS_ONE)."""
    if how == QUERY_ROWS:
        rows, cols = t.shape
        # q_proj's output, per head: head_dim query values, then head_dim gate values (transformers'
        # Qwen3_5Attention views it as [..., heads, 2 x head_dim] and splits the last axis in two).
        return t.view(heads, 2, rows // (2 * heads), cols)[:, 0].reshape(rows // 2, cols)
    if how == NORM_PLUS_ONE:
        return t.float() + 1.0
    return t
