"""ManifestView, the typed view the readers of a cache manifest use (training, the held-out walk
and eval's estimate through it, inspect), says what the committed manifest says, and reads a
manifest from before the optional keys existed."""

from __future__ import annotations

import copy
import json


def test_view_of_a_committed_cache(valid_cache):
    from dflash_offline.cache.view import ManifestView

    m = json.loads((valid_cache / "manifest.json").read_text())
    v = ManifestView.of(m)
    assert v.status == m["status"] == "complete"
    assert (v.hidden_size, v.vocab_size, v.num_target_layers) == (m["target"]["hidden_size"], m["target"]["vocab_size"],
                                                              m["target"]["num_layers"])
    assert v.weights_fingerprint == m["target"]["weights_fingerprint"] and v.config_sha256 == m["target"]["config_sha256"]
    assert list(v.layer_ids) == m["capture"]["layer_ids"] and v.hidden_dtype == m["capture"]["hidden_dtype"]
    assert v.topk == m["capture"]["topk"] and v.num_shards == m["plan"]["num_shards"] == v.shards_committed
    assert (v.target_path, v.model_type) == (m["target"]["path"], m["target"]["model_type"])
    assert tuple(v.totals) == (m["totals"]["samples"], m["totals"]["tokens"], m["totals"]["bytes"])
    assert (v.compute_dtype, v.max_len) == (m["capture"].get("compute_dtype"), m["capture"]["max_len"])
    assert (v.source_rows, v.source_files) == (m["source"]["rows"], len(m["source"]["files"]))
    old = copy.deepcopy(m)  # a manifest written before the optional keys existed
    for key in ("released", "budget_bytes", "max_shard_bytes", "consumers", "chat"):
        old.pop(key, None)
    old["capture"].pop("compute_dtype", None)
    old["plan"].pop("tokens", None)
    old["capture"].pop("topk", None)
    w = ManifestView.of(old)
    assert (w.released, w.budget_bytes, w.consumers, w.chat, w.plan_tokens, w.topk) == (0, None, (), None, None, 0)
    assert w.compute_dtype is None
