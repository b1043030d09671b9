"""The eval report's JSON contract: a typed report (evaluate/report.py) written as the flat objects
readers of `eval --json` read, with what was not measured left out rather than null, and the check
that fails the command."""

from __future__ import annotations

import json

from dflash_offline.evaluate.report import (Baseline, Confidence, DecodeSetup, DecodeSummary, DrafterResult,
                                            EvalReport, Implied)
from dflash_offline.evaluate.verdicts import Divergence
from dflash_offline.runtime.paths import REPORT_FORMAT
from dflash_offline.sampling import Sampling


def _summary(tau=3.0, confidence=None):
    return DecodeSummary(rounds=4, tokens=13, committed=12, seconds=0.5, tokens_per_s=26.0, tau=tau,
                         tau_per_prompt_mean=tau, tau_per_prompt=[tau], accept_rate=[0.75, 0.5], target_forwards=5,
                         confidence=confidence)


def test_a_drafter_entry_is_flat_and_leaves_out_what_was_not_measured():
    bare = DrafterResult("run/export", 8)
    assert bare.to_json() == {"path": "run/export", "block_size": 8}  # no decode, no cache: nothing else
    tie = Divergence(7, 3, 11, 12, 12, 11, 0.01, 0.1, "tie", "static")
    e = DrafterResult("run/export", 8, decode=_summary(confidence=Confidence([0.9], [0.8], [4])),
                      accepted_per_prompt=[[1, 2]], committed_per_prompt=[[2, 3]], speedup=1.5, lossless=False,
                      mismatched_prompt_ids=[7], divergences=[tie], implied=Implied("qwen3.6-27b", 2.0, "implies 2.0x"))
    j = e.to_json()
    assert j["tau"] == 3.0 and j["rounds"] == 4 and j["accept_rate"] == [0.75, 0.5]  # the summary, flat
    assert j["confidence"] == {"predicted": [0.9], "observed": [0.8], "verified": [4]}
    assert j["divergences"] == [tie.as_dict()] and j["divergence_verdicts"] == {"tie": 1, "drift": 0, "reference": 0,
                                                                                  "neither": 0}
    assert j["implied"] == {"shape": "qwen3.6-27b", "speedup": 2.0, "line": "implies 2.0x"}
    assert "cache_walk" not in j and "parity" not in j and "decode" not in j
    assert json.loads(json.dumps(j)) == j  # plain JSON
    assert "confidence" not in DrafterResult("d", 8, decode=_summary()).to_json()


def test_the_report_and_the_check_that_fails_the_command():
    setup = DecodeSetup(prompts="p.parquet", num_prompts=1, max_new_tokens=8, eos=[0], hybrid_target=False,
                        prompt_ids=[7], lossless_against=None, decoder="static", decoding="static, eager", batch_size=1,
                        sampling=Sampling(1.0, 1.0, 3))
    ok = DrafterResult("a", 8, decode=_summary(), lossless=True)
    report = EvalReport("t", "cpu", "float32", "2.x", [ok], decode=setup, baseline=Baseline(13, 1.0, 13.0, 13))
    j = report.to_json()
    assert j["format"] == REPORT_FORMAT and j["lossless_against"] is None  # said, even when None
    assert j["sampling"] == {"temperature": 1.0, "top_p": 1.0, "seed": 3, "top_k": 0}
    assert j["baseline"] == {"tokens": 13, "seconds": 1.0, "tokens_per_s": 13.0, "target_forwards": 13}
    assert j["drafters"][0]["lossless"] is True and "cache" not in j
    assert not report.failed()
    report.drafters.append(DrafterResult("b", 8, parity={"agree": False}))
    assert report.failed()
    assert EvalReport("t", "cpu", "float32", "2.x", [DrafterResult("c", 8, lossless=False)]).failed()
