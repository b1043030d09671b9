"""What the engines load is what we trained.

- llama.cpp: its own converter (`convert_hf_to_gguf.py` and its `gguf-py`, from the llama-cpp-python
  0.3.36 source distribution on the package index) turns tiny tied and untied DFlash and DSpark
  exports into GGUF files; their tensors and keys say what its runtime drafts with. Without the
  target's tables the GGUF holds neither `token_embd` nor `output`, so the runtime lends the target's
  (`src/models/dflash.cpp`); with them, `token_embd` is our copy of the input table and there is no
  `output`, so the runtime would draft with the input table as the LM head: wrong on an untied
  target, which the export says in its warning. (Its runtime is not built here: a C++ build does
  not fit the suite's time.)
- DeepSpec (deepseek-ai/DeepSpec at afdfa7c; not on the package index), SGLang 0.5.23 and vLLM 0.33.0
  (GPU engines): the export is held to the keys, tensor names and shapes their loaders require, as
  read in their source at those versions (facts written out below, not their code).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.export import export_drafter
from dflash_offline.drafter.model import DFlashDrafter

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
MASK = 3  # <|MASK|>: the sentencepiece model's first user-defined piece (after <unk>, <s>, </s>)
LAYERS = [1, 3, 5]
RANK = 8


# ----------------------------------------------------------------------------------------------
# Targets with a tokenizer llama.cpp's converter reads (it refuses a BPE tokenizer whose
# pre-tokenizer it does not know, and reads a sentencepiece model as it is)


def sentencepiece_target(folder, tied: bool):
    import sentencepiece as spm
    from transformers import AutoModelForCausalLM

    from dflash_offline.tiny import tiny_config

    cfg = tiny_config("qwen3")
    cfg.tie_word_embeddings = tied
    torch.manual_seed(1 if tied else 2)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    rng = random.Random(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "print", "value", "data"]
    text = folder / "corpus.txt"
    text.write_text("\n".join(" ".join(f"{rng.choice(words)}{rng.randint(0, 3000)}" for _ in range(12))
                              for _ in range(3000)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "tokenizer"), vocab_size=cfg.vocab_size,
                                   hard_vocab_limit=False, model_type="bpe", user_defined_symbols=["<|MASK|>"],
                                   minloglevel=2)
    text.unlink()
    return folder


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    return {tied: sentencepiece_target(root / f"target-{'tied' if tied else 'untied'}", tied) for tied in (True, False)}


def drafter_of(target, method: str = "dspark", head: str = "vanilla", confidence: bool = True) -> DFlashDrafter:
    """A drafter with random trainable weights (what the engines read is the layout, not the skill)."""
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(str(target), LAYERS, block_size=8, drafter_layers=2, mask_token_id=MASK)
    if method == "dspark":
        cfg = dataclasses.replace(cfg, method="dspark", markov_rank=RANK, markov_head_type=head,
                                  confidence_head=confidence)
    d = DFlashDrafter(cfg)
    d.load_frozen_from_target(str(target))
    return d


def export(d, folder, caplog, **kw):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash.drafter"):
        export_drafter(d, str(folder), **kw)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ----------------------------------------------------------------------------------------------
# llama.cpp's converter


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    """convert_hf_to_gguf.py with its conversion/ and gguf-py/ from the llama-cpp-python source
    distribution (llama.cpp's tree, vendored), fetched from the package index."""
    where = tmp_path_factory.mktemp("llama-cpp")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", str(where), LLAMA_CPP_PYTHON], capture_output=True, text=True,
                       timeout=600)
    sdist = next(where.glob("llama_cpp_python-*.tar.gz"), None)
    if sdist is None:
        pytest.fail(f"could not fetch {LLAMA_CPP_PYTHON}'s source distribution with pip (llama.cpp's converter is "
                    f"tested from it and needs the package index):\n{r.stderr[-2000:]}")
    keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                   and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(keep)]
        tar.extractall(where, members=members, filter="data")
    sdist.unlink()
    return next(where.glob("llama_cpp_python-*/vendor/llama.cpp"))


def to_gguf(converter, export_dir, target, out):
    """The converter run as its users run it; returns (tensors {name: float32 array}, keys {name: value})."""
    r = subprocess.run([sys.executable, str(converter / "convert_hf_to_gguf.py"), str(export_dir), "--target-model-dir",
                        str(target), "--outfile", str(out), "--outtype", "f32"], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        return None, r.stderr
    sys.path.insert(0, str(converter / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.remove(str(converter / "gguf-py"))
    reader = GGUFReader(str(out))
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}
    keys = {k: f.contents() for k, f in reader.fields.items()}
    return tensors, keys


def test_llama_cpp_drafts_with_the_targets_head(converter, targets, tmp_path, caplog):
    """Tied and untied, DSpark and DFlash, as exported by default: the GGUF has no token table and
    no output head of its own (llama.cpp lends the target's), its layer ids are the target's layers
    as llama.cpp counts them (id + 1), and its tensors are ours."""
    for tied, target in targets.items():
        for method in ("dspark", "dflash"):
            d = drafter_of(target, method)
            folder = tmp_path / f"{method}-{tied}"
            warned = export(d, folder, caplog)
            assert warned == [], warned  # vanilla head, confidence head, no tables: every engine serves it
            tensors, keys = to_gguf(converter, folder, target, tmp_path / f"{method}-{tied}.gguf")
            assert tensors is not None, keys
            assert "token_embd.weight" not in tensors and "output.weight" not in tensors, sorted(tensors)
            assert keys["general.architecture"] == "dflash"
            assert list(keys["dflash.target_layers"]) == [i + 1 for i in LAYERS]
            assert keys["dflash.block_size"] == 8 and keys["tokenizer.ggml.mask_token_id"] == MASK
            ours = load_file(str(folder / "model.safetensors"))
            np.testing.assert_array_equal(tensors["fc.weight"].reshape(-1), ours["fc.weight"].float().numpy().reshape(-1))
            if method == "dspark":
                assert keys["dflash.sample_from_anchor"] is True and keys["dflash.has_confidence_head"] is True
                for name, ours_name in (("markov_w1.weight", "markov_head.markov_w1.weight"),
                                        ("markov_w2.weight", "markov_head.markov_w2.weight"),
                                        ("conf_proj.weight", "confidence_head.proj.weight")):
                    np.testing.assert_array_equal(tensors[name].reshape(-1),
                                                  ours[ours_name].float().numpy().reshape(-1), err_msg=name)


def test_with_the_tables_llama_cpp_takes_the_input_table_as_its_head(converter, targets, tmp_path, caplog):
    """--target-tables (for DeepSpec): the converter keeps the embedding as token_embd and drops
    lm_head, so the runtime's head is the input table. Right on a tied target; on an untied one the
    export warns, naming llama.cpp."""
    for tied, target in targets.items():
        d = drafter_of(target)
        folder = tmp_path / f"tables-{tied}"
        warned = export(d, folder, caplog, target_tables=True)
        tensors, keys = to_gguf(converter, folder, target, tmp_path / f"tables-{tied}.gguf")
        assert "output.weight" not in tensors and "token_embd.weight" in tensors
        src = load_file(str(next(target.glob("*.safetensors"))))
        embed = src["model.embed_tokens.weight"].to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(tensors["token_embd.weight"].reshape(-1), embed.reshape(-1))
        if tied:
            assert warned == []
        else:
            head = src["lm_head.weight"].to(torch.bfloat16).float().numpy()
            assert not np.array_equal(embed, head)  # so the GGUF would draft with the wrong head
            assert len(warned) == 1 and "llama.cpp" in warned[0] and "untied" in warned[0], warned


def test_a_gated_head_is_refused_by_llama_cpp_and_the_export_says_so(converter, targets, tmp_path, caplog):
    target = targets[False]
    folder = tmp_path / "gated"
    warned = export(drafter_of(target, head="gated"), folder, caplog)
    assert len(warned) == 1 and "vLLM 0.33.0" in warned[0] and "llama.cpp" in warned[0], warned
    tensors, err = to_gguf(converter, folder, target, tmp_path / "gated.gguf")
    assert tensors is None and "unsupported markov_head_type 'gated'" in err


# ----------------------------------------------------------------------------------------------
# DeepSpec, SGLang and vLLM: what their loaders read, as their source says


def deepspec_parameters(cfg: DrafterConfig, conf_with_markov: bool = True) -> dict[str, tuple]:
    """Qwen3DSparkModel's parameters and shapes (deepspec/modeling/dspark/qwen3/modeling.py at
    afdfa7c; the Markov heads in markov_head.py, the confidence head AcceptRatePredictor in
    common.py), which its evaluator fills with `from_pretrained`."""
    h, v, r, d = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    out = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,), "hidden_norm.weight": (h,),
           "fc.weight": (h, len(cfg.target_layer_ids) * h)}
    for i in range(cfg.num_hidden_layers):
        out.update({f"layers.{i}.{k}": s for k, s in {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
            "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,), "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}.items()})
    if r:
        out.update({"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)})
        if cfg.markov_head_type == "gated":
            out.update({"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)})
    if cfg.confidence_head:
        out.update({"confidence_head.proj.weight": (1, h + (r if conf_with_markov else 0)),
                    "confidence_head.proj.bias": (1,)})
    return out


# Config keys each loader requires (asserts, or reads without a default), at the versions named.
DEEPSPEC_KEYS = ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head", "markov_rank",
                 "block_size", "num_hidden_layers", "vocab_size", "hidden_size")
SGLANG_KEYS = ("head_dim", "target_layer_ids", "block_size", "num_hidden_layers", "mask_token_id", "markov_rank")
VLLM_KEYS = ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "hidden_size", "vocab_size")


@pytest.mark.parametrize("head,confidence", [("vanilla", True), ("gated", True), ("vanilla", False)])
def test_the_dspark_export_has_what_deepspecs_loader_asserts(head, confidence, targets, tmp_path, caplog):
    target = targets[False]  # untied: the two tables differ, so each is checked against its own
    d = drafter_of(target, head=head, confidence=confidence)
    warned = export(d, tmp_path / "ds", caplog, target_tables=True)
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    for key in DEEPSPEC_KEYS + SGLANG_KEYS + VLLM_KEYS:
        assert key in cfg, key
    assert cfg["num_anchors"] > 0 and cfg["sample_from_anchor"] is True and cfg["tie_word_embeddings"] is False
    if cfg["markov_rank"] > 0:
        assert cfg["markov_head_type"] == head
    if cfg["enable_confidence_head"]:
        assert cfg["confidence_head_with_markov"] is True
    ids = cfg["target_layer_ids"]
    assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < cfg["num_target_layers"] - 1  # its asserts
    tensors = load_file(str(tmp_path / "ds" / "model.safetensors"))
    assert {k: tuple(t.shape) for k, t in tensors.items()} == deepspec_parameters(d.cfg)
    src = load_file(str(next(target.glob("*.safetensors"))))
    assert torch.equal(tensors["embed_tokens.weight"], src["model.embed_tokens.weight"].to(torch.bfloat16))
    assert torch.equal(tensors["lm_head.weight"], src["lm_head.weight"].to(torch.bfloat16))
    # the engines that cannot serve it are named, one line
    if head == "gated":
        assert "vLLM 0.33.0" in warned[0] and "llama.cpp" in warned[0]
    if not confidence:
        assert any("SGLang 0.5.23 outside its default static verify mode" in w for w in warned)


def test_without_the_tables_every_engine_lends_the_targets(targets, tmp_path, caplog):
    """The default: no embedding or LM head in the file (vLLM 0.33.0 and SGLang 0.5.23 attach the
    target's; llama.cpp lends them, above); the file is the DeepSpec set less the two tables; the
    log says how to get them for DeepSpec. Loaded back here, the drafter equals the exported one."""
    from dflash_offline.drafter.export import load_exported

    target = targets[False]
    d = drafter_of(target)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash.drafter"):
        export_drafter(d, str(tmp_path / "ex"))
    assert any("--target-tables" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    tensors = load_file(str(tmp_path / "ex" / "model.safetensors"))
    want = deepspec_parameters(d.cfg)
    del want["embed_tokens.weight"], want["lm_head.weight"]
    assert {k: tuple(t.shape) for k, t in tensors.items()} == want
    back = load_exported(str(tmp_path / "ex"), str(target))
    for k, t in back.state_dict().items():
        src = d.state_dict()[k]
        assert torch.equal(t, src if k.startswith(("embed_tokens.", "lm_head.")) else src.to(torch.bfloat16).float()), k


def test_a_dflash_export_takes_no_tables_and_a_bonus_anchor_drafter_is_refused(targets, tmp_path):
    from dflash_offline.drafter.export import load_exported
    from dflash_offline.runtime.errors import UserError

    with pytest.raises(UserError, match="a DFlash export holds no embedding or LM head"):
        export_drafter(drafter_of(targets[False], "dflash"), str(tmp_path / "x"), target_tables=True)
    assert not (tmp_path / "x").exists()
    export_drafter(drafter_of(targets[False]), str(tmp_path / "ds"))
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    cfg["sample_from_anchor"] = False
    (tmp_path / "ds" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="sample_from_anchor False: this tool's DSpark drafters draft from the anchor"):
        load_exported(str(tmp_path / "ds"))


# ----------------------------------------------------------------------------------------------
# llama.cpp's runtime, where a build is given (a C++ build does not fit the suite's time on CI)

RUNTIME = "LLAMA_SPECULATIVE_SIMPLE"  # the path of a llama-speculative-simple built from the same llama.cpp tree


@pytest.mark.skipif(not __import__("os").environ.get(RUNTIME), reason=f"needs {RUNTIME}: a llama-speculative-simple "
                    "binary built from the llama.cpp tree the converter comes from")
def test_llama_cpp_runtime_accepts_what_eval_accepts(converter, tmp_path):
    """A DSpark drafter fitted to an untied target's greedy completions, exported by default and
    with --target-tables, converted, and decoded greedy by llama.cpp's runtime: the default export
    accepts exactly the drafts `eval` accepts on the same prompt; the one with the tables (the input
    table as the head) accepts fewer."""
    import os
    import re

    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm

    from conftest import fitted_drafter, run_cli
    from dflash_offline.evaluate.speculative import TargetSession, greedy_decode, load_target_for_decoding

    target = sentencepiece_target(tmp_path / "target", tied=False)
    model, _ = load_target_for_decoding(str(target), "cpu", "float32")
    session = TargetSession(model, LAYERS)
    sp = spm.SentencePieceProcessor(model_file=str(target / "tokenizer.model"))
    texts = ["def value12 return data7 self99", "import x3 class y8 for", "print data1 if value2 else self3 in for"]
    prompts = [[sp.bos_id()] + sp.encode(s) for s in texts]  # as llama.cpp tokenizes them (BOS first)
    completions = [greedy_decode(session, p, 64, set()).tokens for p in prompts]
    d = fitted_drafter(target, session, prompts, completions, LAYERS, method="dspark")
    export_drafter(d, str(tmp_path / "plain"))
    export_drafter(d, str(tmp_path / "tables"), target_tables=True)
    conv = converter / "convert_hf_to_gguf.py"
    subprocess.run([sys.executable, str(conv), str(target), "--outfile", str(tmp_path / "target.gguf"), "--outtype", "f32"],
                   check=True, capture_output=True)
    accepted = {}
    for name in ("plain", "tables"):
        subprocess.run([sys.executable, str(conv), str(tmp_path / name), "--target-model-dir", str(target), "--outfile",
                        str(tmp_path / f"{name}.gguf"), "--outtype", "f32"], check=True, capture_output=True)
        r = subprocess.run([os.environ[RUNTIME], "-m", str(tmp_path / "target.gguf"), "-md", str(tmp_path / f"{name}.gguf"),
                            "--spec-type", "draft-dspark", "--spec-draft-n-max", "8", "-p", texts[0], "-n", "64",
                            "--temp", "0", "--ignore-eos", "-t", "2", "-c", "512"], capture_output=True, text=True,
                           timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-3000:]
        assert re.search(rf"encoded\s+{len(prompts[0])} tokens", out), out[-3000:]
        accepted[name] = int(re.search(r"n_accept\s*=\s*(\d+)", out).group(1))
    pq.write_table(pa.table({"id": pa.array([0], pa.int64()), "input_ids": [prompts[0]]}), tmp_path / "prompt.parquet")
    r = run_cli(["eval", "--target", target, "--drafter", tmp_path / "plain", "--prompts", tmp_path / "prompt.parquet",
                 "--max-new-tokens", "64", "--dtype", "float32", "--no-baseline", "--json", tmp_path / "eval.json",
                 "--no-progress"])
    assert r.returncode == 0, r.stderr[-2000:]
    ours = json.loads((tmp_path / "eval.json").read_text())["drafters"][0]
    assert accepted["plain"] == sum(map(sum, ours["accepted_per_prompt"])) > 0, (accepted, ours["accepted_per_prompt"])
    assert accepted["tables"] < accepted["plain"], accepted
