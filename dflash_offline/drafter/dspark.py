"""DSpark's two heads over the DFlash backbone (DeepSeek + PKU, arXiv 2607.05147; deepseek-ai/DeepSpec).

DSpark keeps the DFlash drafter and changes three things:
- **The block's slots.** The block is still [anchor, MASK x (B - 1)] at positions anchor + 0..B-1,
  but slot j predicts the token at anchor + 1 + j (the anchor's slot predicts the next token), so a
  block of B slots drafts B tokens where DFlash's drafts B - 1 (slot j of DFlash predicts anchor + j,
  slot 0 unscored). Training rows take the offset from `packing.build_row(label_offset=1)`.
- **A Markov head**, the only left-to-right part: slot k's logits get a low-rank bias from the token
  before it, `W2 W1[x_{k-1}]` (x_{-1} is the anchor; W1 an embedding [V, r], W2 a linear r -> V).
  `gated` multiplies W1[x] by a sigmoid gate of [h_k; W1[x]] first. The backbone runs once per block;
  drafting then walks the slots, each token chosen from the biased logits (argmax, or sampled) and
  fed to the next slot's bias. In training x_{k-1} is the data token (teacher forcing).
- **A confidence head**: a linear map of [h_k; W1[x_{k-1}]] to the logit of the probability that slot
  k survives verification given that the slots before it did, trained against 1 - TV(p_draft, p_target)
  (blocks/dspark_loss.py); engines use it to cut a block short.

Tensor names follow DeepSpec's checkpoints (`markov_head.markov_w1.weight` [V, r],
`markov_head.markov_w2.weight` [V, r], `markov_head.gate_proj.*` [r, H + r], `confidence_head.proj.*`
[1, H + r]), which vLLM's and SGLang's DSpark loaders read (vanilla head only: they have no place for
the gate).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflash_offline.drafter.config import MARKOV_HEADS
from dflash_offline.sampling import DRAFT, draw, keyed_uniform, sampling_probs


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, kind: str = "vanilla"):
        super().__init__()
        if kind not in MARKOV_HEADS:
            raise ValueError(f"markov head {kind!r}: choose one of {', '.join(MARKOV_HEADS)}")
        if rank < 1:
            raise ValueError(f"markov rank {rank}: at least 1")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def reset_parameters(self, std: float) -> None:
        """As DeepSpec's (transformers' default init): normal(0, std) weights, zero biases."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def code(self, h: Tensor, prev: Tensor) -> tuple[Tensor, Tensor]:
        """(W1[prev], the rank-r code the bias is made from) for hidden states h [..., H] and the
        previous tokens prev [...]: the first feeds the confidence head, the second W2."""
        e = self.markov_w1(prev)
        if self.kind == "gated":
            return e, torch.sigmoid(self.gate_proj(torch.cat([h.to(e.dtype), e], dim=-1))) * e
        return e, e

    def bias(self, code: Tensor) -> Tensor:
        """The logit bias [..., V] of a code [..., r] (float32: it is added to float32 logits)."""
        return self.markov_w2(code).float()


class ConfidenceHead(nn.Module):
    """logit of P(slot k survives | the slots before it did) from [h_k; W1[x_{k-1}]]."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.proj.weight, 0.0, std)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: Tensor, e: Tensor) -> Tensor:
        return self.proj(torch.cat([h.to(e.dtype), e], dim=-1)).float().squeeze(-1)


def draft_chain(h: Tensor, head_weight: Tensor, markov: MarkovHead | None, s, seeded: Tensor, at: Tensor, anchor: Tensor,
                confidence: "ConfidenceHead | None" = None):
    """A DSpark block's drafts, left to right: slot k's logits are the backbone's plus the Markov
    bias of the token drafted before it (the anchor for slot 0), and its token is chosen from them
    as DFlash's drafts are (argmax; or a keyed draw at output index at + k, sampling.draft_tokens'
    rule), so the draw of slot k is conditioned on the drafts before it. h [R, K, H] (slot k
    predicts the token at output index at + k), anchor [R]. -> (drafts [R, K], q [R, K, V] the
    distributions they were drawn from, None when greedy: the q of the rejection rule[, the
    confidence head's survival probabilities [R, K] when `confidence` is given])."""
    import torch.nn.functional as F

    base = F.linear(h, head_weight.to(h.dtype)).float()
    prev, drafts, qs, conf = anchor, [], [], []
    for k in range(h.shape[1]):
        z = base[:, k]
        if markov is not None:  # markov_rank 0: DSpark's slots without the bias
            e, code = markov.code(h[:, k], prev)
            z = z + markov.bias(code)
        if confidence is not None:
            conf.append(torch.sigmoid(confidence(h[:, k], e)))
        if s.greedy:
            prev = z.argmax(-1)
        else:
            q = sampling_probs(z[:, None], s)
            prev = draw(q, keyed_uniform(seeded, (at + k)[:, None], DRAFT))[:, 0]
            qs.append(q[:, 0])
        drafts.append(prev)
    out = torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)
    return out if confidence is None else (*out, torch.stack(conf, 1))


def previous_tokens(block_ids: Tensor, labels: Tensor, block_size: int) -> Tensor:
    """x_{k-1} for every slot of DSpark training blocks [..., N*B]: the anchor for slot 0, the data
    token slot k-1 predicts for slot k (teacher forcing). `labels` from build_row(label_offset=1)."""
    B = block_size
    shape = labels.shape
    lab = labels.reshape(*shape[:-1], -1, B)
    anchor = block_ids.reshape(*shape[:-1], -1, B)[..., :1]
    return torch.cat([anchor, lab[..., :-1]], dim=-1).reshape(shape)
