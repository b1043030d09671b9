"""Where `eval`'s lossless check fails, why: a near-tie flip, or a decoder whose state drifted.

Lossless decoding is numerically fragile on every engine (hybrid targets most: a bf16 recurrent
state, a verify forward of G tokens against the one-token steps of plain decoding), and a user
cannot tell a flip at a near tie, which either answer honours, from real drift. For each output
that differs from the reference (greedy decoding only):

  position   the first output index where the two differ; the context before it (prompt and the
             reference's first tokens) is the same in both;
  fresh      a fresh prefill of that context through the target's plain forward (no cache, the
             eval dtype): its top-1 and top-2 tokens and their logit margin;
  verdict    tie        the margin is within the dtype's rounding of the logits (TIE_STEPS steps
                        of the dtype at the top logit's size): a near tie; either token is the
                        target's answer within its numerics;
             drift      the fresh prefill gives the reference's token beyond that bound, while the
                        decoder committed another: its state (key/value buffers, recurrent state)
                        departed from what a fresh prefill computes;
             reference  the fresh prefill gives the decoder's token beyond the bound: the
                        reference is not this target's greedy decode in this dtype;
             neither    it gives a third token: the reference is not this target's decode, and
                        the decoder departed from it too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

# Relative rounding step of each dtype (the spacing of its numbers near 1), and how many of them
# at the top logit's size still count as a tie.
STEP = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
TIE_STEPS = 16
VERDICTS = ("tie", "drift", "reference", "neither")


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

    def line(self) -> str:
        why = {"tie": f"a near tie: a fresh prefill's top two are {self.margin:.3g} apart (bound {self.bound:.3g}), "
                      "either is the target's answer within its numerics",
               "drift": f"drift: a fresh prefill of the same context gives the reference's token by {self.margin:.3g} "
                        f"(bound {self.bound:.3g}); the decoder's state departed from it",
               "reference": f"the reference differs: a fresh prefill gives the decoder's token by {self.margin:.3g} "
                            f"(bound {self.bound:.3g}); the reference is not this target's greedy decode in this dtype",
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


def diagnose(model, prompt: list[int], output: list[int], reference: list[int], prompt_id: int, dtype: str,
             decoder: str) -> Divergence | None:
    """The Divergence of one output from its reference (None when they are equal)."""
    p = first_difference(output, reference)
    if p is None:
        return None
    out_tok = output[p] if p < len(output) else -1  # -1: the output ended there
    ref_tok = reference[p] if p < len(reference) else -1
    device = next(model.parameters()).device
    context = torch.tensor([prompt + reference[:p]], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=context, use_cache=False).logits[0, -1].float()
    top = torch.topk(logits, 2)
    (v1, v2), (t1, t2) = top.values.tolist(), top.indices.tolist()
    margin = v1 - v2
    bound = TIE_STEPS * STEP[dtype] * max(1.0, abs(v1))
    if not math.isfinite(margin) or margin <= bound:
        verdict = "tie"
    else:
        verdict = "drift" if t1 == ref_tok else "reference" if t1 == out_tok else "neither"
    return Divergence(prompt_id, p, out_tok, ref_tok, t1, t2, margin, bound, verdict, decoder)
