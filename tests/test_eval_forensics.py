"""`eval`'s divergence forensics (evaluate/forensics.py): where an output parts from the reference,
the target's own margin there from a fresh prefill, and the verdict, in the report and `--json`.
Drift: the static decoder's recurrent states zeroed mid-decode (DFLASH_OFFLINE_CORRUPT=
recurrent-state:N) on a hybrid target. Tie: two LM-head rows made equal, and the reference's token
at a position where they lead swapped for the other. Reference: a reference token swapped at a
position with a clear margin."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_cli
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.export import export_drafter
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.evaluate.verdicts import Divergence, first_difference, tie_bound
from dflash_offline.evaluate.speculative import TargetSession, greedy_decode, load_target_for_decoding
from dflash_offline.tiny import make_tiny_target

MAX_NEW = 24


def files(target, folder, prompts, reference):
    """The prompts and a reference in the contract's Parquet layout, and a random drafter's export."""
    pq.write_table(pa.table({"id": pa.array(range(len(prompts)), pa.int64()), "input_ids": prompts}),
                   folder / "prompts.parquet")
    rows = [p + r for p, r in zip(prompts, reference)]
    masks = [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, reference)]
    pq.write_table(pa.table({"id": pa.array(range(len(prompts)), pa.int64()), "input_ids": rows,
                             "loss_mask": pa.array(masks, pa.list_(pa.int8()))}), folder / "reference.parquet")
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.from_target(str(target), [1, 3], block_size=4, drafter_layers=1, mask_token_id=1))
    d.load_frozen_from_target(str(target))
    export_drafter(d, str(folder / "drafter"))


def evaluate(target, folder, corrupt=None):
    env = {**os.environ, **({"DFLASH_OFFLINE_CORRUPT": corrupt} if corrupt else {})}
    r = run_cli(["eval", "--target", target, "--drafter", folder / "drafter", "--prompts", folder / "prompts.parquet",
                 "--reference", folder / "reference.parquet", "--max-new-tokens", str(MAX_NEW), "--no-baseline",
                 "--ignore-eos", "--json", folder / "eval.json", "--no-progress"], env=env)
    return r, json.loads((folder / "eval.json").read_text())["drafters"][0]


def greedy(target, prompts):
    model, _ = load_target_for_decoding(str(target), "cpu", "float32")
    session = TargetSession(model, [])
    return [greedy_decode(session, p, MAX_NEW, set()).tokens for p in prompts]


def test_a_recurrent_state_corrupted_mid_decode_is_drift(tiny_hybrid, tmp_path):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 500, size=n).tolist() for n in (7, 12)]
    reference = greedy(tiny_hybrid, prompts)
    files(tiny_hybrid, tmp_path, prompts, reference)
    r, e = evaluate(tiny_hybrid, tmp_path, corrupt="recurrent-state:3")
    assert r.returncode == 1 and e["lossless"] is False and e["mismatched_prompt_ids"] == [0], r.stderr[-2000:]
    (d,) = e["divergences"]
    assert d["verdict"] == "drift" and d["prompt_id"] == 0 and d["margin"] > d["bound"] > 0
    assert d["reference_token"] == reference[0][d["position"]] == d["fresh_top1"] != d["output_token"]
    assert d["decoder"].startswith("static buffers")
    assert "prompt 0: output parts from the reference at new token" in r.stderr and "drift: a fresh prefill" in r.stderr
    assert e["divergence_verdicts"] == {"tie": 0, "drift": 1, "reference": 0, "neither": 0}
    assert "the first 1 diagnosed: 1 drift" in r.stdout


def test_a_near_tie_is_a_tie_and_a_wrong_reference_is_named(tmp_path):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 500, size=n).tolist() for n in (9, 5)]
    target = make_tiny_target(tmp_path / "target", kind="qwen3")
    first = greedy(target, prompts)
    a = first[0][3]  # the target's token at new token 3 of prompt 0
    b = (a + 1) % 512
    w = load_file(str(target / "model.safetensors"))
    w["lm_head.weight"][b] = w["lm_head.weight"][a]  # a and b tie wherever one of them leads
    save_file(w, str(target / "model.safetensors"), metadata={"format": "pt"})
    reference = greedy(target, prompts)
    p = reference[0].index(a) if a in reference[0] else reference[0].index(b)
    tied = {a, b}
    reference[0][p] = (tied - {reference[0][p]}).pop()  # the other of the two
    reference[1][2] = (reference[1][2] + 7) % 512  # a token the target does not give, by a clear margin
    files(target, tmp_path, prompts, reference)
    r, e = evaluate(target, tmp_path)
    assert r.returncode == 1 and e["mismatched_prompt_ids"] == [0, 1], r.stderr[-2000:]
    tie, ref = e["divergences"]
    assert (tie["prompt_id"], tie["position"], tie["verdict"]) == (0, p, "tie") and tie["margin"] == 0.0
    assert {tie["fresh_top1"], tie["fresh_top2"]} == tied
    assert (ref["prompt_id"], ref["position"], ref["verdict"]) == (1, 2, "reference")
    assert ref["fresh_top1"] == ref["output_token"] and ref["margin"] > ref["bound"]
    assert "a near tie" in r.stderr and "the reference differs" in r.stderr


def test_first_difference_and_the_line():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    d = Divergence(4, 7, 11, 12, 12, 11, 0.5, 1e-4, "drift", "static buffers, one prompt at a time")
    assert d.line().startswith("prompt 4: output parts from the reference at new token 7 (output 11, reference 12; "
                               "static buffers, one prompt at a time): drift")
    with pytest.raises(KeyError):
        Divergence(**{**d.as_dict(), "verdict": "odd"}).line()
    # without a reference file the reference is eval's own target-alone decode: said so
    base = Divergence(**{**d.as_dict(), "verdict": "reference", "reference_from": "baseline"})
    assert base.line().endswith("the target-alone decode (one token a step, the same decoder) departed from a fresh "
                                "prefill there")
    # the tie bound: a few steps of the dtype at the top logit's binade (25 lies in [16, 32))
    assert (tie_bound("bfloat16", 25.0), tie_bound("float16", 25.0), tie_bound("float32", 25.0)) == (
        4 * 2.0 ** -3, 8 * 2.0 ** -6, 1024 * 2.0 ** -19)
    assert tie_bound("bfloat16", -0.3) == 4 * 2.0 ** -7  # below 1: the steps at 1
