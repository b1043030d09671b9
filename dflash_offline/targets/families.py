"""Target families: what each kind of target is made of, and what every stage needs to know about it.

One registry, asked by every stage that treats targets differently (none decides on its own):

- `LAYER_KINDS`: each decoder layer type a transformers config can list in `layer_types`: whether
  it keeps a recurrent state (which cannot be cropped back to a shorter length, only restored from a
  snapshot; the cache attributes that hold it), whether it attends over a window (padding holes
  would count as positions), and the fast CUDA kernels it wants (a loud warning when missing).
- `FAMILIES`: one entry per family of target the code supports (its transformers model types, the
  layer types it is built from, whether the static decoder runs it and why not, how its checkpoints
  store norms and attention's query where they differ from Qwen3's).

A layer type not listed is treated as the cautious case: recurrent (snapshot and restore, never
crop) and not batchable by windows; a model type not listed has no family, and the stages fall back
to what its layer types allow. Adding a family is one `Family` entry (plus a `LayerKind` if it
brings a new layer type) and a tiny model in tests; see docs/architecture.md, "How to extend".
No torch here: the folder checks read it before any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


@dataclass(frozen=True)
class Kernel:
    package: str  # what pip installs
    module: str  # what Python imports
    install: str  # the command that installs it


@dataclass(frozen=True)
class LayerKind:
    name: str
    recurrent: bool  # keeps a per-row state: restored from a snapshot, never cropped
    windowed: bool  # attends over a sliding window: a padding hole would count as a position
    state_attrs: tuple[str, ...] = ()  # where a transformers cache keeps that state
    kernels: tuple[Kernel, ...] = ()  # fast CUDA kernels it wants (PyTorch fallbacks run without them)


LAYER_KINDS = {
    FULL: LayerKind(FULL, recurrent=False, windowed=False),
    SLIDING: LayerKind(SLIDING, recurrent=False, windowed=True),
    # Gated DeltaNet (Qwen3.5/3.6, Qwen3-Next): a short convolution and a recurrent state per row.
    LINEAR: LayerKind(LINEAR, recurrent=True, windowed=False, state_attrs=("conv_states", "recurrent_states"),
                      kernels=(Kernel("flash-linear-attention", "fla", "pip install flash-linear-attention"),
                               Kernel("causal-conv1d", "causal_conv1d", "CAUSAL_CONV1D_FORCE_BUILD=TRUE pip install "
                                      "--no-build-isolation causal-conv1d (builds with nvcc)"))),
}
_UNKNOWN = LayerKind("?", recurrent=True, windowed=True)  # the cautious reading of an unlisted type


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # transformers `model_type`s (of the text model)
    layer_types: tuple[str, ...]  # the layer types its configs may list
    # The static decoder (targets/static.py) runs decoder layers "x + mixer(norm(x)); x + mlp(norm(x))",
    # the mixer full causal attention or Gated DeltaNet; None where it can, else why not.
    static_decoder: str | None = None
    # How its checkpoints store what a Qwen3 layer stores plainly (drafter/warm_start.py reads them):
    # RMSNorm weights zero-centred (the scale is 1 + w), and attention's q_proj holding, per head, the
    # query's rows then an output gate's rows (twice a Qwen3 q_proj).
    zero_centred_norms: bool = False
    gated_query: bool = False


FAMILIES = (
    Family("qwen3", ("qwen3",), (FULL,)),
    Family("qwen2", ("qwen2",), (FULL, SLIDING)),
    Family("llama", ("llama",), (FULL,)),
    Family("mistral", ("mistral",), (FULL, SLIDING)),
    Family("qwen3.5 hybrid", ("qwen3_5", "qwen3_5_text"), (FULL, LINEAR), zero_centred_norms=True, gated_query=True),
)


def family_of(model_type: str | None) -> Family | None:
    """The registered family of a transformers model type (None: not registered)."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def layer_types_of(config) -> list[str]:
    """The layer types a config lists (a transformers config or its dict); none listed: all full attention."""
    types = config.get("layer_types") if isinstance(config, dict) else getattr(config, "layer_types", None)
    return list(types or [FULL])


def kind(layer_type: str) -> LayerKind:
    return LAYER_KINDS.get(layer_type, _UNKNOWN)


def recurrent(config) -> bool:
    """Whether some layer keeps a state that a shorter length cannot be cut back to (snapshot and
    restore instead); an unlisted layer type counts as one."""
    return any(kind(t).recurrent for t in layer_types_of(config))


def windowed_or_unknown(config) -> list[str]:
    """Layer types a padded batch cannot hold: windows (holes would count as positions) and types
    the registry does not know."""
    return sorted({t for t in layer_types_of(config) if kind(t).windowed})


def state_attrs(config) -> tuple[str, ...]:
    """Cache attributes that hold the recurrent states of this config's layers."""
    return tuple(dict.fromkeys(a for t in layer_types_of(config) for a in kind(t).state_attrs))


def kernels(config) -> list[Kernel]:
    """The fast CUDA kernels this config's layers want."""
    return list(dict.fromkeys(k for t in layer_types_of(config) for k in kind(t).kernels))


# Every cache attribute that holds a recurrent state, of any registered layer type (snapshots copy them all).
ALL_STATE_ATTRS = tuple(dict.fromkeys(a for k in LAYER_KINDS.values() for a in k.state_attrs))
