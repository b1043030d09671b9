"""Continuous batching: `generate`'s decoder, where a row that ends takes the next prompt at once.

A padded batch decodes for as long as its longest row: chat replies run from a few tokens to
thousands, so most rows of a batch idle most of the time. Here the batch is R slots over the
static decoder's target (targets/static.py, StaticTarget: key/value buffers per slot and position,
and per-slot recurrent state for Gated DeltaNet layers), and each step decodes one token for
every slot at its own position. Every few steps (`check_every`) the host reads which slots are
done, hands their tokens back and fills them with the next prompts.

A new prompt is prefilled apart, in a small staging target (right-padded to the longest prompt
admitted with it; the recurrent state passes the padding unchanged), and its rows are copied into
the free slots: the key/value entries of its prompt positions and its recurrent state. What a
slot's previous prompt left further along stays behind; a query at position p sees only positions
<= p, each written by this prompt before it is read. The step's shapes never change, so on a GPU it
is one CUDA graph, replayed.

The token a slot chooses at its t-th new token is a pure function of (seed, prompt key, t)
(decoding.choose_tokens), so what a prompt decodes does not depend on its slot, batch or worker
beyond floating-point rounding: in fp32 the tokens equal each prompt decoded alone (tests); in
bf16 a near-tie of the top two logits can fall the other way under another batch shape, as
between two padded batch sizes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import torch

from dflash_offline.targets.static import StaticTarget, unsupported_reason
from dflash_offline.generate.decoding import choose_tokens
from dflash_offline.runtime.signals import StopNow, check_stop
from dflash_offline.sampling import Sampling

log = logging.getLogger("dflash.decoding")


class Request(NamedTuple):
    key: int  # the prompt's sampling key (its id; a conversation's turn key)
    prompt: list[int]
    tag: object = None  # the caller's handle, given back with the result


class Finished(NamedTuple):
    request: Request
    tokens: list[int]  # new tokens, the end-of-sequence token included when it ended there
    ended_by_eos: bool


class Part(NamedTuple):
    """One of generate's parts, as decode_parts takes it."""

    handle: object  # the caller's (a part's index)
    name: str  # for the log
    prompts: list[list[int]]
    keys: list[int]  # each prompt's sampling key


@dataclass
class _Decoding:
    """A part whose prompts are in the slots: what has come back so far."""

    part: Part
    new: list  # each prompt's new tokens, None until it ends
    eos_end: list[bool]
    left: int  # prompts not yet ended
    t0: float


class ContinuousDecoder:
    """Decodes requests in `rows` slots; `run` takes a queue of requests and calls `on_finish` for each as
    it ends (which may queue more: the next turn of a conversation)."""

    def __init__(self, model, rows: int, max_prompt_len: int, max_new_tokens: int, eos: set[int],
                 sampling: Sampling, graphs: bool | None = None, check_every: int = 4, stage_rows: int = 32,
                 fused_step: bool = True):
        dev = next(model.parameters()).device  # (StaticTarget refuses a target it cannot run)
        self.device, self.rows, self.max_new, self.sampling = dev, rows, max_new_tokens, sampling
        self.max_prompt_len = max_prompt_len
        self.check_every = max(1, check_every)
        self.graphs = (dev.type == "cuda") if graphs is None else graphs
        self._graph = None
        self.progress = None  # generate/progress.py's Tracker, told of tokens as they are decoded
        self.eos_ids = set(eos)
        with torch.inference_mode():
            # fused_step: the step in about a dozen kernels a layer (targets/fused_step.py), compiled on a GPU:
            # 1.3-1.5x the plain step at the Qwen3.5-27B shape on one H200 (docs/benchmarks.md).
            self.target = StaticTarget(model, [], rows, max_prompt_len + max_new_tokens, fused_step=fused_step)
            self.stage = StaticTarget(model, [], min(stage_rows, rows), max_prompt_len)
            z = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
            self.tok, self.pos, self.n_out, self.keys = z(rows), z(rows), z(rows), z(rows)
            self.done = torch.ones(rows, dtype=torch.bool, device=dev)  # a free slot counts as done
            self.out = z(rows, max_new_tokens + 1)  # the last column takes the writes of done slots
            self.eos = torch.tensor(sorted(eos) or [-1], device=dev)

    # -- device work ------------------------------------------------------------------------------

    def _step(self) -> None:
        """One new token for every slot not done (what the CUDA graph captures)."""
        active = ~self.done
        hidden, _ = self.target.forward(self.tok[:, None], self.pos[:, None], features=False, keep=active.long())
        nxt = choose_tokens(self.target.logits(hidden)[:, 0], self.sampling, self.keys, self.n_out)
        at = torch.where(active, self.n_out, self.max_new)
        self.out.scatter_(1, at[:, None], nxt[:, None])
        self.n_out += active.long()
        self.pos += active.long()
        self.tok.copy_(torch.where(active, nxt, self.tok))
        self.done |= active & (torch.isin(nxt, self.eos) | (self.n_out >= self.max_new))

    def _run_step(self) -> None:
        if self._graph is not None:
            self._graph.replay()
        else:
            self._step()

    def _capture(self) -> None:
        """Records the step as a CUDA graph after warm-up runs on a side stream (all slots free:
        the buffers' contents do not matter, only their addresses)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        saved = self.done.clone()
        with torch.cuda.stream(side):
            try:
                self._warm_up()
            except Exception as e:  # noqa: BLE001 - the compiler's errors have no common type
                if self.target.pieces is None or not self.target.pieces_compiled:
                    raise
                # (the first steps compile the step's pieces: a compiler that fails on this
                # stack must not stop a run the uncompiled pieces can make, but it is said)
                log.warning("compiling the step's pieces failed (%s: %s); running them uncompiled, which is "
                            "slower: report this with your torch and triton versions", type(e).__name__,
                            str(e).splitlines()[0][:300] if str(e) else "")
                self.target.use_pieces(compiled=False)
                self._warm_up()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self.done.copy_(saved)
        self._graph = graph

    def _warm_up(self) -> None:
        for _ in range(3):
            self.done.zero_()
            self.n_out.zero_()
            self._step()

    def _admit(self, slots: list[int], requests: list[Request]) -> None:
        """Prefills `requests` in the staging target and moves them into `slots` with their first token."""
        m, P = len(requests), max(len(j.prompt) for j in requests)
        ids = torch.zeros((m, P), dtype=torch.long)
        for r, j in enumerate(requests):
            if not 0 < len(j.prompt) <= self.max_prompt_len:
                raise ValueError(f"a prompt of {len(j.prompt)} tokens; this decoder holds 1..{self.max_prompt_len}")
            ids[r, :len(j.prompt)] = torch.tensor(j.prompt)
        dev = self.device
        lens = torch.tensor([len(j.prompt) for j in requests], device=dev)
        keys = torch.tensor([j.key for j in requests], device=dev)
        at = torch.tensor(slots, device=dev)
        self.stage.reset()
        hidden, _ = self.stage.forward(ids.to(dev), torch.arange(P, device=dev)[None].expand(m, P), features=False,
                                       keep=lens, span=P)
        last = hidden[torch.arange(m, device=dev), lens - 1]
        first = choose_tokens(self.stage.logits(last), self.sampling, keys, 0)
        self.target.copy_rows(self.stage, m, at, P)
        self.tok[at] = first
        self.pos[at] = lens
        self.keys[at] = keys
        self.n_out[at] = 1
        self.out[at] = 0
        self.out[at, 0] = first
        self.done[at] = torch.isin(first, self.eos) | (self.max_new <= 1)

    # -- host side --------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, requests: deque, on_finish: Callable[[Finished], list[Request] | None],
            refill: Callable[[], list[Request]] | None = None) -> int:
        """Decodes every request of the queue, those on_finish adds, and those refill() gives whenever the
        queue is empty and a slot is free (until it gives none); -> steps run. Jobs added later are
        in the caller's progress bound already (the bar counts all the work from its start)."""
        if self.graphs and self._graph is None:
            self._capture()
        R, request_of = self.rows, [None] * self.rows
        free, steps, finished_tokens = list(range(R)), 0, 0
        bound = len(requests) * self.max_new
        if self.progress is not None:
            self.progress.batch_start(bound)
        while True:
            while free:
                if not requests and refill is not None:
                    requests.extend(refill())
                if not requests:
                    break
                take = min(len(free), len(requests), self.stage.rows)
                group = [requests.popleft() for _ in range(take)]
                slots = [free.pop(0) for _ in range(take)]
                self._admit(slots, group)
                for s, j in zip(slots, group):
                    request_of[s] = j
            if len(free) == R:  # no slot holds a request, and none is left to admit
                break
            if not bool(self.done.all()):
                for _ in range(self.check_every):
                    self._run_step()
                steps += self.check_every
            check_stop()  # a stop lands within check_every steps: the prompts in the slots are abandoned
            done, n_out = self.done.tolist(), self.n_out.tolist()  # the read-back
            ended = [s for s in range(R) if request_of[s] is not None and done[s]]
            rows = self.out[ended].tolist() if ended else []
            for s, row in zip(ended, rows):
                toks = row[:n_out[s]]
                hit = next((i for i, t in enumerate(toks) if t in self.eos_ids), None)
                toks = toks if hit is None else toks[:hit + 1]
                finished_tokens += len(toks)
                bound -= self.max_new - len(toks)
                more = on_finish(Finished(request_of[s], toks, hit is not None)) or []
                requests.extend(more)  # (their tokens are in the caller's bound already: a conversation's turns)
                request_of[s] = None
                free.append(s)
            free.sort()
            if self.progress is not None:
                running = sum(n_out[s] for s in range(R) if request_of[s] is not None)
                self.progress.batch_step(finished_tokens + running, bound)
        return steps

    def decode_parts(self, parts: Iterator[Part], on_prompt: Callable[[object], None],
                     on_part: Callable[[Part, list[list[int]], list[bool]], None],
                     on_stop: Callable[[Part, list, list[bool]], None] | None = None) -> int:
        """generate's parts as one stream, each part's prompts longest first: once every prompt of a
        part holds a slot, the next part's prompts take slots as they free up, so the slots do not
        drain at each part's end. Calls on_prompt(part.handle) as a prompt ends and on_part(part,
        new tokens, ended by eos) as a part's last prompt ends (parts may end out of order). Parts
        are drawn from the iterator only when their prompts are wanted: stopping the iterator stops
        the work after the parts begun. A stop within a step (StopNow) calls on_stop(part, new tokens or
        None per prompt, ended by eos) for each part begun and not ended, then goes on up. -> steps run."""
        running: dict[int, _Decoding] = {}

        def refill() -> list[Request]:
            for part in parts:
                if not part.prompts:
                    on_part(part, [], [])
                    continue
                running[id(part)] = _Decoding(part, [None] * len(part.prompts), [False] * len(part.prompts),
                                              len(part.prompts), time.perf_counter())
                return longest_first(part.prompts, part.keys, lambda i: (id(part), i))
            return []

        def finished(f: Finished) -> None:
            d = running[f.request.tag[0]]
            d.new[f.request.tag[1]], d.eos_end[f.request.tag[1]] = f.tokens, f.ended_by_eos
            d.left -= 1
            on_prompt(d.part.handle)
            if d.left == 0:
                del running[id(d.part)]
                log.info("%s: %d prompts, %d new tokens in %.2fs from its first prompt's start", d.part.name,
                         len(d.new), sum(map(len, d.new)), time.perf_counter() - d.t0)
                on_part(d.part, d.new, d.eos_end)

        t0 = time.perf_counter()
        try:
            steps = self.run(deque(), finished, refill)
        except StopNow:
            if on_stop is not None:
                for d in list(running.values()):
                    on_stop(d.part, d.new, d.eos_end)
            raise
        log.info("%d steps of %d slots in %.2fs", steps, self.rows, time.perf_counter() - t0)
        return steps

    def decode_all(self, prompts: list[list[int]], keys: list[int]) -> list[Finished]:
        """Every prompt, longest first into the slots; results in input order."""
        results: list[Finished | None] = [None] * len(prompts)

        def keep(f: Finished) -> None:
            results[f.request.tag] = f

        self.run(deque(longest_first(prompts, keys, lambda i: i)), keep)
        return results  # type: ignore[return-value]


def longest_first(prompts: list[list[int]], keys: list[int], tag: Callable[[int], object]) -> list[Request]:
    """The prompts as requests, longest first (the slots' staging prefill pads to the longest of a group,
    so prompts of like length are prefilled together); tag(i): prompt i's handle."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    return [Request(keys[i], prompts[i], tag(i)) for i in order]


def continuous_decoder(model, rows: int, max_prompt_len: int, max_new_tokens: int, eos: set[int],
                       sampling: Sampling, chat: bool, max_positions: int | None = None,
                       batch_tokens: int | None = None, fused_step: bool = True) -> ContinuousDecoder | None:
    """generate's continuous decoder for this target, or None (padded batches) with the reason logged.

    Conversations: a slot holds prompts of up to the longest recorded conversation plus one reply
    (within the target's context), and as many slots as --batch-tokens holds at that size; a later
    turn whose prompt outgrows it goes on in padded rounds (turns.py)."""
    why = unsupported_reason(model)
    if why is not None:
        log.warning("--batching continuous cannot run this target (%s): decoding in padded batches", why)
        return None
    if chat:
        # Half of --batch-tokens: the padded rounds of turns that outgrow the slots get the other half.
        limit = (max_positions or 1 << 30) - max_new_tokens
        max_prompt_len = max(1, min(limit, max_prompt_len + max_new_tokens))
        rows = max(1, min(rows, (batch_tokens or 0) // 2 // (max_prompt_len + max_new_tokens)))
    # Prompts are prefilled in groups of up to an eighth of the slots (at least 32).
    dec = ContinuousDecoder(model, rows, max_prompt_len, max_new_tokens, eos, sampling,
                            stage_rows=max(32, rows // 8), fused_step=fused_step)
    log.info("continuous batching: %d slots of %d prompt + %d new tokens, %s step", rows, max_prompt_len,
             max_new_tokens, "fused" if dec.target.pieces is not None else "plain")
    return dec
