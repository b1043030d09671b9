"""Continuous batching (generate/continuous.py) against brute force: every prompt decoded alone by
generate's padded decoder, in fp32, on tiny dense and hybrid targets.

- slots 1 and 4 over 9 prompts of mixed lengths, the step through the layers' modules and through
  targets/fused_step.py's pieces (a slot is refilled as soon as its prompt
  ends: by an end-of-sequence token or at --max-new-tokens), read back every step and every
  third step, the staging prefill two prompts at a time: the same tokens, greedy and sampled
  (the keyed noise makes a prompt's sample independent of its slot);
- `run` with `on_finish` queueing follow-up requests (a conversation's next turn) decodes them too;
- generate's parts stream through the slots: the next part's prompts start before a part's last
  ends (fewer steps than draining the slots at each part's end), the same tokens;
- on a GPU the step replays as a CUDA graph: the same tokens as the eager step, with the step's
  compiled pieces (targets/fused_step.py) and with the layers' own modules.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from dflash_offline.evaluate.speculative import load_target_for_decoding
from dflash_offline.generate.continuous import ContinuousDecoder, Request
from dflash_offline.generate.decoding import BatchDecoder
from dflash_offline.sampling import Sampling

LENGTHS = (4, 19, 9, 30, 2, 7, 13, 25, 3)
MAX_NEW = 20


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(request, tiny_dense, tiny_hybrid):
    folder = tiny_dense if request.param == "qwen3" else tiny_hybrid
    return load_target_for_decoding(str(folder), "cpu", "float32")[0]


def prompts_and_ids():
    rng = np.random.default_rng(3)
    return [rng.integers(2, 500, size=n).tolist() for n in LENGTHS], list(range(100, 100 + len(LENGTHS)))


def alone(model, prompts, ids, eos, sampling):
    one = BatchDecoder(model, 1, max(LENGTHS), MAX_NEW, eos, sampling)
    return [one.decode([p], [i]) for p, i in zip(prompts, ids)]


@pytest.mark.parametrize("fused_step", [False, True], ids=["plain-step", "step-pieces"])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.9, 0.95, 7)], ids=["greedy", "sampled"])
def test_continuous_equals_each_prompt_alone(model, sampling, fused_step):
    prompts, ids = prompts_and_ids()
    first = alone(model, prompts, ids, set(), sampling)
    eos = {first[1].tokens[0][5], first[3].tokens[0][11]}
    want = alone(model, prompts, ids, eos, sampling)
    lengths = [len(w.tokens[0]) for w in want]
    assert min(lengths) < MAX_NEW and lengths.count(MAX_NEW) >= 2, lengths  # rows end at different steps
    for rows in (1, 4):
        for check_every in (1, 3):
            dec = ContinuousDecoder(model, rows, max(LENGTHS), MAX_NEW, eos, sampling, check_every=check_every,
                                    stage_rows=2, fused_step=fused_step)
            got = dec.decode_all(prompts, ids)
            assert [g.tokens for g in got] == [w.tokens[0] for w in want], (rows, check_every)
            assert [g.ended_by_eos for g in got] == [w.ended_by_eos[0] for w in want]


def test_follow_up_jobs_are_decoded(model):
    """on_finish may queue more work: each finished prompt queues its own tokens as a new prompt
    (as a conversation's next turn does); both rounds equal decoding them alone."""
    prompts, ids = prompts_and_ids()
    prompts = [p[:8] for p in prompts]
    dec = ContinuousDecoder(model, 3, 8 + MAX_NEW, MAX_NEW, set(), Sampling(), stage_rows=2)
    seen = {}

    def on_finish(f):
        seen[f.request.key] = f.tokens
        if f.request.key < 1000:
            return [Request(f.request.key + 1000, f.request.prompt + f.tokens)]
        return None

    dec.run(deque(Request(i, p) for i, p in zip(ids, prompts)), on_finish)
    one = BatchDecoder(model, 1, 8 + MAX_NEW, MAX_NEW, set(), Sampling())
    for i, p in zip(ids, prompts):
        first = one.decode([p], [i]).tokens[0]
        assert seen[i] == first
        assert seen[i + 1000] == one.decode([p + first], [i + 1000]).tokens[0]


def test_parts_stream_through_the_slots_without_draining(model):
    """generate's parts as one stream: the second part's prompts take slots while the first part's
    last prompts decode, so 3 + 3 prompts of 20 new tokens (the first from the prefill, 19 steps) in
    2 slots take 3 x 19 steps (drained at the part's end: 4 x 19); each part is handed over once, when its last prompt ends, with every
    prompt's tokens equal to it decoded alone; an empty part is handed over at once."""
    from dflash_offline.generate.continuous import Part

    prompts, ids = prompts_and_ids()
    want = [r.tokens[0] for r in alone(model, prompts, ids, set(), Sampling())]
    split = [Part(0, "a", prompts[:3], ids[:3]), Part(1, "empty", [], []), Part(2, "b", prompts[3:6], ids[3:6])]

    def decode(parts):
        dec = ContinuousDecoder(model, 2, max(LENGTHS), MAX_NEW, set(), Sampling(), check_every=1, stage_rows=2)
        handed, ended = [], []
        steps = dec.decode_parts(iter(parts), ended.append, lambda part, new, eos: handed.append((part.handle, new)))
        return steps, handed, ended

    steps, handed, ended = decode(split)
    assert steps == 3 * (MAX_NEW - 1) and sorted(h for h, _ in handed) == [0, 1, 2]
    assert dict(handed) == {0: want[:3], 1: [], 2: want[3:6]}
    assert ended.count(0) == 3 and ended.count(2) == 3
    assert decode(split[:1])[0] + decode(split[2:])[0] == 4 * (MAX_NEW - 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_step_equals_eager(model):
    import copy

    cuda = copy.deepcopy(model).to("cuda")
    prompts, ids = prompts_and_ids()
    want = [r.tokens[0] for r in alone(cuda, prompts, ids, set(), Sampling())]
    for graphs in (True, False):
        for fused_step in (True, False):  # the compiled pieces (targets/fused_step.py) and the layers' modules
            dec = ContinuousDecoder(cuda, 4, max(LENGTHS), MAX_NEW, set(), Sampling(), graphs=graphs, stage_rows=3,
                                    fused_step=fused_step)
            assert [g.tokens for g in dec.decode_all(prompts, ids)] == want, (graphs, fused_step)
