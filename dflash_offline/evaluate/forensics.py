"""Where `eval`'s lossless check fails, why: a near-tie flip, or a decoder whose state drifted.

Lossless decoding is numerically fragile on every engine (hybrid targets most: a bf16 recurrent
state, a verify forward of G tokens against the one-token steps of plain decoding), and a user
cannot tell a flip at a near tie, which either answer honours, from real drift. For each output
that differs from the reference (greedy decoding only):

  position   the first output index where the two differ; the context before it (prompt and the
             reference's first tokens) is the same in both;
  fresh      a fresh prefill of that context through the target's plain forward (no cache, the
             eval dtype): its top-1 and top-2 tokens and their logit margin;
  verdict    a near tie, drift of the decoder's state, a reference that is not this target's
             decode, or neither (evaluate/verdicts.py says how each is told).
"""

from __future__ import annotations

import torch

from dflash_offline.evaluate.verdicts import Divergence, first_difference, tie_bound, verdict_of

FORENSICS_PROMPTS = 20  # differing outputs diagnosed (a fresh prefill each), in prompt order


def diagnose(model, prompt: list[int], output: list[int], reference: list[int], prompt_id: int, dtype: str,
             decoder: str, reference_from: str = "file") -> Divergence | None:
    """The Divergence of one output from its reference (None when they are equal)."""
    p = first_difference(output, reference)
    if p is None:
        return None
    out_tok = output[p] if p < len(output) else -1  # -1: the output ended there
    ref_tok = reference[p] if p < len(reference) else -1
    device = next(model.parameters()).device
    context = torch.tensor([prompt + reference[:p]], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=context, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2)
    (v1, v2), (t1, t2) = top.values.tolist(), top.indices.tolist()
    margin, bound = v1 - v2, tie_bound(dtype, v1)
    return Divergence(prompt_id, p, out_tok, ref_tok, t1, t2, margin, bound, verdict_of(margin, bound, t1, ref_tok, out_tok),
                      decoder, reference_from)


def diagnose_all(model, prompts, ids, outputs, reference, dtype: str, decoder: str,
                 reference_from: str = "file") -> list[Divergence]:
    """The Divergence of each output that differs from its reference, the first FORENSICS_PROMPTS."""
    found = []
    for k, (out, ref) in enumerate(zip(outputs, reference)):
        if out != ref and len(found) < FORENSICS_PROMPTS:
            found.append(diagnose(model, prompts[k], out, ref, ids[k], dtype, decoder, reference_from))
    return found
