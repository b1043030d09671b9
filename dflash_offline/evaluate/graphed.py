"""The static decoder: speculative decoding, or the target alone, in rounds of fixed shapes.

A batch of R rows (R = 1: one prompt at a time) keeps everything on the device in tensors of fixed
shape, updated in place: each row's anchor token, its position, how many tokens it has output, its
outputs, and per round the drafts it accepted and the tokens it committed. A round is

  draft    the drafter's block [anchor, MASK x (B-1)] over its context (evaluate.drafter_buffers), cut to
           the tokens the row can still commit (the reference's last-round rule);
  verify   one target forward of the block at the row's positions;
  accept   greedy: the drafts equal to the target's argmax, in order; sampling: speculative
           sampling's rule (dflash_offline.sampling), so the output is distributed as the
           target's own sampling;
  commit   the accepted drafts and the target's next token are written to the output, cut at
           --max-new-tokens and after an end-of-sequence token; finished rows stop changing.

No step of a round reads anything back to the host, so on a GPU the whole round is captured once
as a CUDA graph and replayed (a round of a small target is a few hundred tiny kernels: launched one
by one from Python, the device idles most of the time). The host reads one number per round: how many
rows are unfinished. The target alone (`drafter=None`) is the same machine with a one-token
round, the baseline speed-ups are measured against.
"""

from __future__ import annotations

import logging
import time

import torch

from dflash_offline.evaluate.speculative import Decoded, in_length_batches
from dflash_offline.evaluate.drafter_buffers import DrafterBuffers
from dflash_offline.runtime.faults import corrupt_recurrent_state
from dflash_offline.targets.static import StaticTarget
from dflash_offline.sampling import Sampling, draft_tokens, prompt_keys, target_tokens, verify_block

log = logging.getLogger("dflash.eval")


def row_buckets(rows: int, step: int | None = None) -> list[int]:
    """The row counts a batch's rounds run over, largest first. Halving (the default): a graph per
    halving, a round over at most twice the unfinished rows. With `step`: every multiple of it down
    to `step`, then halving: a round over at most `step - 1` idle rows while many are unfinished,
    where a round's cost grows with its rows (docs/benchmarks.md models both on measured costs)."""
    if step is not None and step < 1:
        raise ValueError(f"bucket step {step}: give a positive number of rows")
    out = [rows]
    if step is not None:
        out += [k for k in range((rows - 1) // step * step, step - 1, -step) if k < rows]
    while out[-1] > 1:
        out.append((out[-1] + 1) // 2)
    return out


class StaticDecoder:
    """Decodes batches of up to `rows` prompts; `drafter=None`: the target alone.

    Rows finish at different rounds (a prompt the drafter knows well needs a third of the rounds
    of one it does not), and a round costs nearly as much for 200 rows as for 20 on a launch-bound
    device: when half of the rows are done, the unfinished ones are moved to the front (every
    per-row tensor and buffer, in place) and the rounds run over a bucket of half the rows, each
    bucket its own CUDA graph. The prefill runs at the longest prompt length for every batch, so it
    is a graph too."""

    def __init__(self, model, drafter, rows: int, max_prompt_len: int, max_new: int, eos: set[int],
                 sampling: Sampling = Sampling(), graphs: bool | None = None, compile: bool = False,
                 bucket_step: int | None = None):
        dev = next(model.parameters()).device
        self.device, self.rows, self.max_new, self.sampling = dev, rows, max_new, sampling
        self.max_prompt_len = max_prompt_len
        self.block_size = drafter.cfg.block_size if drafter is not None else 1
        B = self.block_size
        # Drafts a round: a DFlash block's slots 1..B-1; a DSpark block's every slot (drafter/dspark.py).
        self.dspark = drafter is not None and drafter.cfg.method == "dspark"
        self.drafts = B - 1 + drafter.cfg.label_offset if drafter is not None else 0
        self.capacity = max_prompt_len + max_new + self.drafts + 1
        self.graphs = (dev.type == "cuda") if graphs is None else graphs
        self.buckets = row_buckets(rows, bucket_step)
        self._graphs: dict = {}  # bucket -> CUDA graph of a round; "prefill" -> the prefill's
        self.trace: list | None = None  # a list: decode appends (bucket, active rows, perf_counter) per read-back
        # compile: the round through Inductor first (fused norms, RoPE and bookkeeping: fewer,
        # larger kernels), then captured as CUDA graphs. It costs up to three compilations per
        # decoder, tens of seconds each on a small target (the first bucket's shapes, shapes
        # general in the row count, and one row, which torch specialises): a benchmark's option,
        # not eval's.
        self._step = torch.compile(self._round) if compile else self._round
        with torch.inference_mode():
            target_layers = list(drafter.cfg.target_layer_ids) if drafter is not None else []
            self.target = StaticTarget(model, target_layers, rows, self.capacity)
            self.drafter = DrafterBuffers(drafter, rows, self.capacity) if drafter is not None else None
            z = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
            self.anchor, self.pos, self.n_out, self.rounds, self.seeded = z(rows), z(rows), z(rows), z(rows), z(rows)
            self.done, self.real = z(rows, dtype=torch.bool), z(rows, dtype=torch.bool)
            self.row_of = z(rows)  # the batch row each row of the tensors holds (rows move when compacted)
            self.prompt_ids, self.prompt_lens, self.keys = z(rows, max_prompt_len), z(rows), z(rows)
            # Outputs and per-round logs; the last column takes the writes of finished rows.
            self.out = z(rows, max_new + B + 1)
            self.committed, self.accepted = z(rows, max_new + 1), z(rows, max_new + 1)
            self.eos = torch.tensor(sorted(eos) or [-1], device=dev)
            self.steps = torch.arange(self.drafts + 1, device=dev)  # a verify block: the anchor and the drafts
            # per row and draft slot: [confidence sum, rounds verifying the slot, rounds accepting it]
            self.calibration = z(rows, 3, self.drafts, dtype=torch.float32)

    def _per_row(self) -> list[torch.Tensor]:
        """Every tensor whose first dimension is the row (what compaction moves)."""
        bufs = self.target.buffers()
        if self.drafter is not None:
            bufs += self.drafter.keys + self.drafter.values
        return [self.anchor, self.pos, self.n_out, self.rounds, self.seeded, self.done, self.row_of, self.out,
                self.committed, self.accepted, self.calibration, *bufs]

    # -- device work only (what the CUDA graphs capture) ---------------------------------------------

    def _prefill(self) -> None:
        """Keys/values of every prompt position (all at the longest prompt's length: one shape),
        the first token, fresh state."""
        R, P = self.rows, self.max_prompt_len
        pos = torch.arange(P, device=self.device)[None, :].expand(R, P)
        self.target.reset()
        hidden, feats = self.target.forward(self.prompt_ids, pos, features=self.drafter is not None,
                                            keep=self.prompt_lens, span=P)
        last = hidden[torch.arange(R, device=self.device), self.prompt_lens - 1]
        self.seeded.copy_(prompt_keys(self.sampling.seed, self.keys))
        self.n_out.zero_()
        first = target_tokens(self.target.logits(last), self.sampling, self.seeded, self.n_out)
        self.out.zero_()
        self.out[:, 0] = first
        self.n_out.fill_(1)
        self.pos.copy_(self.prompt_lens)
        self.anchor.copy_(first)
        self.rounds.zero_()
        self.committed.zero_()
        self.accepted.zero_()
        self.calibration.zero_()
        self.row_of.copy_(torch.arange(R, device=self.device))
        self.done.copy_(~self.real | torch.isin(first, self.eos) | (self.max_new <= 1))
        if self.drafter is not None:
            self.drafter.add_context(feats, pos)

    def _round(self, k: int) -> None:
        """One round of the first k rows."""
        anchor, pos, n_out, seeded = self.anchor[:k], self.pos[:k], self.n_out[:k], self.seeded[:k]
        active = ~self.done[:k]
        if self.drafter is None:
            hidden, _ = self.target.forward(anchor[:, None], pos[:, None], features=False, keep=active.long())
            nxt = target_tokens(self.target.logits(hidden)[:, 0], self.sampling, seeded, n_out)
            self._commit(k, anchor.new_empty((k, 0)), torch.zeros_like(anchor), nxt, active)
            return
        s = self.sampling
        # Drafts that can still be committed: the last round of an output drafts fewer (the
        # reference's rule; its block is that much shorter, which the drafter sees).
        limit = (self.max_new - n_out).clamp(0, self.drafts)
        if self.dspark:
            from dflash_offline.drafter.dspark import draft_chain

            d = self.drafter.drafter
            h = self.drafter.draft_hidden(anchor, pos, limit.clamp_min(1))
            drafts, q, *conf = draft_chain(h, d.lm_head.weight, d.markov_head, s, seeded, n_out, anchor,
                                           d.confidence_head)
        else:
            drafts, q = draft_tokens(self.drafter.draft_logits(anchor, pos, limit + 1), s, seeded, n_out)
        block = torch.cat([anchor[:, None], drafts], 1)
        bpos = pos[:, None] + self.steps
        hidden, feats = self.target.forward(block, bpos, features=True)
        accepted, nxt = verify_block(drafts, q, self.target.logits(hidden), limit, s, seeded, n_out)
        # Recurrent layers keep the anchor and the accepted drafts, nothing of the rejected ones.
        self.target.settle((accepted + 1) * active)
        self.drafter.add_context(feats, bpos)
        if self.dspark and conf:  # the confidence head's calibration: slot j verified, and accepted
            j = self.steps[None, :-1]
            verified = ((j < limit[:, None]) & (j <= accepted[:, None]) & active[:, None]).float()
            self.calibration[:k] += torch.stack([conf[0] * verified, verified, verified * (j < accepted[:, None])], 1)
        self._commit(k, drafts, accepted, nxt, active)

    def _commit(self, k: int, drafts: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor,
                active: torch.Tensor) -> None:
        """Writes the accepted drafts and `nxt` to each active row's output, cut at max_new and
        after an end-of-sequence token; logs the round; advances the row."""
        n_out, rounds = self.n_out[:k], self.rounds[:k]
        j = torch.arange(drafts.shape[1] + 1, device=drafts.device)[None, :]
        cand = torch.where(j < accepted[:, None], torch.cat([drafts, nxt[:, None]], 1), nxt[:, None])
        produced = torch.minimum(accepted + 1, (self.max_new - n_out).clamp_min(0))
        ends = torch.isin(cand, self.eos) & (j < produced[:, None])
        hit = ends.any(-1)
        produced = torch.where(hit, ends.long().argmax(-1) + 1, produced) * active
        dump = self.out.shape[1] - 1
        self.out[:k].scatter_(1, torch.where(j < produced[:, None], n_out[:, None] + j, dump), cand)
        at = torch.where(active, rounds, self.max_new)[:, None]
        self.committed[:k].scatter_(1, at, produced[:, None])
        self.accepted[:k].scatter_(1, at, accepted[:, None])
        rounds += active.long()
        n_out += produced
        self.pos[:k] += (accepted + 1) * active
        self.anchor[:k].copy_(torch.where(active, nxt, self.anchor[:k]))
        self.done[:k] |= active & ((n_out >= self.max_new) | hit)

    # -- host side -------------------------------------------------------------------------------

    def _run(self, what) -> None:
        """Replays the graph of `what` (a bucket, or "prefill"), or runs it eagerly."""
        graph = self._graphs.get(what)
        if graph is not None:
            graph.replay()
        elif what == "prefill":
            self._prefill()
        else:
            self._step(what)

    def _load(self, prompts: list[list[int]], keys: list[int]) -> None:
        """The batch's prompts (right-padded), lengths, keys and real rows into the device buffers."""
        R, n = self.rows, len(prompts)
        ids = torch.zeros((R, self.max_prompt_len), dtype=torch.long)
        lens = torch.ones(R, dtype=torch.long)  # filler rows: one token, finished from the start
        for r, p in enumerate(prompts):
            if len(p) > self.max_prompt_len:
                raise ValueError(f"a prompt of {len(p)} tokens; this decoder holds {self.max_prompt_len}")
            ids[r, :len(p)] = torch.tensor(p)
            lens[r] = len(p)
        self.prompt_ids.copy_(ids)
        self.prompt_lens.copy_(lens)
        self.keys.copy_(torch.tensor(list(keys) + [0] * (R - n)))
        self.real.copy_(torch.arange(R) < n)

    def _compact(self, k: int) -> None:
        """Moves the unfinished rows among the first k to the front, in place (graphs keep their addresses)."""
        order = torch.argsort(self.done[:k].to(torch.uint8), stable=True)
        for t in self._per_row():
            t[:k].copy_(t[:k].index_select(0, order))

    def _rewind(self) -> None:
        """The throwaway batch's rows back at their prompts: warm-up rounds must not walk them past
        the buffers (27 rounds on 9 buckets would, with a short --max-new-tokens)."""
        self.pos.copy_(self.prompt_lens)
        self.n_out.fill_(1)

    def _capture(self, prompt: list[int]) -> None:
        """Records the prefill and a round of every bucket as CUDA graphs, after warm-up runs on a
        side stream (which capture requires), on a throwaway batch."""
        self._load([prompt] * self.rows, list(range(self.rows)))
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for what in ["prefill", *self.buckets]:
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(3):
                    self._rewind()
                    self._run(what)
                    self.done.zero_()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            self._rewind()
            with torch.cuda.graph(graph, pool=pool):
                self._run(what)  # not yet in self._graphs: runs (records) the work itself
            self._graphs[what] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], keys: list[int] | None = None) -> list[Decoded]:
        """Decodes up to `rows` prompts together; keys: each prompt's sampling key (its id)."""
        if not 0 < len(prompts) <= self.rows:
            raise ValueError(f"a batch holds 1..{self.rows} prompts, got {len(prompts)}")
        keys = list(range(len(prompts))) if keys is None else list(keys)
        if self.graphs and not self._graphs:
            self._capture(prompts[0])
        t0 = time.perf_counter()
        self._load(prompts, keys)
        self._run("prefill")
        k = self.rows
        while True:
            active = int((~self.done[:k]).sum())  # the one read-back of a round
            if self.trace is not None:
                self.trace.append((k, active, time.perf_counter()))
            if active == 0:
                break
            bucket = min(b for b in self.buckets if b >= active)
            if bucket < k:
                self._compact(k)
                k = bucket
            self._run(k)
            corrupt_recurrent_state(self.target)  # tests only (runtime/faults.py); unset, one lookup
        n = len(prompts)
        where = self.row_of.tolist()
        out, n_out, rounds = self.out.tolist(), self.n_out.tolist(), self.rounds.tolist()
        committed, accepted = self.committed.tolist(), self.accepted.tolist()
        calibration = self.calibration.tolist() if self.dspark and self.drafter.drafter.confidence_head is not None else None
        seconds = (time.perf_counter() - t0) / n  # the batch's wall time, shared by its prompts
        results: list[Decoded | None] = [None] * n
        for i, r in enumerate(where):
            if r < n:
                results[r] = Decoded(out[i][:n_out[i]], accepted[i][:rounds[i]], seconds, rounds[i] + 1,
                                     committed[i][:rounds[i]], None if calibration is None else calibration[i])
        return results  # type: ignore[return-value]

    def decode_all(self, prompts: list[list[int]], keys: list[int] | None = None, on_batch=None) -> list[Decoded]:
        """All prompts in batches of `rows`, grouped by length; results in input order."""
        keys = list(range(len(prompts))) if keys is None else list(keys)
        return in_length_batches(prompts, self.rows,
                                 lambda part: self.decode([prompts[i] for i in part], [keys[i] for i in part]), on_batch)
