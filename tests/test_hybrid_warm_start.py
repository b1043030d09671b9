"""A hybrid target's layers as the drafter's start (`train --init-layers` on a Qwen3.5 target,
drafter/warm_start.py): each drafter tensor taken from the right target tensor, read the right way
(the query half of a gated q_proj, zero-centred norms as 1 + w), checked tensor by tensor and
against the target's own modules; what cannot fit refused in one line; a run started so trains,
exports (the reference implementation loads it) and decodes losslessly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_cli
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.drafter.warm_start import COPY, NORM_PLUS_ONE, QUERY_ROWS, plan_start
from dflash_offline.runtime.errors import UserError
from dflash_offline.tiny import make_tiny_target
from test_reference_parity import load_reference, reference  # noqa: F401 (a fixture)

FULL_LAYERS = (3, 7)  # the tiny hybrid's attention layers: [linear x 3, full] x 2
START = [0, 3, 7, 3, 5]  # Gated DeltaNet, full, full, the same full again, Gated DeltaNet
HEADS, HEAD_DIM, HIDDEN = 4, 16, 64


def with_random_norms(folder, seed: int = 1):
    """The target with every RMSNorm weight drawn at random: a fresh model's zero-centred norms are
    all 0, which would hide a missing (or doubled) 1 + w."""
    g = torch.Generator().manual_seed(seed)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for k, t in tensors.items():
        if k.endswith("norm.weight"):
            tensors[k] = (torch.randn(t.shape, generator=g) * 0.3).to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return with_random_norms(make_tiny_target(tmp_path_factory.mktemp("warm") / "qwen3_5", kind="qwen3_5"))


@pytest.fixture(scope="module")
def hybrid_vl(tmp_path_factory):
    """Saved as the released Qwen3.5/3.6 checkpoints are: keys under model.language_model."""
    return with_random_norms(make_tiny_target(tmp_path_factory.mktemp("warm") / "qwen3_5_vl", kind="qwen3_5_vl"))


def drafter_of(target, layers=len(START), seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig.from_target(str(target), [1, 3, 5], drafter_layers=layers, mask_token_id=7))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_vl"])
def test_each_drafter_tensor_comes_from_the_right_target_tensor(kind, hybrid, hybrid_vl):
    folder, prefix = (hybrid, "model.") if kind == "qwen3_5" else (hybrid_vl, "model.language_model.")
    target = load_file(str(folder / "model.safetensors"))
    d = drafter_of(folder)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    d.init_layers_from_target(str(folder), START)
    after = d.state_dict()
    counts = {"mlp": 0, "norm": 0, "query": 0, "kvo": 0, "random": 0}
    for name, got in after.items():
        if not name.startswith("layers."):  # fc, hidden_norm, final norm, frozen tables: untouched
            assert torch.equal(got, before[name]), name
            continue
        i, rest = name[len("layers."):].split(".", 1)
        j = START[int(i)]
        src = f"{prefix}layers.{j}.{rest}"
        if rest.startswith("self_attn.") and j not in FULL_LAYERS:
            assert torch.equal(got, before[name]), name  # a Gated DeltaNet layer has no attention to give
            assert f"{prefix}layers.{j}.self_attn.q_proj.weight" not in target
            counts["random"] += 1
        elif rest.endswith("norm.weight"):  # zero-centred: the scale is 1 + w
            assert torch.equal(got, target[src].float() + 1.0), name
            counts["norm"] += 1
        elif rest == "self_attn.q_proj.weight":  # each head's query rows; its gate rows dropped
            q = target[src]
            assert q.shape == (2 * HEADS * HEAD_DIM, HIDDEN)
            want = torch.cat([q[h * 2 * HEAD_DIM: h * 2 * HEAD_DIM + HEAD_DIM] for h in range(HEADS)])
            assert torch.equal(got, want.float()), name
            counts["query"] += 1
        else:
            assert torch.equal(got, target[src].float()), name
            counts["mlp" if rest.startswith("mlp.") else "kvo"] += 1
    n = len(START)
    n_attn = sum(j in FULL_LAYERS for j in START)
    assert counts == {"mlp": 3 * n, "norm": 2 * n + 2 * n_attn, "query": n_attn, "kvo": 3 * n_attn,
                      "random": 6 * (n - n_attn)}


def test_started_parts_compute_what_the_target_layer_computes(hybrid):
    """Against transformers' own modules: the drafter layer started from full-attention layer 3
    gives its queries (before RoPE) and keys exactly, and its MLP block exactly; a layer started
    from Gated DeltaNet layer 0 gives that layer's MLP block exactly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hybrid), dtype=torch.float32).eval()
    d = drafter_of(hybrid)
    d.init_layers_from_target(str(hybrid), START)
    x = torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for i, j in ((0, 0), (1, 3), (4, 5)):
            theirs, ours = model.model.layers[j], d.layers[i]
            assert torch.equal(ours.input_layernorm(x), theirs.input_layernorm(x))
            assert torch.equal(ours.mlp(ours.post_attention_layernorm(x)), theirs.mlp(theirs.post_attention_layernorm(x)))
        attn, ours = model.model.layers[3].self_attn, d.layers[1].self_attn
        # transformers' split of the gated projection, then its q norm, on the same input
        query, _gate = torch.chunk(attn.q_proj(x).view(2, 9, HEADS, 2 * HEAD_DIM), 2, dim=-1)
        torch.testing.assert_close(ours.q_proj(x).view(2, 9, HEADS, HEAD_DIM), query, rtol=0, atol=1e-6)
        assert torch.equal(ours.q_norm(query), attn.q_norm(query))
        k = attn.k_proj(x).view(2, 9, -1, HEAD_DIM)
        assert torch.equal(ours.k_proj(x).view(2, 9, -1, HEAD_DIM), k) and torch.equal(ours.k_norm(k), attn.k_norm(k))


def test_the_plan_says_what_each_layer_takes(hybrid, tiny_dense):
    plan = plan_start(str(hybrid), START, drafter_of(hybrid).cfg)
    hows = {s.how for s in plan.sources}
    assert hows == {COPY, QUERY_ROWS, NORM_PLUS_ONE}
    assert sorted({name.split(".")[1] for name in plan.random}) == ["0", "4"]
    line = plan.summary()
    assert "attention in drafter layers [1, 2, 3]" in line and "random in [0, 4]" in line and "linear_attention" in line
    assert "\n" not in line
    dense = plan_start(str(tiny_dense), [6, 2], drafter_of(tiny_dense, layers=2).cfg)
    assert not dense.random and {s.how for s in dense.sources} == {COPY}
    assert dense.summary() == "drafter layers started from target layers [6, 2] (every tensor copied)"


def test_what_cannot_fit_is_refused_in_one_line(hybrid, tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    cfg = drafter_of(hybrid, layers=2).cfg
    with pytest.raises(UserError, match="one target layer per drafter layer, 2 expected"):
        plan_start(str(hybrid), [1, 2, 3], cfg)
    with pytest.raises(UserError, match=r"outside the target's layers 0\.\.7"):
        plan_start(str(hybrid), [3, 8], cfg)
    # A hybrid whose MLPs are mixtures of experts: nothing there is a Qwen3 MLP.
    torch.manual_seed(0)
    moe = AutoModelForCausalLM.from_config(Qwen3_5MoeTextConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        max_position_embeddings=256))
    moe.save_pretrained(tmp_path / "moe")
    mcfg = DrafterConfig.from_target(str(tmp_path / "moe"), [1], drafter_layers=1, mask_token_id=7)
    with pytest.raises(UserError) as e:
        plan_start(str(tmp_path / "moe"), [3], mcfg)
    msg = str(e.value)
    assert msg.startswith("--init-layers: the target has no model.layers.3.mlp.gate_proj.weight")
    assert msg.endswith("leave --init-layers out") and "\n" not in msg


@pytest.mark.slow
def test_a_run_started_from_the_hybrid_trains_exports_and_decodes_losslessly(reference, hybrid, tmp_path):  # noqa: F811
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_offline.drafter.export import load_exported
    from dflash_offline.tiny import make_tiny_data

    data = make_tiny_data(tmp_path / "data.parquet", rows=24, min_len=30, max_len=90, seed=5)
    cache = tmp_path / "cache"
    r = run_cli(["extract", "--target", hybrid, "--data", data, "--cache", cache, "--capture-layers", "1,3,5",
                 "--topk", "0", "--max-len", "128", "--batch-tokens", "512", "--shard-tokens", "1024", "--no-progress"])
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    r = run_cli(["train", "--target", hybrid, "--cache", cache, "--out", run, "--seq-len", "128", "--num-anchors", "8",
                 "--block-size", "8", "--global-batch-tokens", "256", "--mask-token-id", "1", "--drafter-layers", "2",
                 "--init-layers", "0,3", "--max-steps", "4", "--loader-workers", "0", "--no-progress"])
    assert r.returncode == 0, r.stderr
    log = (run / "logs" / "rank0.log").read_text() if (run / "logs" / "rank0.log").exists() else \
        "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "drafter layers started from target layers [0, 3]: the MLP and norms of each; attention in drafter layers [1]" in log
    export = run / "export"
    theirs, info = load_reference(reference, export)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys"), info
    ours = load_exported(str(export), str(hybrid))
    for name, t in ours.trainable_state_dict().items():
        assert torch.equal(theirs.state_dict()[name].float(), t.float()), name
    rng = np.random.default_rng(3)
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": pa.array([10, 11], pa.int64()),
                             "input_ids": [rng.integers(2, 512, size=n).tolist() for n in (6, 21)]}), prompts)
    report = tmp_path / "eval.json"
    r = run_cli(["eval", "--target", hybrid, "--drafter", export, "--prompts", prompts, "--max-new-tokens", "24",
                 "--json", report, "--no-progress"])
    assert r.returncode == 0, r.stderr
    rep = json.loads(report.read_text())
    assert rep["hybrid_target"] is True
    assert rep["drafters"][0]["lossless"] is True and rep["drafters"][0]["tokens"] == 2 * 24


def test_a_quantised_checkpoint_is_refused(tmp_path):
    """The same shapes in 8-bit floats (an FP8 block-quantised checkpoint keeps its scales in other
    tensors): copied as they are, they would be a wrong start."""
    folder = make_tiny_target(tmp_path / "q", kind="qwen3")
    w = load_file(str(folder / "model.safetensors"))
    w["model.layers.2.mlp.up_proj.weight"] = w["model.layers.2.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = DrafterConfig.from_target(str(folder), [1], drafter_layers=1, mask_token_id=7)
    with pytest.raises(UserError) as e:
        plan_start(str(folder), [2], cfg)
    assert str(e.value) == ("--init-layers: the target's model.layers.2.mlp.up_proj.weight is stored as F8_E4M3 (a "
                            "quantised checkpoint): without its scales it cannot start the drafter; give an unquantised "
                            "copy of the target, or leave --init-layers out")
    plan_start(str(folder), [3], cfg)  # another layer, all float: fine
