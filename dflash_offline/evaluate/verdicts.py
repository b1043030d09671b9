"""The verdicts of eval's divergence forensics and their lines (evaluate/forensics.py finds them;
this light module is what the report's formatting reads, with no torch).

  tie        the top two logits of a fresh prefill are within a few rounding steps of the dtype
             at the top logit's size (tie_bound): a near tie, either token is the target's answer;
  drift      the fresh prefill gives the reference's token beyond that bound, while the decoder
             committed another: its state departed from what a fresh prefill computes;
  reference  the fresh prefill gives the decoder's token: the reference is not this target's
             greedy decode in this dtype (a reference file), or eval's own target-alone decode
             (one token a step) departed from a fresh prefill (no reference file given);
  neither    it gives a third token: the reference is not this target's decode, and the decoder
             departed from it too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# A tie: the top two logits within a few steps of the dtype at the top logit's binade (the spacing
# of its numbers there). bf16 and fp16 logits are rounded to those steps themselves; an fp32
# forward of other shapes differs by many of its tiny steps after dozens of layers, so more of
# them count. A heuristic, not calibrated on a large target: a margin near the bound is a tie
# that could have been drift, and the line gives the margin to judge by.
MANTISSA = {"float32": 23, "bfloat16": 7, "float16": 10}
TIE_STEPS = {"float32": 1024, "bfloat16": 4, "float16": 8}
VERDICTS = ("tie", "drift", "reference", "neither")


def tie_bound(dtype: str, top_logit: float) -> float:
    binade = math.floor(math.log2(max(abs(top_logit), 1.0)))
    return TIE_STEPS[dtype] * 2.0 ** (binade - MANTISSA[dtype])


def verdict_of(margin: float, bound: float, fresh_top1: int, reference_token: int, output_token: int) -> str:
    if not math.isfinite(margin) or margin <= bound:
        return "tie"
    return "drift" if fresh_top1 == reference_token else "reference" if fresh_top1 == output_token else "neither"


@dataclass
class Divergence:
    prompt_id: int
    position: int  # the first output index where output and reference differ
    output_token: int
    reference_token: int
    fresh_top1: int
    fresh_top2: int
    margin: float  # fresh top-1 logit - top-2 logit
    bound: float  # the margin below which it is a tie
    verdict: str  # one of VERDICTS
    decoder: str  # the decoder path that made the output
    reference_from: str = "file"  # "file" (--reference) or "baseline" (eval's own target-alone decode)

    def line(self) -> str:
        why = {"tie": f"a near tie: a fresh prefill's top two are {self.margin:.3g} apart (bound {self.bound:.3g}), "
                      "either is the target's answer within its numerics",
               "drift": f"drift: a fresh prefill of the same context gives the reference's token by {self.margin:.3g} "
                        f"(bound {self.bound:.3g}); the decoder's state departed from it",
               "reference": (f"the reference differs: a fresh prefill gives the decoder's token by {self.margin:.3g} "
                             f"(bound {self.bound:.3g}); "
                             + ("the reference is not this target's greedy decode in this dtype" if self.reference_from
                                == "file" else "the target-alone decode (one token a step, the same decoder) departed "
                                "from a fresh prefill there")),
               "neither": f"a fresh prefill gives neither ({self.fresh_top1}, by {self.margin:.3g}; bound "
                          f"{self.bound:.3g}): the reference is not this target's decode, and the decoder departed "
                          "from it too"}
        return (f"prompt {self.prompt_id}: output parts from the reference at new token {self.position} (output "
                f"{self.output_token}, reference {self.reference_token}; {self.decoder}): {why[self.verdict]}")

    def as_dict(self) -> dict:
        return asdict(self)


def first_difference(output: list[int], reference: list[int]) -> int | None:
    """The first index where two outputs differ (a shorter one differs where it ends), or None."""
    for i, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return i
    return None if len(output) == len(reference) else min(len(output), len(reference))


def divergence_lines(shown: list[Divergence] | None, verdicts: dict[str, int], differ: int) -> list[str]:
    """The report table's lines for a drafter's divergences (none when it has none): `differ`
    outputs differ, the first of them diagnosed in `shown`."""
    if not shown:
        return []
    counts = ", ".join(f"{n} {v}" for v, n in verdicts.items() if n)
    return [f"  outputs that differ: {differ}; the first {len(shown)} diagnosed: {counts}"] + [
        f"    new token {d.position} of prompt {d.prompt_id}: {d.verdict} (output {d.output_token}, reference "
        f"{d.reference_token}, fresh top-2 {d.fresh_top1}/{d.fresh_top2}, margin {d.margin:.3g}, bound "
        f"{d.bound:.3g})" for d in shown]
