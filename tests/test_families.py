"""The target-family registry (targets/families.py) is the one place that decides how a target is
treated: its layer kinds agree with what transformers builds for the registered families, an
unknown layer type gets the cautious reading, and no other module names a layer type."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_offline.targets import families
from dflash_offline.targets.folder import read_target

PKG = Path(__file__).resolve().parent.parent / "dflash_offline"


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_registry_matches_what_transformers_builds(kind, tiny_dense, tiny_hybrid):
    """A tiny target of each registered family: its config's layer types are the family's, the
    folder check and the decoders' rule say the same (recurrent or not), and the cache attributes
    the registry names for recurrent layers are where transformers keeps their states."""
    from transformers import DynamicCache

    from dflash_offline.evaluate.speculative import load_target_for_decoding

    folder = tiny_dense if kind == "dense" else tiny_hybrid
    model, _ = load_target_for_decoding(str(folder), "cpu", "float32")
    family = families.family_of(model.config.model_type)
    assert family is not None and set(families.layer_types_of(model.config)) <= set(family.layer_types)
    info = read_target(str(folder))
    assert info.hybrid == families.recurrent(model.config) == (kind == "hybrid")
    assert set(info.layer_types) == set(families.layer_types_of(model.config))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8]]), past_key_values=cache, use_cache=True)
    for layer, t in zip(cache.layers, families.layer_types_of(model.config)):
        for attr in families.kind(t).state_attrs:
            assert getattr(layer, attr, None) is not None, (t, attr, type(layer).__name__)
    assert bool(families.state_attrs(model.config)) == (kind == "hybrid")
    assert [k.module for k in families.kernels(model.config)] == ([] if kind == "dense" else ["fla", "causal_conv1d"])
    # The static decoder runs both families.
    assert family.static_decoder is None


def test_unknown_layer_types_get_the_cautious_reading():
    """A layer type the registry does not know is treated as recurrent (restored from snapshots,
    never cropped) and kept out of padded KV batches; no family is made up for an unknown model."""
    cfg = SimpleNamespace(model_type="mamba-ish", layer_types=["full_attention", "state_space"])
    assert families.recurrent(cfg) and families.windowed_or_unknown(cfg) == ["state_space"]
    assert families.family_of("mamba-ish") is None
    assert not families.recurrent(SimpleNamespace(layer_types=None))  # none listed: all full attention
    assert families.windowed_or_unknown({"layer_types": ["sliding_attention", "full_attention"]}) == ["sliding_attention"]
    from dflash_offline.evaluate.kv_batch import unsupported_reason

    assert "state_space" in unsupported_reason(SimpleNamespace(config=cfg))


def test_no_module_but_the_registry_names_a_target_layer_type():
    """Layer types and recurrent-state attributes appear as strings only in targets/families.py
    (the drafter's own config, which writes its export's layer types, aside)."""
    names = set(families.LAYER_KINDS) | set(families.ALL_STATE_ATTRS)
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel in ("targets/families.py", "drafter/config.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, "decided outside the registry:\n" + "\n".join(found)
