"""The DFlash drafter: config from a target, frozen embedding/head, which parts train, KV injection
against a loop-by-loop reference, and the export round trip."""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_offline.drafter.config import DrafterConfig, config_rope_theta
from dflash_offline.drafter.export import export_drafter, load_exported
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.runtime.errors import UserError

LAYER_IDS = [1, 3, 5]
MASK_ID = 7


@pytest.fixture(autouse=True)
def masks_module(monkeypatch):
    """Use dflash_offline.drafter.masks when it exists; until then, an SDPA stand-in of the same signature."""
    try:
        import dflash_offline.drafter.masks  # noqa: F401
    except ImportError:
        def attention(q, k, v, mask, scale=None):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                    enable_gqa=True)

        mod = types.ModuleType("dflash_offline.drafter.masks")
        mod.attention = attention
        monkeypatch.setitem(sys.modules, "dflash_offline.drafter.masks", mod)


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def dense_mask(anchors: list[int], S: int, B: int) -> torch.Tensor:
    """[1, 1, N*B, S + N*B]: block b sees context kv < anchor_b and its whole own block."""
    N = len(anchors)
    m = torch.zeros(N * B, S + N * B, dtype=torch.bool)
    for b, a in enumerate(anchors):
        m[b * B:(b + 1) * B, :a] = True
        m[b * B:(b + 1) * B, S + b * B:S + (b + 1) * B] = True
    return m[None, None]


def make_inputs(cfg: DrafterConfig, anchors: list[int], S: int, seed: int = 0, R: int = 1):
    g = torch.Generator().manual_seed(seed)
    B, N = cfg.block_size, len(anchors)
    hidden = torch.randn(R, S, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    ids = torch.full((R, N * B), cfg.mask_token_id, dtype=torch.long)
    ids[:, ::B] = torch.randint(0, cfg.vocab_size, (R, N), generator=g)
    ctx_pos = torch.arange(S).expand(R, S)
    blk_pos = torch.tensor([a + j for a in anchors for j in range(B)]).expand(R, N * B)
    return hidden, ids, ctx_pos, blk_pos, dense_mask(anchors, S, B).expand(R, -1, -1, -1)


def tiny_drafter(target: Path, drafter_layers: int = 2, block_size: int = 4, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(str(target), LAYER_IDS, block_size=block_size, drafter_layers=drafter_layers,
                                    mask_token_id=MASK_ID)
    d = DFlashDrafter(cfg)
    d.load_frozen_from_target(str(target))
    with torch.no_grad():  # norms start at ones; random weights test that each is applied where it should be
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


# ----------------------------------------------------------------------------------------------
# 1. Config


def test_from_target_reads_widths_and_explicit_mask(tiny_dense, tiny_hybrid):
    cfg = DrafterConfig.from_target(str(tiny_dense), LAYER_IDS, mask_token_id=MASK_ID)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings) == (64, 128, 4, 2, 16, 512, 1024)
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.num_target_layers, cfg.mask_token_id) == (5, 16, 8, MASK_ID)
    assert cfg.rope_theta == 10000.0 and cfg.rms_norm_eps == 1e-6 and cfg.target_layer_ids == LAYER_IDS
    hyb = DrafterConfig.from_target(str(tiny_hybrid), [1, 2, 3, 4, 5], mask_token_id=3, block_size=8, drafter_layers=1)
    assert (hyb.hidden_size, hyb.head_dim, hyb.num_target_layers, hyb.block_size) == (64, 16, 8, 8)
    with pytest.raises(UserError):
        DrafterConfig.from_target(str(tiny_dense), [1, 8], mask_token_id=MASK_ID)  # layer 8 does not exist


def test_rope_theta_in_every_config_form():
    assert config_rope_theta({"rope_theta": 1e6}) == 1e6
    assert config_rope_theta({"rope_parameters": {"rope_type": "default", "rope_theta": 5e6}}) == 5e6
    assert config_rope_theta({"rope_scaling": {"rope_type": "default", "rope_theta": 7.0}}) == 7.0
    assert config_rope_theta({"rope_parameters": {"full_attention": {"rope_theta": 3.0}}}) == 3.0


def test_mask_token_from_tokenizer_or_refusal(tiny_dense, tmp_path):
    with pytest.raises(UserError, match="--mask-token-id"):
        DrafterConfig.from_target(str(tiny_dense), LAYER_IDS)
    t = tmp_path / "t"
    shutil.copytree(tiny_dense, t)
    (t / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 500, "content": "<|MASK|>"}]}))
    assert DrafterConfig.from_target(str(t), LAYER_IDS).mask_token_id == 500
    (t / "tokenizer_config.json").write_text(json.dumps(
        {"mask_token": "<mask>", "added_tokens_decoder": {"501": {"content": "<mask>", "special": True}}}))
    assert DrafterConfig.from_target(str(t), LAYER_IDS).mask_token_id == 501
    assert DrafterConfig.from_target(str(t), LAYER_IDS, mask_token_id=9).mask_token_id == 9  # explicit wins
    # The export names the mask token by text too (some SGLang versions resolve the string) and
    # records the target it was made for; both survive a round trip through config.json.
    cfg = DrafterConfig.from_target(str(t), LAYER_IDS)
    d = cfg.to_export_dict()
    assert d["dflash_config"]["mask_token"] == "<mask>" and d["dflash_config"]["mask_token_id"] == 501
    ident = d["dflash_offline"]["target"]
    assert ident["name"] == f"{tmp_path.name}/t" and ident["weights_fingerprint"].startswith("sha256:") and ident["config_sha256"]
    assert DrafterConfig.from_export_dict(json.loads(json.dumps(d))) == cfg
    assert "mask_token" not in DrafterConfig.from_target(str(t), LAYER_IDS, mask_token_id=9).to_export_dict()["dflash_config"]


# ----------------------------------------------------------------------------------------------
# 2. Frozen embedding and head


def test_frozen_parts_equal_target_tensors(tiny_dense, tmp_path):
    d = tiny_drafter(tiny_dense)
    ref = tensors_of(tiny_dense)
    assert torch.equal(d.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(d.lm_head.weight, ref["lm_head.weight"])
    assert not torch.equal(d.lm_head.weight, d.embed_tokens.weight)

    # Tied embeddings: the checkpoint has no lm_head.weight; the head is a copy of the embedding.
    from transformers import AutoModelForCausalLM

    from dflash_offline.tiny import tiny_config

    c = tiny_config("qwen3", num_target_layers=8)
    c.tie_word_embeddings = True
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(c).save_pretrained(tmp_path / "tied")
    ref = tensors_of(tmp_path / "tied")
    assert "lm_head.weight" not in ref
    dt = tiny_drafter(tmp_path / "tied")
    assert torch.equal(dt.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(dt.lm_head.weight, ref["model.embed_tokens.weight"])
    assert dt.lm_head.weight.data_ptr() != dt.embed_tokens.weight.data_ptr()


def test_frozen_parts_from_multimodal_checkpoint(tmp_path):
    from dflash_offline.tiny import make_tiny_target

    t = make_tiny_target(tmp_path / "vl", kind="qwen3_5_vl")
    ref = tensors_of(t)
    assert "model.language_model.embed_tokens.weight" in ref
    d = tiny_drafter(t, drafter_layers=1)
    assert torch.equal(d.embed_tokens.weight, ref["model.language_model.embed_tokens.weight"])
    assert torch.equal(d.lm_head.weight, ref["lm_head.weight"])


# ----------------------------------------------------------------------------------------------
# 3. Only the trainable parts learn


def test_only_trainable_parts_get_gradients(tiny_dense):
    d = tiny_drafter(tiny_dense)
    embed0, head0 = d.embed_tokens.weight.clone(), d.lm_head.weight.clone()
    opt = torch.optim.AdamW(d.trainable_parameters(), lr=1e-2)
    out = d(*make_inputs(d.cfg, anchors=[3, 6], S=8, R=2))
    assert out.shape == (2, 8, 64)
    out.sum().backward()
    trainable = dict(d.named_parameters())
    names = set(d.trainable_state_dict())
    assert names == {n for n in trainable if not n.startswith(("embed_tokens.", "lm_head."))}
    for n in names:
        assert trainable[n].grad is not None and trainable[n].grad.abs().sum() > 0, n
    assert d.embed_tokens.weight.grad is None and d.lm_head.weight.grad is None
    assert not d.embed_tokens.weight.requires_grad and not d.lm_head.weight.requires_grad
    fc0 = d.fc.weight.clone()
    opt.step()
    assert torch.equal(d.embed_tokens.weight, embed0) and torch.equal(d.lm_head.weight, head0)
    assert not torch.equal(d.fc.weight, fc0)


def test_bad_inputs_raise(tiny_dense):
    d = tiny_drafter(tiny_dense, drafter_layers=1)
    hidden, ids, cp, bp, mask = make_inputs(d.cfg, anchors=[3], S=5)
    with pytest.raises(ValueError, match="features"):
        d(hidden[..., :-1], ids, cp, bp, mask)
    with pytest.raises(ValueError, match="ctx_positions"):
        d(hidden, ids, cp[:, :-1], bp, mask)
    with pytest.raises(ValueError, match="mask"):
        d(hidden, ids, cp, bp, mask[..., :-1])
    with pytest.raises(ValueError, match="block_ids"):
        d(hidden, ids.float(), cp, bp, mask)


# ----------------------------------------------------------------------------------------------
# 4. KV injection against a loop-by-loop reference


def naive_forward(d: DFlashDrafter, hidden, ids, anchors, S):
    """One row, float64, explicit loops: block b attends to [context p < anchor_b | its own block]."""
    cfg, B = d.cfg, d.cfg.block_size
    P = {k: v.double() for k, v in d.state_dict().items()}
    D, Hq, Hkv, eps = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def rope(vec, pos):  # rotate pairs (i, i + D/2) by pos * theta^(-2i/D)
        out = vec.clone()
        for i in range(D // 2):
            ang = pos / cfg.rope_theta ** (2 * i / D)
            c, s = math.cos(ang), math.sin(ang)
            out[i] = vec[i] * c - vec[i + D // 2] * s
            out[i + D // 2] = vec[i + D // 2] * c + vec[i] * s
        return out

    ctx = rms(hidden[0].double() @ P["fc.weight"].T, P["hidden_norm.weight"])
    x = P["embed_tokens.weight"][ids[0]]
    for li in range(cfg.num_hidden_layers):
        pre = f"layers.{li}."
        W = lambda n: P[pre + n]  # noqa: E731
        h = rms(x, W("input_layernorm.weight"))
        attn = torch.zeros(x.shape[0], Hq * D, dtype=torch.float64)
        for b, a in enumerate(anchors):
            srcs = [(ctx[p], p) for p in range(a)] + [(h[b * B + j], a + j) for j in range(B)]
            for i in range(B):
                qi = b * B + i
                for hd in range(Hq):
                    g = hd // (Hq // Hkv)
                    q = rope(rms(W("self_attn.q_proj.weight")[hd * D:(hd + 1) * D] @ h[qi],
                                 W("self_attn.q_norm.weight")), a + i)
                    scores, vals = [], []
                    for src, pos in srcs:
                        k = rope(rms(W("self_attn.k_proj.weight")[g * D:(g + 1) * D] @ src,
                                     W("self_attn.k_norm.weight")), pos)
                        scores.append(float(q @ k) / math.sqrt(D))
                        vals.append(W("self_attn.v_proj.weight")[g * D:(g + 1) * D] @ src)
                    m = max(scores)
                    e = [math.exp(s - m) for s in scores]
                    attn[qi, hd * D:(hd + 1) * D] = sum(w * v for w, v in zip(e, vals)) / sum(e)
        x = x + attn @ W("self_attn.o_proj.weight").T
        h = rms(x, W("post_attention_layernorm.weight"))
        gate, up = h @ W("mlp.gate_proj.weight").T, h @ W("mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ W("mlp.down_proj.weight").T
    return rms(x, P["norm.weight"])


def test_kv_injection_matches_naive_reference(tiny_dense):
    d = tiny_drafter(tiny_dense, drafter_layers=2, block_size=4).float()
    anchors, S = [3, 7], 10
    hidden, ids, cp, bp, mask = make_inputs(d.cfg, anchors, S, seed=3)
    with torch.no_grad():
        got = d(hidden, ids, cp, bp, mask)[0].double()
    want = naive_forward(d, hidden, ids, anchors, S)
    assert (got - want).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------------------------
# 5. Export


def test_export_round_trip(tiny_dense, tmp_path):
    d = tiny_drafter(tiny_dense, drafter_layers=2)
    out = export_drafter(d, str(tmp_path / "export"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".export*"))  # no temp folder left behind
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["block_size"] == 4 and c["num_target_layers"] == 8
    assert c["dflash_config"] == {"target_layer_ids": LAYER_IDS, "mask_token_id": MASK_ID, "block_size": 4}
    assert c["attention_bias"] is False
    for k, v in {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                 "vocab_size": 512, "max_position_embeddings": 1024}.items():
        assert c[k] == v, k
    saved = tensors_of(out)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}.weight" for i in range(2) for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(saved) == expected == set(d.trainable_state_dict())
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    assert saved["fc.weight"].shape == (64, 3 * 64)

    loaded = load_exported(str(out), str(tiny_dense))
    with torch.no_grad():  # the reference: the same drafter with its weights rounded to bf16
        for p in d.trainable_parameters():
            p.copy_(p.to(torch.bfloat16).float())
    inputs = make_inputs(d.cfg, anchors=[2, 5], S=7, R=2)
    with torch.no_grad():
        assert torch.equal(loaded(*inputs), d(*inputs))
    assert loaded.cfg == d.cfg

    # A second export replaces the first whole; a folder that is not an export is never replaced.
    with torch.no_grad():
        d.fc.weight.zero_()
    export_drafter(d, str(out))
    assert tensors_of(out)["fc.weight"].abs().sum() == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep")
    with pytest.raises(UserError):
        export_drafter(d, str(tmp_path / "other"))
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep"


def test_eval_warns_when_the_target_is_not_the_one_trained_for(tiny_dense, tmp_path, caplog):
    from dflash_offline.drafter.export import export_drafter
    from dflash_offline.evaluate.run import load_drafter
    from dflash_offline.tiny import make_tiny_target

    folder = export_drafter(tiny_drafter(tiny_dense), str(tmp_path / "export"))
    with caplog.at_level(logging.WARNING, logger="dflash.eval"):
        load_drafter(str(folder), str(tiny_dense))
        assert not caplog.records
        other = make_tiny_target(tmp_path / "other", seed=1)  # the same shape, other weights
        load_drafter(str(folder), str(other))
    (rec,) = caplog.records
    assert f"was trained for target '{tiny_dense.parent.name}/tiny-qwen3'" in rec.getMessage() and "weights_fingerprint" in rec.getMessage()
