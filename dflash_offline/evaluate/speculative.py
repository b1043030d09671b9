"""Greedy speculative decoding against the target, one prompt at a time (`eval --prompts`).

Batch 1, per round (dflash-method.md, "Inference"): the drafter drafts one block from the last
committed token over its cached context features; the target verifies the block in one forward;
the agreeing prefix plus one target token is committed; both caches are cut back to the committed
length. A hybrid target's Gated DeltaNet state cannot be cut back, so it is restored from a
snapshot taken before the verify forward and advanced over the committed tokens by one more
forward (`TargetSession`). `greedy_decode`, the target alone, gives the output a speculative
decode must equal (lossless) and the speed it is measured against. The batched decoder
(evaluate.batched) and the cache walk (blocks.walk) mirror these rounds.

tau = new tokens committed by verify rounds / verify rounds (the reference's rule, `summarize`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dflash_offline.evaluate.report import Confidence, DecodeSummary
from dflash_offline.sampling import Sampling, draft_tokens, prompt_keys, target_tokens, verify_block
from dflash_offline.targets import families
from dflash_offline.targets.folder import read_target
from dflash_offline.targets.model import LayerCapture, load_target


# ----------------------------------------------------------------------------------------------
# The target, with a cache that can be cut back


class TargetSession:
    """One sequence (batch 1) through a transformers causal LM with its KV / recurrent cache.

    `forward` appends positions; `keep(n)` keeps only the first n of the positions the last
    forward appended. Attention layers are cropped; recurrent layers (Gated DeltaNet) are restored
    from the snapshot taken before that forward and run again over the kept tokens.
    """

    def __init__(self, model, target_layers: list[int]):
        import torch

        self.torch = torch
        self.model = model
        self.target_layers = list(target_layers)
        self.device = next(model.parameters()).device
        from dflash_offline.targets.attention import cache_argument

        self._cache_arg = cache_argument(model)
        # A layer that is not softmax attention (Gated DeltaNet's "linear_attention", say) keeps
        # a state that cannot be cropped (the registry's rule, targets/families.py).
        self.recurrent = families.recurrent(model.config)
        self.cache = None
        self._pending: list[int] = []
        self._snapshot = None
        self.forwards = 0

    def start(self, prompt: list[int], features: bool = True):
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self._pending, self._snapshot = [], None
        return self._forward(prompt, features)

    def forward(self, tokens: list[int], features: bool = True, rollback: bool = True):
        """-> (logits [T, V] float32, features [T, n*H] or None) for T new positions.
        rollback=False: no `keep` will follow (one-token greedy steps), so a hybrid target's
        recurrent states are not copied first."""
        with self.torch.inference_mode():
            self._snapshot = snapshot_states(self.cache) if self.recurrent and rollback else None
        self._pending = list(tokens)
        return self._forward(tokens, features)

    def keep(self, n: int) -> None:
        drop = len(self._pending) - n
        if drop < 0 or n < 1:
            raise ValueError(f"keep({n}) after a forward of {len(self._pending)} tokens")
        if drop == 0:
            return
        with self.torch.inference_mode():  # the cache holds inference tensors
            if not self.recurrent:
                self.cache.crop(-drop)
                return
            if self._snapshot is None:
                raise ValueError("keep() after a forward made with rollback=False")
            _restore(self.cache, self._snapshot)
        self._forward(self._pending[:n], features=False)

    def _forward(self, tokens: list[int], features: bool):
        torch = self.torch

        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        # The layers' raw outputs, as extraction stores them (not `hidden_states`, whose last entry
        # is after the final norm).
        with torch.inference_mode(), LayerCapture(self.model, self.target_layers if features else []) as raw:
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: self.cache})
        self.forwards += 1
        logits = out.logits[0].float()
        return logits, (raw.features()[0] if features else None)


STATE_ATTRS = families.ALL_STATE_ATTRS
# transformers >= 5.25 counts the tokens a linear-attention layer has seen in a tensor of its own,
# and a hybrid cache's length (hence the next positions) is read from it: it is state to restore.
COUNTER_ATTRS = ("cumulative_length_linear",)


def snapshot_states(cache) -> list[dict]:
    """Copies of every recurrent layer's states and the length of every attention layer."""
    import torch

    snap, found = [], False
    for layer in cache.layers:
        entry: dict = {}
        for attr in STATE_ATTRS:
            states = getattr(layer, attr, None)
            if isinstance(states, dict):
                entry[attr] = {k: (t.clone() if isinstance(t, torch.Tensor) else None) for k, t in states.items()}
                found = found or any(isinstance(t, torch.Tensor) for t in states.values())
        if isinstance(getattr(layer, "keys", None), torch.Tensor):
            entry["length"] = layer.keys.shape[-2]
        entry["counters"] = {a: t.clone() for a in COUNTER_ATTRS if isinstance(t := getattr(layer, a, None), torch.Tensor)}
        snap.append(entry)
    if not found:
        raise RuntimeError(f"{type(cache).__name__}: found no recurrent states to snapshot in a hybrid target's cache; "
                           "this transformers version stores them differently and rollback would be wrong")
    return snap


def _restore(cache, snap: list[dict]) -> None:
    import torch

    for layer, entry in zip(cache.layers, snap):
        for attr in STATE_ATTRS:
            for k, saved in entry.get(attr, {}).items():
                states = getattr(layer, attr)
                cur = states.get(k)
                if isinstance(cur, torch.Tensor) and isinstance(saved, torch.Tensor) and cur.shape == saved.shape:
                    cur.copy_(saved)  # in place: transformers may hold this tensor's address (CUDA graphs)
                else:
                    states[k] = saved
        if "length" in entry:
            drop = layer.keys.shape[-2] - entry["length"]
            if drop > 0:
                _crop_keys(layer, entry["length"])
        for a, saved in entry.get("counters", {}).items():
            getattr(layer, a).copy_(saved)


def _crop_keys(layer, length: int) -> None:
    """Keep a layer's first `length` key/value positions (and nothing else of it: a hybrid layer's
    own crop would also move its recurrent state, which the snapshot restores)."""
    layer.keys = layer.keys[..., :length, :]
    layer.values = layer.values[..., :length, :]


def load_target_for_decoding(target_dir: str, device: str, dtype: str):
    """The whole text model with its LM head, in eval mode; TF32 off so fp32 means fp32."""
    import torch

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    info = read_target(target_dir)
    model = load_target(info, device, dtype, info.num_target_layers, need_head=True)
    return model, info


# ----------------------------------------------------------------------------------------------
# Proposers: who drafts the block


class Proposer(Protocol):
    block_size: int

    def start(self, prompt: list[int], features) -> None:
        """A new sequence: the prompt and the target's features at its positions."""

    def draft_logits(self, tokens: list[int], n: int):
        """Logits [n, V] of the n (<= block_size - 1) draft tokens following `tokens` (committed
        so far; the last is the anchor), from a block of n + 1 tokens. (A proposer of tokens, an
        oracle, may give `propose(tokens) -> list[int]` instead: read as one-hot logits.)"""

    def observe(self, features) -> None:
        """Features of the newly committed positions (the anchor and the accepted drafts)."""


class DFlashProposer:
    """The trained drafter, with its context keys/values cached per committed position."""

    def __init__(self, drafter, device: str, dtype: str = "float32"):
        import torch

        self.torch = torch
        self.drafter = drafter.to(device=device, dtype=getattr(torch, dtype))
        self.device = device
        self.block_size = drafter.cfg.block_size
        self.mask_id = drafter.cfg.mask_token_id
        self.kv: list | None = None
        self.length = 0

    def start(self, prompt: list[int], features) -> None:
        self.kv, self.length = None, 0
        self.observe(features)

    def observe(self, features) -> None:
        torch = self.torch
        T = features.shape[0]
        pos = torch.arange(self.length, self.length + T, device=self.device)[None]
        new = self.drafter.context_kv(features[None].to(self.device), pos)
        self.kv = new if self.kv is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                               for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.length += T

    def draft_logits(self, tokens: list[int], n: int):
        torch = self.torch
        anchor = len(tokens) - 1
        if anchor != self.length:
            raise RuntimeError(f"drafter context holds {self.length} positions but the anchor is at {anchor}")
        # A block of n + 1 tokens: the last round of an output drafts only what it can still
        # commit, and the drafter (bidirectional within the block) sees that shorter block, as in
        # the reference implementation.
        block = torch.tensor([[tokens[-1]] + [self.mask_id] * n], device=self.device)
        pos = torch.arange(anchor, anchor + n + 1, device=self.device)[None]
        h = self.drafter.draft_hidden(self.kv, block, pos)
        return torch.nn.functional.linear(h[0, 1:], self.drafter.lm_head.weight.to(h.dtype)).float()


def as_logits(proposal, vocab: int):
    """A proposer's drafts as logits [..., K, V]: its logits, or its tokens (an oracle's) one-hot."""
    import torch

    if proposal.is_floating_point():
        return proposal
    logits = torch.full((*proposal.shape, vocab), float("-inf"), device=proposal.device)
    return logits.scatter_(-1, proposal[..., None], 0.0)


def proposed_logits(proposer, tokens: list[int], n: int, vocab: int):
    """proposer.draft_logits, or a token proposer's (an oracle's) first n tokens as one-hot logits."""
    import torch

    if hasattr(proposer, "draft_logits"):
        return proposer.draft_logits(tokens, n)
    return as_logits(torch.tensor(proposer.propose(tokens)[:n], dtype=torch.long), vocab)


# ----------------------------------------------------------------------------------------------
# Decoding


@dataclass
class Decoded:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted in each verify round
    seconds: float = 0.0
    target_forwards: int = 0
    # New tokens each verify round committed: accepted + 1, the last round's cut at
    # --max-new-tokens and after an end-of-sequence token (the reference's acceptance lengths).
    committed: list[int] = field(default_factory=list)
    # A DSpark drafter's confidence head, per draft slot over the prompt's rounds: [sum of its
    # predicted survival, rounds that verified the slot, rounds that accepted it] (None otherwise).
    confidence: list[list[float]] | None = None


def output_done(out: list[int], max_new: int, eos: set[int]) -> bool:
    """Whether a decode stops here: max_new tokens out, or the last one ends the sequence."""
    return len(out) >= max_new or (bool(out) and out[-1] in eos)


def in_length_batches(prompts: list[list[int]], batch_size: int, decode_batch, on_batch=None) -> list[Decoded]:
    """decode_batch(indices of one batch) -> their Decoded, over batches of `batch_size` prompts
    grouped by length (less padding); results in input order, each batch reported to on_batch."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[Decoded | None] = [None] * len(prompts)
    for k in range(0, len(order), batch_size):
        part = order[k:k + batch_size]
        for i, d in zip(part, decode_batch(part)):
            results[i] = d
        if on_batch is not None:
            on_batch([results[i] for i in part])
    return results  # type: ignore[return-value]


def commit_round(out: list[int], draft: list[int], a: int, nxt: int, max_new: int, eos: set[int]) -> list[int]:
    """The tokens a verify round commits (the a accepted drafts, then the target's next token),
    appended to `out` and cut where the output ends."""
    new = []
    for tok in draft[:a] + [nxt]:
        new.append(tok)
        out.append(tok)
        if output_done(out, max_new, eos):
            break
    return new


class Chooser:
    """The sampling rule (dflash_offline.sampling) for one prompt: its key, tensors of one row."""

    def __init__(self, sampling: Sampling, key: int, device):
        import torch

        self.torch, self.sampling = torch, sampling
        self.seeded = prompt_keys(sampling.seed, torch.tensor([key], device=device))

    def _at(self, index: int):
        return self.torch.tensor([index], device=self.seeded.device)

    def token(self, logits, index: int) -> int:
        """The target's token at output `index` from its logits [V]."""
        return int(target_tokens(logits[None], self.sampling, self.seeded, self._at(index))[0])

    def draft(self, draft_logits, index: int):
        """Draft tokens [n] from the drafter's logits [n, V] (drafts at output index..) and the
        drafter's distribution (None when greedy)."""
        drafts, q = draft_tokens(draft_logits[None], self.sampling, self.seeded, self._at(index))
        return drafts[0], (None if q is None else q[0])

    def verify(self, draft, q, target_logits, index: int) -> tuple[int, int]:
        """(accepted drafts, the next token) for draft [n], target logits [n + 1, V]."""
        limit = self.torch.tensor([draft.shape[0]], device=draft.device)
        a, nxt = verify_block(draft[None], None if q is None else q[None], target_logits[None], limit, self.sampling,
                              self.seeded, self._at(index))
        return int(a[0]), int(nxt[0])


def greedy_decode(target: TargetSession, prompt: list[int], max_new: int, eos: set[int],
                  sampling: Sampling = Sampling(), key: int = 0) -> Decoded:
    """The target alone, one token per forward: the reference output and the baseline speed
    (greedy, or sampled with the same keyed noise as the speculative decoders)."""
    t0 = time.perf_counter()
    target.forwards = 0
    choose = Chooser(sampling, key, target.device)
    logits, _ = target.start(prompt, features=False)
    out = [choose.token(logits[-1], 0)]
    while not output_done(out, max_new, eos):
        logits, _ = target.forward([out[-1]], features=False, rollback=False)
        out.append(choose.token(logits[-1], len(out)))
    # Each one-token forward is a round that accepts nothing and commits one token, as the
    # batched and static target-alone decoders count it.
    n = len(out) - 1
    return Decoded(out, [0] * n, time.perf_counter() - t0, target.forwards, [1] * n)


def speculative_decode(target: TargetSession, proposer: Proposer, prompt: list[int], max_new: int, eos: set[int],
                       sampling: Sampling = Sampling(), key: int = 0) -> Decoded:
    """Speculative decoding of one prompt (module docstring): greedy, equal to greedy_decode's
    output; sampled, distributed as the target's own sampling."""
    t0 = time.perf_counter()
    target.forwards = 0
    choose = Chooser(sampling, key, target.device)
    logits, feats = target.start(prompt)
    proposer.start(prompt, feats)
    seq = list(prompt) + [choose.token(logits[-1], 0)]
    out = seq[len(prompt):]
    accepted, committed = [], []
    while not output_done(out, max_new, eos):
        # The reference's last round: only the drafts that can still be committed.
        n = min(proposer.block_size - 1, max_new - len(out))
        draft, q = choose.draft(proposed_logits(proposer, seq, n, logits.shape[-1]).to(logits.device), len(out))
        logits, feats = target.forward([seq[-1]] + draft.tolist())
        a, nxt = choose.verify(draft, q, logits, len(out))
        accepted.append(a)
        target.keep(a + 1)
        proposer.observe(feats[: a + 1])
        new = commit_round(out, draft.tolist(), a, nxt, max_new, eos)
        committed.append(len(new))
        seq += new
    return Decoded(out, accepted, time.perf_counter() - t0, target.forwards, committed)


def tokens_per_s(runs: list[Decoded]) -> float:
    """New tokens over decode seconds, summed over the runs."""
    return sum(len(r.tokens) for r in runs) / max(sum(r.seconds for r in runs), 1e-9)


def summarize(runs: list[Decoded], block_size: int) -> DecodeSummary:
    """tau by the reference's rule: new tokens committed by verify rounds / verify rounds (nothing
    past --max-new-tokens or after an end-of-sequence token counts; the prefill's first token is
    no round's), pooled over every round of every prompt, and the mean of each prompt's own tau."""
    acc = np.asarray([a for r in runs for a in r.accepted], np.int64)
    rounds = int(acc.shape[0])
    committed = sum(sum(r.committed) for r in runs)
    # Prompts decoded without a round (a first token that ends the output) have no tau.
    per_prompt = [sum(r.committed) / len(r.committed) for r in runs if r.committed]
    return DecodeSummary(
        rounds=rounds, tokens=sum(len(r.tokens) for r in runs), committed=committed,
        seconds=sum(r.seconds for r in runs), tokens_per_s=tokens_per_s(runs),
        tau=committed / rounds if rounds else float("nan"),
        tau_per_prompt_mean=float(np.mean(per_prompt)) if per_prompt else float("nan"), tau_per_prompt=per_prompt,
        # Share of rounds in which draft slot j (1..B-1) was accepted (block_size: drafts a round + 1).
        accept_rate=[float((acc >= j).mean()) if rounds else 0.0 for j in range(1, block_size)],
        target_forwards=sum(r.target_forwards for r in runs), confidence=_confidence(runs))


def _confidence(runs: list[Decoded]) -> Confidence | None:
    """A DSpark confidence head's calibration per draft slot: its mean predicted survival against
    the observed share of verified slots accepted (both given that the slots before it were)."""
    sums = [np.asarray(r.confidence, np.float64) for r in runs if r.confidence is not None]
    if not sums:
        return None
    pred, reached, survived = np.sum(sums, axis=0)
    at = np.maximum(reached, 1)
    return Confidence(predicted=(pred / at).tolist(), observed=(survived / at).tolist(),
                      verified=reached.astype(int).tolist())
