"""GPU: `generate` on CUDA, continuous batching (the default: a CUDA-graph step) and padded batches
(dense targets also with the padded step compiled into CUDA graphs), hybrid targets with
flash-linear-attention's kernels; all in fp32 (TF32 off) against the plain greedy decode of each
prompt on the same GPU (no cache, a full forward per token)."""

from __future__ import annotations

import importlib.util

import pyarrow.parquet as pq
import pytest
import torch

from conftest import run_cli
from test_generate import MAX_NEW, make_prompts, read_output

pytestmark = pytest.mark.gpu


def cuda_greedy(target, prompts, max_new):
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to("cuda").eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            seq = list(p)
            for _ in range(max_new):
                seq.append(int(model(input_ids=torch.tensor([seq], device="cuda")).logits[0, -1].argmax()))
            out.append(seq[len(p):])
    return out


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_generate_on_cuda_equals_plain_greedy(kind, tiny_dense, tiny_hybrid, tmp_path):
    if kind == "hybrid":
        assert importlib.util.find_spec("fla") is not None, "flash-linear-attention must be installed for this test"
    target = tiny_dense if kind == "dense" else tiny_hybrid
    prompts_path = make_prompts(tmp_path / "prompts.parquet")
    prompts = pq.read_table(prompts_path).column("input_ids").to_pylist()
    expected = cuda_greedy(target, prompts, MAX_NEW)
    outs = {}
    modes = {"continuous": ["--batching", "continuous"], "plain-step": ["--batching", "continuous", "--step", "plain"],
             "padded": ["--batching", "padded"]}
    if kind == "dense":
        modes["compiled"] = ["--batching", "padded", "--compile"]
    for mode, opts in modes.items():
        out = tmp_path / mode
        r = run_cli(["generate", "--target", target, "--prompts", prompts_path, "--out", out, "--devices", "0",
                     "--compute-dtype", "float32", "--batch-tokens", 4 * (30 + MAX_NEW), "--chunk-prompts", 6,
                     "--max-new-tokens", MAX_NEW, "--ignore-eos", "--no-progress", *opts])
        assert r.returncode == 0, r.stderr[-3000:]
        outs[mode] = read_output(out)
        for k, (p, e) in enumerate(zip(prompts, expected)):
            assert outs[mode][100 + k]["input_ids"] == p + e, (mode, k)
    assert all(o == outs["continuous"] for o in outs.values())
