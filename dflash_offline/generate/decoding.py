"""Batched KV-cache decoding of many prompts at once: the hot loop of `dflash-offline generate`.

One batch = up to R prompts, left-padded to the longest, decoded together for up to N new tokens:
an eager prefill of the padded prompts into a transformers StaticCache (preallocated, written in
place: no per-step concatenation of the cache), then one forward per new token, with grouped-query
attention that never copies the cache per query head (`targets/attention.py`'s `grouped_sdpa`: 3x the pycode target's decode
rate on an H200). On request (`compile=True`) the one-token step is compiled once with CUDA graphs
(`torch.compile(mode="reduce-overhead")`) over one cache kept for the whole run ([R, heads, L, d],
L = longest prompt + N), a short batch filled with copies of its first row whose outputs are
dropped; measured slower than the eager step at large batches (docs/benchmarks.md), so off by
default.

Why left padding is exact: attention masks the pad positions, position ids count only real tokens,
and Gated DeltaNet layers zero the pad positions' inputs (transformers' padding mask), so their
convolution and recurrent states stay exactly zero until the first real token, as without padding.
What remains is floating-point summation order: in fp32 the batched output equals a one-prompt
decode token for token (tested on CPU, dense and hybrid); in bf16 a near-tie of the top two logits
can flip, and the sequences part there (docs/generate.md measures how often).

Sampling is reproducible per prompt: the noise for prompt id i, new token t and vocabulary entry v
is a pure function of (seed, i, t, v) (a counter-based hash, not a generator's state), so a prompt
gets the same sample whatever batch, chunk, worker or resume it lands in.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from dflash_offline.sampling import Sampling, top_p_keep, uniform_noise
from dflash_offline.runtime.signals import check_stop
from dflash_offline.targets.attention import cache_argument, use_grouped_attention

log = logging.getLogger("dflash.decoding")


def choose_tokens(logits: torch.Tensor, sampling: Sampling, row_ids: torch.Tensor, step: int) -> torch.Tensor:
    """[rows, vocab] logits -> [rows] token ids: argmax, or a sample (Gumbel-max over the
    temperature-scaled, top-p-filtered distribution, with the counter-based noise)."""
    if sampling.greedy:
        return logits.argmax(-1)
    scores = logits.float() / sampling.temperature
    if sampling.top_p < 1.0:
        scores = scores.masked_fill(~top_p_keep(scores.softmax(-1), sampling.top_p), float("-inf"))
    u = uniform_noise(sampling.seed, row_ids, step, logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    return (scores.double() + gumbel).argmax(-1)


# ----------------------------------------------------------------------------------------------
# The batch decoder


@dataclass
class BatchResult:
    tokens: list[list[int]]  # new tokens of each real row (EOS included when it ended there)
    ended_by_eos: list[bool]
    steps: int  # forwards after the prefill
    prefill_s: float  # wall time of the prefill (synchronised once, after it)
    seconds: float  # wall time of the whole batch


class BatchDecoder:
    """Decodes batches of up to `rows` prompts of at most `max_prompt_len` tokens on one device.

    `compile`: compile the one-token step with CUDA graphs (CUDA only; needs every batch to have
    the same shape, hence the fixed cache and the filler rows).
    """

    def __init__(self, model, rows: int, max_prompt_len: int, max_new_tokens: int, eos: set[int],
                 sampling: Sampling, compile: bool = False):
        from transformers import StaticCache

        use_grouped_attention(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.rows = rows
        self.max_new = max_new_tokens
        self.length = max_prompt_len + max_new_tokens
        self.eos_ids = set(eos)
        self.eos = torch.tensor(sorted(eos) or [-1], device=self.device)
        self.sampling = sampling
        self.cache_arg = cache_argument(model)
        # The compiled step keeps one cache for the run; eager batches get one of their own size.
        self.cache = StaticCache(config=model.config, max_cache_len=self.length) if compile else None
        self.compiled = compile
        self._step = self._forward_step
        # Told of the tokens decoded, from the loop, while a batch runs (generate/progress.py's Tracker).
        self.progress = None
        if compile:
            # CUDA graphs on GPUs; elsewhere plain compilation (the same static shapes: a check of
            # the path on machines without a GPU).
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
            self._step = torch.compile(self._forward_step, mode=mode, dynamic=False)

    def _forward_step(self, tokens, positions, mask, cache):
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                         logits_to_keep=1, **{self.cache_arg: cache})
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], row_ids: list[int]) -> BatchResult:
        """New tokens for each prompt: stop after an EOS token or max_new_tokens."""
        t0 = time.perf_counter()
        n = len(prompts)
        if not 0 < n <= self.rows:
            raise ValueError(f"a batch holds 1..{self.rows} prompts, got {n}")
        # Filler rows (copies of row 0) keep the compiled step's shapes; eager runs need none.
        R = self.rows if self.compiled else n
        prompts = list(prompts) + [prompts[0]] * (R - n)
        ids_of = torch.tensor(list(row_ids) + [row_ids[0]] * (R - n), dtype=torch.int64)
        P = max(len(p) for p in prompts)
        L = self.length if self.compiled else P + self.max_new
        if P + self.max_new > self.length:
            raise ValueError(f"a prompt of {P} tokens does not fit the cache of {self.length} positions")
        ids = torch.zeros((R, P), dtype=torch.int64)
        mask = torch.zeros((R, L), dtype=torch.int64)
        for r, p in enumerate(prompts):
            ids[r, P - len(p):] = torch.tensor(p, dtype=torch.int64)
            mask[r, P - len(p):] = 1
        # Generated positions are all real; causality hides those not written yet. One fixed-size
        # mask for every decode step: no new shapes, no per-step host work.
        mask[:, P:] = 1
        positions = (mask[:, :P].cumsum(-1) - 1).clamp(min=0)
        dev = self.device
        ids, mask, positions, ids_of = (t.to(dev, non_blocking=True) for t in (ids, mask, positions, ids_of))

        cache = self._cache_for(R, L)
        # The prefill is eager: its length changes from batch to batch, and the recurrent layers'
        # padding mask must cover exactly the prompt positions.
        logits = self.model(input_ids=ids, position_ids=positions, attention_mask=mask[:, :P], use_cache=True,
                            logits_to_keep=1, **{self.cache_arg: cache}).logits[:, -1, :]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        prefill_s = time.perf_counter() - t0
        out = torch.empty((R, self.max_new), dtype=torch.int64, device=dev)
        done = torch.zeros(R, dtype=torch.bool, device=dev)
        pos = positions[:, -1:]
        steps = 0
        progress = self.progress
        if progress is not None:
            progress.batch_start(n * self.max_new)
        for t in range(self.max_new):
            tok = choose_tokens(logits, self.sampling, ids_of, t)
            out[:, t] = tok
            done |= torch.isin(tok, self.eos)
            if t + 1 == self.max_new:
                break
            # One sync every 16 tokens: enough to stop a batch that has ended early.
            if t % 16 == 15 and bool(done[:n].all()):
                break
            if progress is not None and progress.due():  # a host clock read per step; a sync when due
                self._report(out[:n, :t + 1], progress)
            check_stop()  # a stop lands within a step: the batch is abandoned (its prompts decoded anew on resume)
            pos = pos + 1
            if self.compiled and dev.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            logits = self._step(tok[:, None], pos, mask, cache)
            steps += 1
        produced = out[:n, : t + 1].cpu().tolist()
        tokens, ended = [], []
        for row in produced:
            k = next((i for i, x in enumerate(row) if x in self.eos_ids), None)
            tokens.append(row if k is None else row[: k + 1])
            ended.append(k is not None)
        if progress is not None:
            made = sum(len(x) for x in tokens)
            progress.batch_step(made, made)
        return BatchResult(tokens, ended, steps, prefill_s, time.perf_counter() - t0)

    def _report(self, out: torch.Tensor, progress) -> None:
        """The tokens the real rows have made so far (each up to its end-of-sequence token) and the
        batch's bound: those, plus --max-new-tokens' rest for each row still running."""
        hit = torch.isin(out, self.eos)
        ended = hit.any(-1)
        made = torch.where(ended, hit.int().argmax(-1) + 1, out.shape[1])
        total, running = (int(x) for x in torch.stack([made.sum(), (~ended).sum()]).tolist())
        progress.batch_step(total, total + running * (self.max_new - out.shape[1]))

    def _cache_for(self, R: int, L: int):
        """The compiled step keeps one cache (its tensors' addresses are baked into the CUDA graph);
        eager batches get a cache of their own size."""
        if self.compiled:
            self.cache.reset()  # zeroes in place: the graph's addresses stay valid
            return self.cache
        from transformers import StaticCache

        return StaticCache(config=self.model.config, max_cache_len=L)
