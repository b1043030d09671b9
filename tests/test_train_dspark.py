"""`train --method dspark` on the CPU: it learns, two gloo ranks equal one process, a SIGKILLed run
resumes to the uninterrupted one, and the export has DeepSpec's layout and loads back to the same
weights and logits. Refusals of options DSpark does not combine with."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from conftest import STRAIGHT, TRAIN, extract_arith_cache, run_cli

DSPARK = ["--method", "dspark", "--markov-rank", "16"]


@pytest.fixture(scope="module")
def topk_cache(tiny_dense, tmp_path_factory):
    """Arithmetic rows with the target's top-8 (p_target of the L1 term)."""
    return extract_arith_cache(tiny_dense, tmp_path_factory.mktemp("dspark"), rows=96, topk=8)


def train(tiny_dense, cache, out, *extra, **kw):
    return run_cli(["train", "--target", str(tiny_dense), "--cache", str(cache), "--out", str(out), *TRAIN, *DSPARK,
                    *extra], timeout=600, **kw)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def straight(topk_cache, tiny_dense, tmp_path_factory):
    runs = {}

    def get(devices: str):
        if devices not in runs:
            out = tmp_path_factory.mktemp("dspark-straight") / devices.replace(",", "-")
            r = train(tiny_dense, topk_cache, out, *STRAIGHT, "--devices", devices)
            assert r.returncode == 0, r.stderr[-3000:]
            runs[devices] = out
        return runs[devices]

    return get


def test_dspark_learns_and_exports_deepspec_layout(topk_cache, tiny_dense, tmp_path):
    out = tmp_path / "run"
    r = train(tiny_dense, topk_cache, out, "--epochs", "4", "--checkpoint-every", "1000")
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    first, last = np.mean([x["loss"] for x in m[:3]]), np.mean([x["loss"] for x in m[-3:]])
    assert last < 0.75 * first, (first, last)
    assert len(m[-1]["acc"]) == 8  # every slot drafts, slot 0 (the anchor's next token) first
    # the tiny target's weights are random: its top-8 (the L1 term's p_target) is noise beside the
    # arithmetic data, so the test asks the data of the cross-entropy alone
    held = extract_arith_cache(tiny_dense, tmp_path / "held", rows=24, topk=8)  # rows of another input file
    r = train(tiny_dense, topk_cache, tmp_path / "ce", "--epochs", "4", "--ce-weight", "1", "--tv-weight", "0",
              "--eval-cache", str(held), "--eval-every", "30")
    assert r.returncode == 0, r.stderr[-3000:]
    ce = metrics(tmp_path / "ce")
    # the held-out walk scores DSpark blocks (8 drafts a round) and picks the best checkpoint
    held = [json.loads(x) for x in (tmp_path / "ce" / "heldout.jsonl").read_text().splitlines()]
    assert held and all(1.0 <= h["tau_pooled"] <= 9 for h in held) and held[-1]["tau_pooled"] > held[0]["tau_pooled"]
    assert json.loads((tmp_path / "ce" / "best.json").read_text())
    assert np.mean([x["acc_slot1"] for x in ce[-3:]]) > np.mean([x["acc_slot1"] for x in ce[:3]]) + 0.3
    assert ce[-1]["tau"] > 1.5
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in cfg
    assert cfg["block_size"] == 8 and cfg["mask_token_id"] == 1 and cfg["target_layer_ids"] == [1, 2, 3, 4, 5]
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["enable_confidence_head"],
            cfg["confidence_head_with_markov"]) == (16, "vanilla", True, True)
    from safetensors.torch import load_file as load_torch

    from dflash_offline.drafter.export import load_exported
    from dflash_offline.runs.checkpoint import load_checkpoint

    tensors = load_torch(str(out / "export" / "model.safetensors"))
    assert tensors["markov_head.markov_w1.weight"].shape == (cfg["vocab_size"], 16)
    assert tensors["markov_head.markov_w2.weight"].shape == (cfg["vocab_size"], 16)
    assert tensors["confidence_head.proj.weight"].shape == (1, cfg["hidden_size"] + 16)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= set(tensors)
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(tensors)  # engines lend the target's
    assert cfg["num_anchors"] == 512 and cfg["sample_from_anchor"] is True
    # export -> load -> the checkpoint's weights rounded to bf16, and the same logits
    loaded = load_exported(str(out / "export"), str(tiny_dense))
    ckpt = load_checkpoint(str(out / f"step-{m[-1]['step']}"))
    ckpt.load_frozen_from_target(str(tiny_dense))
    with torch.no_grad():
        for k, v in ckpt.state_dict().items():
            want = v if k.startswith(("embed_tokens.", "lm_head.")) else v.to(torch.bfloat16)  # the target's, as they are
            assert torch.equal(loaded.state_dict()[k].float(), want.float()), k
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(1, 10, loaded.fc.in_features, generator=g)
        kv = loaded.context_kv(feats, torch.arange(10)[None])
        h = loaded.draft_hidden(kv, torch.tensor([[5] + [1] * 7]), torch.arange(10, 18)[None])
        prev = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
        e, code = loaded.markov_head.code(h, prev)
        logits = loaded.lm_head(h.to(loaded.lm_head.weight.dtype)).float() + loaded.markov_head.bias(code)
        ckpt = ckpt.to(torch.float32)
        for p, q in zip(ckpt.parameters(), loaded.parameters()):
            p.copy_(q)
        kv2 = ckpt.context_kv(feats, torch.arange(10)[None])
        h2 = ckpt.draft_hidden(kv2, torch.tensor([[5] + [1] * 7]), torch.arange(10, 18)[None])
        e2, code2 = ckpt.markov_head.code(h2, prev)
        assert torch.equal(logits, ckpt.lm_head(h2.to(ckpt.lm_head.weight.dtype)).float() + ckpt.markov_head.bias(code2))
        assert torch.equal(loaded.confidence_head(h, e), ckpt.confidence_head(h2, e2))
    # eval decodes the export (the static decoder, 2 prompts a forward), lossless against the target
    # alone; the report has 8 draft slots and the confidence head's calibration; transformers' decoders refuse it
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "input_ids": [[5, 9, 13, 7], [3, 3, 8], [11, 2, 6, 4, 9]]}), prompts)
    rep = tmp_path / "eval.json"
    args = ["eval", "--target", str(tiny_dense), "--drafter", str(out / "export"), "--prompts", str(prompts),
            "--max-new-tokens", "20", "--batch-size", "2", "--no-progress"]
    r = run_cli([*args, "--json", str(rep), "--implied-for", "qwen3.6-27b-b8"])
    assert r.returncode == 0, r.stderr[-3000:]
    e = json.loads(rep.read_text())["drafters"][0]
    assert e["lossless"] is True and len(e["accept_rate"]) == 8 and e["tau"] >= 1
    # what its tau implies on the 27B shape: its rounds verify 9 tokens (the anchor and 8 drafts)
    assert "verify of 9 tokens interpolated from widths 8 and 16" in e["implied"]["line"], e["implied"]
    assert e["implied"]["line"] in r.stdout
    c = e["confidence"]
    assert c["verified"][0] == e["rounds"] and all(0 <= p <= 1 for p in c["predicted"])
    assert "confidence head, predicted / observed" in r.stdout
    r = run_cli([*args, "--decoder", "transformers"])
    assert r.returncode != 0 and "static decoder only" in r.stderr, r.stderr[-2000:]
    assert "target alone" not in r.stderr  # refused before the baseline's decoding
    r = run_cli(["eval", "--target", str(tiny_dense), "--drafter", str(out / "export"), "--cache", str(topk_cache),
                 "--parity", "2", "--no-progress"])
    assert r.returncode != 0 and "--parity" in r.stderr, r.stderr[-2000:]
    # `export --target-tables` of a checkpoint carries the target's tables (DeepSpec's evaluator loads
    # them from the checkpoint), not placeholders; without the option there are none
    from safetensors.torch import load_file as load_st

    r = run_cli(["export", "--run", str(out), "--to", str(tmp_path / "plain")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert load_st(str(tmp_path / "plain" / "model.safetensors")).keys() == tensors.keys()
    r = run_cli(["export", "--run", str(out), "--to", str(tmp_path / "again"), "--target-tables"])
    assert r.returncode == 0, r.stderr[-2000:]
    again = load_st(str(tmp_path / "again" / "model.safetensors"))
    target = load_st(str(next(tiny_dense.glob("*.safetensors"))))
    assert torch.equal(again["embed_tokens.weight"], target["model.embed_tokens.weight"].to(torch.bfloat16))
    assert torch.equal(again["lm_head.weight"], target["lm_head.weight"].to(torch.bfloat16))
    # the tiny target is untied: llama.cpp would draft with the input table as its head, said in one line
    assert "not served as trained by llama.cpp" in r.stderr, r.stderr[-2000:]
    # ... of the target the run trained against: another model of the same shapes is refused, the
    # same target moved elsewhere is read from --target; --target alone is refused
    import shutil

    from dflash_offline.tiny import make_tiny_target

    other = make_tiny_target(tmp_path / "other", kind="qwen3", seed=5)
    r = run_cli(["export", "--run", str(out), "--to", str(tmp_path / "ex-other"), "--target-tables", "--target", str(other)])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert f"--target {other}: its weights are not the ones the run trained against" in r.stderr, r.stderr
    assert not (tmp_path / "ex-other").exists()
    r = run_cli(["export", "--run", str(out), "--to", str(tmp_path / "ex-other"), "--target", str(other)])
    assert r.returncode == 2 and "read only with --target-tables" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ex-other").exists()
    moved = tmp_path / "moved"
    shutil.copytree(tiny_dense, moved)
    r = run_cli(["export", "--run", str(out), "--to", str(tmp_path / "ex-moved"), "--target-tables", "--target", str(moved)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert load_st(str(tmp_path / "ex-moved" / "model.safetensors")).keys() == again.keys()
    r = run_cli(["export", "--run", str(out), "--to", str(tmp_path / "ex-moved"), "--target-tables", "--target", str(moved)])
    assert r.returncode == 0 and "(it replaced the export that was there)" in r.stdout, r.stdout + r.stderr


def test_two_gloo_ranks_equal_one_process(straight):
    one, two = straight("cpu"), straight("cpu,cpu")
    la, lb = [x["loss"] for x in metrics(one)], [x["loss"] for x in metrics(two)]
    assert len(la) == len(lb) == 12
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    wa, wb = (load_file(str(o / "step-12" / "drafter.safetensors")) for o in (one, two))
    assert any(k.startswith("markov_head.") for k in wa) and any(k.startswith("confidence_head.") for k in wa)
    for k in wa:
        np.testing.assert_allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_resume_after_sigkill_equals_straight_run(topk_cache, tiny_dense, straight, tmp_path):
    resumed = tmp_path / "resumed"
    env = {**os.environ, "DFLASH_OFFLINE_KILL_AT": "checkpoint-saved:1"}
    r = train(tiny_dense, topk_cache, resumed, "--epochs", "2", "--max-steps", "12", "--checkpoint-every", "6", env=env)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    r = train(tiny_dense, topk_cache, resumed, "--epochs", "2", "--max-steps", "12", "--checkpoint-every", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["loss"] for x in metrics(straight("cpu"))] == [x["loss"] for x in metrics(resumed)]
    want, got = (load_file(str(o / "step-12" / "drafter.safetensors")) for o in (straight("cpu"), resumed))
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(want[k], got[k], err_msg=k)


def test_dflash_with_the_l1_term_learns_and_stays_dflash(topk_cache, tiny_dense, tmp_path):
    """--method dflash --tv-weight: DFlash's slots and export, its loss with DSpark's L1 term (here with
    D-PACE slot weights, the DFlash recipe's)."""
    out = tmp_path / "run"
    r = run_cli(["train", "--target", str(tiny_dense), "--cache", str(topk_cache), "--out", str(out), *TRAIN,
                 "--tv-weight", "0.5", "--epochs", "3", "--loss-weights", "dpace"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert len(m[-1]["acc"]) == 7 and m[-1]["loss"] < m[0]["loss"]
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "markov_rank" not in cfg
    r = run_cli(["train", "--target", str(tiny_dense), "--cache", str(topk_cache), "--out", str(tmp_path / "kd"), *TRAIN,
                 "--tv-weight", "0.5", "--kd-weight", "0.5"])
    assert r.returncode != 0 and "--kd-weight" in r.stderr and "--tv-weight" in r.stderr, r.stderr[-2000:]
    r = run_cli(["train", "--target", str(tiny_dense), "--cache", str(topk_cache), "--out", str(tmp_path / "ce"), *TRAIN,
                 "--ce-weight", "0.5"])
    assert r.returncode != 0 and "--ce-weight" in r.stderr and "--tv-weight" in r.stderr, r.stderr[-2000:]
    r = run_cli(["train", "--target", str(tiny_dense), "--cache", str(topk_cache), "--out", str(tmp_path / "mr"), *TRAIN,
                 "--markov-rank", "64"])
    assert r.returncode != 0 and "--markov-rank" in r.stderr and "--method dspark" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("extra,says", [
    (["--kd-weight", "0.5"], "--kd-weight"),
    (["--markov-rank", "0"], "--markov-rank"),
    (["--tv-weight", "-1"], "--tv-weight"),
])
def test_refusals(topk_cache, tiny_dense, tmp_path, extra, says):
    r = train(tiny_dense, topk_cache, tmp_path / "run", *extra)
    assert r.returncode != 0 and says in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()
