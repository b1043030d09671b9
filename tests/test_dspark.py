"""DSpark's heads, training blocks and three-term loss against brute force, slot by slot.

- the loss (vanilla and gated Markov heads, with and without the confidence head, p_target from a
  top-k with its remaining mass or one-hot, several chunks) equals a float64 loop over the slots
  that writes each term from its definition; so do its gradients (hidden states, both heads);
- the top-k L1 is the L1 with the tokens outside the top-k merged: never above the full L1, equal
  to it when the top-k is the whole vocabulary;
- x_{k-1}: the anchor for slot 0, the data token before for the others;
- DSpark rows (label_offset 1): slot j predicts the token at anchor + 1 + j, every slot scored,
  weights exp(-j / gamma); DFlash rows unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash_offline.drafter.dspark import ConfidenceHead, MarkovHead, previous_tokens
from dflash_offline.blocks.dspark_loss import LossWeights, dspark_loss
from dflash_offline.blocks.packing import build_row, loss_weights

V, H, RANK, B = 41, 12, 5, 4
SPREAD = 0.5  # the decoding tests' Markov bias scale: it decides some drafts, and whole blocks still pass


def make(kind: str, with_conf: bool, seed: int = 0):
    torch.manual_seed(seed)
    markov = None
    if kind != "none":  # none: DFlash's loss with the L1 term (train --tv-weight), no heads
        markov = MarkovHead(V, H, RANK, kind).double()
        markov.reset_parameters(0.3)
    conf = ConfidenceHead(H, RANK).double() if with_conf else None
    if conf is not None:
        conf.reset_parameters(0.3)
    head = torch.randn(V, H, dtype=torch.float64)
    return markov, conf, head


def batch(R=2, Q=3 * B, k=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, Q, H, dtype=torch.float64, generator=g)
    labels = torch.randint(0, V, (R, Q), generator=g)
    prev = torch.randint(0, V, (R, Q), generator=g)
    weights = torch.rand(R, Q, dtype=torch.float64, generator=g) * (torch.rand(R, Q, generator=g) > 0.2)
    # a top-k of a random full distribution: log-probabilities over the whole vocabulary
    full = torch.randn(R, Q, V, dtype=torch.float64, generator=g).mul(2).log_softmax(-1)
    lp, ids = full.topk(k, -1)
    lp = torch.where(weights[..., None] == 0, torch.full_like(lp, -math.inf), lp)  # padding in unscored slots
    return hidden, labels, prev, weights, ids.int(), lp.float(), full


def brute(markov, conf, head, hidden, labels, prev, weights, ids, lp, lw: LossWeights):
    """Each slot on its own, each term from its definition."""
    total = torch.zeros((), dtype=torch.float64)
    R, Q = labels.shape
    for r in range(R):
        for q in range(Q):
            w = float(weights[r, q])
            if w == 0:
                continue
            h, x, y = hidden[r, q], prev[r, q], labels[r, q]
            z = head @ h
            if markov is not None:
                e = markov.markov_w1.weight[x]
                code = e
                if markov.kind == "gated":
                    code = torch.sigmoid(markov.gate_proj.weight @ torch.cat([h, e]) + markov.gate_proj.bias) * e
                z = z + markov.markov_w2.weight @ code
            p = torch.softmax(z, -1)
            ce = -torch.log(p[y])
            if ids is None:
                target = torch.zeros(V, dtype=torch.float64)
                target[y] = 1.0
                l1 = (p - target).abs().sum()
            else:
                known = [int(i) for i in ids[r, q]]
                t = [math.exp(float(v)) for v in lp[r, q]]
                l1 = sum((p[i] - ti).abs() for i, ti in zip(known, t))
                others = sum(p[i] for i in range(V) if i not in known)
                l1 = l1 + (others - (1.0 - sum(t))).abs()
            term = lw.ce * ce + lw.tv * l1
            if conf is not None:
                s = float(min(1.0, max(0.0, 1.0 - 0.5 * l1.item())))  # a number: no gradient through it
                c = torch.sigmoid(conf.proj.weight[0] @ torch.cat([h, e]) + conf.proj.bias[0])
                term = term + lw.bce * -(s * torch.log(c) + (1 - s) * torch.log(1 - c))
            total = total + w * term
    return total


@pytest.mark.parametrize("kind", ["vanilla", "gated", "none"])
@pytest.mark.parametrize("with_conf", [True, False], ids=["confidence", "no-confidence"])
@pytest.mark.parametrize("topk", [True, False], ids=["topk", "onehot"])
def test_loss_equals_brute_force_slot_by_slot(kind, with_conf, topk):
    if kind == "none" and with_conf:
        pytest.skip("the confidence head reads the Markov head's embedding")
    markov, conf, head = make(kind, with_conf)
    hidden, labels, prev, weights, ids, lp, _ = batch()
    lw = LossWeights(0.3, 0.5, 0.7)
    hidden.requires_grad_()
    got = dspark_loss(hidden, head, markov, conf, prev, labels, weights, ids if topk else None, lp if topk else None,
                      lw, chunk_tokens=5)
    params = [hidden, *(markov.parameters() if markov is not None else []),
              *(conf.parameters() if conf is not None else [])]
    g_got = torch.autograd.grad(got.total, params)
    want = brute(markov, conf, head, hidden, labels, prev, weights, ids if topk else None, lp, lw)
    g_want = torch.autograd.grad(want, params)
    # the loss's logits are float32 (as in training): agreement to float32's precision
    torch.testing.assert_close(got.total.double(), want, rtol=2e-5, atol=1e-5)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    z = hidden.detach() @ head.T
    if markov is not None:
        z = z + markov.markov_w2(markov.code(hidden.detach(), prev)[1])
    assert torch.equal(got.correct, z.argmax(-1) == labels)
    assert 0 < float(got.survival) <= float(weights.sum())


@pytest.mark.parametrize("kind", ["vanilla", "none"])
def test_dpace_weights_equal_their_definition_slot_by_slot(kind):
    """--loss-weights dpace with the three-term loss: each scored slot k of a block weighs
    sum over scored m >= k of prod over scored i <= m of ((1 - a) q_i + a), q_i the drafter's detached
    probability of slot i's label under the biased logits, rescaled to the data weights' total."""
    markov, conf, head = make(kind, kind != "none")
    hidden, labels, prev, weights, ids, lp, _ = batch()
    lw, a = LossWeights(0.3, 0.5, 0.7), 0.4
    hidden.requires_grad_()
    got = dspark_loss(hidden, head, markov, conf, prev, labels, weights, ids, lp, lw, chunk_tokens=5,
                      dpace_alpha=a, block_size=B)
    R, Q = labels.shape
    d = torch.zeros(R, Q, dtype=torch.float64)
    with torch.no_grad():
        for r in range(R):
            for b0 in range(0, Q, B):
                scored = [k for k in range(b0, b0 + B) if weights[r, k] != 0]
                q = {}
                for k in scored:
                    z = head @ hidden[r, k]
                    if markov is not None:
                        z = z + markov.markov_w2.weight @ markov.markov_w1.weight[prev[r, k]]
                    q[k] = float(torch.softmax(z, -1)[labels[r, k]])
                for k in scored:
                    d[r, k] = sum(math.prod((1 - a) * q[i] + a for i in scored if i <= m) for m in scored if m >= k)
        d = d * (weights.sum() / d.sum())
    want = brute(markov, conf, head, hidden, labels, prev, d, ids, lp, lw)
    torch.testing.assert_close(got.total.double(), want, rtol=2e-5, atol=1e-5)
    for g, w in zip(torch.autograd.grad(got.total, hidden), torch.autograd.grad(want, hidden)):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


def test_topk_l1_is_the_l1_with_the_other_tokens_merged():
    markov, _, head = make("vanilla", False)
    hidden, labels, prev, weights, _, _, full = batch(k=6)
    weights = torch.ones_like(weights)
    lw = LossWeights(0.0, 1.0, 0.0)
    with torch.no_grad():
        z = hidden @ head.T + markov.markov_w2(markov.markov_w1(prev))
        exact = (torch.softmax(z, -1) - full.exp()).abs().sum(-1)  # the full L1 of every slot
        for k in (1, 6, V):
            lp, ids = full.topk(k, -1)
            per = [float(dspark_loss(hidden[r:r + 1, q:q + 1], head, markov, None, prev[r:r + 1, q:q + 1],
                                     labels[r:r + 1, q:q + 1], weights[r:r + 1, q:q + 1], ids[r:r + 1, q:q + 1],
                                     lp[r:r + 1, q:q + 1].float(), lw).total)
                   for r in range(2) for q in range(3 * B)]
            per = torch.tensor(per, dtype=torch.float64)
            assert (per <= exact.flatten() + 1e-5).all()
            if k == V:
                torch.testing.assert_close(per, exact.flatten(), rtol=1e-4, atol=1e-5)


def test_draft_chain_without_a_markov_head_is_the_backbone_argmax():
    """markov_rank 0 (a DSpark export may say so): the drafts are the LM head's argmax per slot."""
    from dflash_offline.drafter.dspark import draft_chain
    from dflash_offline.sampling import Sampling

    _, _, head = make("none", False)
    h = torch.randn(2, 4, H, dtype=torch.float64)
    drafts, q = draft_chain(h, head, None, Sampling(), None, None, torch.tensor([3, 4]))
    assert q is None and torch.equal(drafts, (h @ head.T).argmax(-1))


def test_previous_tokens_are_the_anchor_then_the_data():
    block_ids = torch.tensor([[7, 1, 1, 1, 9, 1, 1, 1]])
    labels = torch.tensor([[10, 11, 12, 13, 20, 21, 22, 23]])
    assert previous_tokens(block_ids, labels, 4).tolist() == [[7, 10, 11, 12, 9, 20, 21, 22]]


def test_dspark_rows_predict_the_next_token_from_every_slot():
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 90, size=30)
    lm = np.r_[np.zeros(5, np.uint8), np.ones(25, np.uint8)]
    gamma = 4.0
    args = ([ids], [lm], 40, 6, B, 1)
    dspark = build_row(*args, loss_weights(B, gamma, 1), np.random.default_rng(1), label_offset=1)
    dflash = build_row(*args, loss_weights(B, gamma), np.random.default_rng(1))
    assert np.array_equal(dspark.anchors, dflash.anchors)
    w = np.exp(-np.arange(B) / gamma)
    for n, (a, ok) in enumerate(zip(dspark.anchors, dspark.anchor_valid)):
        if not ok:
            continue
        blk = slice(n * B, (n + 1) * B)
        inside = a + 1 + np.arange(B) < 30
        assert dspark.block_ids[blk][0] == ids[a] and (dspark.block_ids[blk][1:] == 1).all()
        assert np.array_equal(dspark.labels[blk][inside], ids[a + 1:a + 1 + B][: inside.sum()])
        np.testing.assert_allclose(dspark.weights[blk], w * inside, rtol=1e-6)
        # DFlash: slot j predicts anchor + j, slot 0 unscored
        assert dflash.labels[blk][0] == 0 and dflash.weights[blk][0] == 0
        assert np.array_equal(dflash.labels[blk][1:][inside[:-1]], ids[a + 1:a + B][: inside[:-1].sum()])


# ----------------------------------------------------------------------------------------------
# Decoding (the static decoder): lossless, and the same rounds as a one-prompt DSpark loop


def dspark_one_prompt(model, drafter, prompt, max_new, eos):
    """A brute-force greedy DSpark decoder of one prompt: every round, the target's whole sequence
    through transformers (features of every position), the drafter's block [anchor, MASK x (n-1)]
    over the committed context, the drafts chosen left to right through the Markov head, the
    accepted prefix and the target's next token. -> (tokens, accepted per round)."""
    layers = drafter.cfg.target_layer_ids

    def forward(seq):
        with torch.inference_mode():
            o = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
        return o.logits[0], torch.cat([o.hidden_states[i + 1][0] for i in layers], -1)

    logits, _ = forward(prompt)
    out, accepted = [int(logits[-1].argmax())], []
    while len(out) < max_new and out[-1] not in eos:
        seq = prompt + out
        _, feats = forward(seq)
        n = min(drafter.cfg.block_size, max_new - len(out))
        anchor = len(seq) - 1
        with torch.inference_mode():
            kv = drafter.context_kv(feats[None, :anchor], torch.arange(anchor)[None])
            block = torch.tensor([[seq[-1]] + [drafter.cfg.mask_token_id] * (n - 1)])
            h = drafter.draft_hidden(kv, block, torch.arange(anchor, anchor + n)[None])[0]
            m, drafts = drafter.markov_head, []
            for k in range(n):  # slot k: the backbone's logits plus W2 W1[the token before it]
                z = drafter.lm_head.weight @ h[k] + m.markov_w2.weight @ m.markov_w1.weight[(drafts or [seq[-1]])[-1]]
                drafts.append(int(z.argmax()))
        logits, _ = forward(seq + drafts)
        want = logits[anchor:].argmax(-1).tolist()  # the target's choice after the anchor and each draft
        a = 0
        while a < n and drafts[a] == want[a]:
            a += 1
        accepted.append(a)
        for tok in drafts[:a] + [want[a]]:
            out.append(tok)
            if len(out) >= max_new or tok in eos:
                break
    return out, accepted


@pytest.fixture(scope="module")
def dspark_fitted(tiny_dense, tiny_hybrid):
    from conftest import fitted_drafter
    from dflash_offline.evaluate.speculative import TargetSession, greedy_decode, load_target_for_decoding

    out = {}
    for kind, folder in (("qwen3", tiny_dense), ("qwen3_5", tiny_hybrid)):
        model, _ = load_target_for_decoding(str(folder), "cpu", "float32")
        session = TargetSession(model, [1, 2])
        rng = np.random.default_rng(5)
        prompts = [rng.integers(2, 500, size=n).tolist() for n in (6, 21, 13, 34, 3)]
        completions = [greedy_decode(session, p, 40, set()).tokens for p in prompts]
        d = fitted_drafter(folder, session, prompts, completions, [1, 2], 6, method="dspark")
        # 40 steps leave the Markov bias near its tiny start: a random one of about the logits'
        # spread makes the chain decide some drafts (the test must see the previous draft's effect)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            d.markov_head.markov_w1.weight.copy_(torch.randn(d.markov_head.markov_w1.weight.shape, generator=g))
            d.markov_head.markov_w2.weight.copy_(torch.randn(d.markov_head.markov_w2.weight.shape, generator=g) * SPREAD)
        out[kind] = (model, d, prompts)
    return out


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_dspark_static_decoding_is_lossless_and_equals_brute_force(dspark_fitted, kind):
    """fp32 greedy: the static decoder with a DSpark drafter gives the target alone's tokens and
    the brute-force DSpark loop's accepted drafts per round, rows 1 and 3, with and without
    end-of-sequence tokens; rounds accept from none to every slot of the block (6 drafts)."""
    from dflash_offline.evaluate.graphed import StaticDecoder
    from dflash_offline.evaluate.speculative import TargetSession, greedy_decode

    model, drafter, prompts = dspark_fitted[kind]
    session = TargetSession(model, [1, 2])
    max_new = 23
    plain = [greedy_decode(session, p, max_new, set()).tokens for p in prompts]
    seen = set()
    for stop in (set(), {plain[0][9], plain[3][17]}):
        alone = [greedy_decode(session, p, max_new, stop).tokens for p in prompts]
        brute = [dspark_one_prompt(model, drafter, p, max_new, stop) for p in prompts]
        assert [b[0] for b in brute] == alone
        for rows in (1, 3):
            got = StaticDecoder(model, drafter, rows, max(map(len, prompts)), max_new, stop).decode_all(prompts)
            for k, (g, (toks, acc)) in enumerate(zip(got, brute)):
                assert g.tokens == toks, (rows, stop, k)
                assert g.accepted == acc, (rows, stop, k, g.accepted, acc)
                # the confidence head's record: every round verifies slot 0, slot j is accepted in
                # the rounds that accept more than j drafts, predictions are probabilities
                pred, verified, survived = np.asarray(g.confidence)
                assert verified[0] == len(acc) and survived.tolist() == [sum(a > j for a in acc) for j in range(6)]
                assert (verified >= survived).all() and (pred <= verified).all() and (pred >= 0).all()
        seen.update(a for _, acc in brute for a in acc)
    assert min(seen) < 6 and 6 in seen, f"accepted lengths {seen}: the comparison needs rejections and whole blocks"


def test_dspark_walk_equals_a_brute_force_walk_over_the_cache(dspark_fitted, tiny_dense, tmp_path):
    """The held-out walk (train --eval-cache, eval --cache) for a DSpark drafter on a cache of the
    target's own greedy completions: for every sample, each round's accepted drafts equal a
    brute-force walk that drafts the whole block from the cache's stored features, chooses the
    drafts left to right through the Markov head, and checks them against the data (the target's
    greedy tokens): what greedy decoding with those features would accept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from conftest import run_cli
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.evaluate.speculative import TargetSession, greedy_decode
    from dflash_offline.blocks.walk import walk_acceptance, walk_rounds

    model, drafter, prompts = dspark_fitted["qwen3"]
    session, new = TargetSession(model, [1, 2]), 30
    rows = [p + greedy_decode(session, p, new, set()).tokens for p in prompts]
    data = tmp_path / "own.parquet"
    pq.write_table(pa.table({"id": list(range(len(rows))), "input_ids": rows,
                             "loss_mask": [[0] * len(p) + [1] * new for p in prompts]}), data)
    cache = tmp_path / "cache"
    r = run_cli(["extract", "--target", str(tiny_dense), "--data", str(data), "--cache", str(cache), "--topk", "0",
                 "--capture-layers", "1,2", "--max-len", "128", "--no-progress"])
    assert r.returncode == 0, r.stderr[-2000:]
    max_new, B = 24, drafter.cfg.block_size
    walk = walk_acceptance(str(cache), drafter, "cpu", max_new=max_new, per_sample=True)
    reader = CacheReader(str(cache))
    m = drafter.markov_head
    seen = set()
    for x in walk["per_sample"]:
        s = reader.sample(x["id"])
        ids, feats = s.input_ids.tolist(), torch.from_numpy(np.ascontiguousarray(s.hidden).reshape(len(s.input_ids), -1))
        p0 = int(np.flatnonzero(s.loss_mask)[0])
        accepted = []
        for p in range(p0, len(ids) - 1):  # the whole block anchored at every completion token
            with torch.no_grad():
                kv = drafter.context_kv(feats[None, :p].float(), torch.arange(p)[None])
                block = torch.tensor([[ids[p]] + [drafter.cfg.mask_token_id] * (B - 1)])
                h = drafter.draft_hidden(kv, block, torch.arange(p, p + B)[None])[0]
            a, prev = 0, ids[p]
            while a < B and p + 1 + a < len(ids):
                z = drafter.lm_head.weight.float() @ h[a].float() + m.markov_w2.weight @ m.markov_w1.weight[prev]
                if int(z.argmax()) != ids[p + 1 + a]:
                    break
                prev, a = ids[p + 1 + a], a + 1
            accepted.append(a)
        want = walk_rounds(accepted, max_new)
        assert x["accepted"] == want, (x["id"], x["accepted"], want)
        seen.update(want)
    assert len(walk["accept_rate"]) == B and 0 in seen and max(seen) >= 2, seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_dspark_cuda_graphs_equal_eager(dspark_fitted, kind):
    """On a GPU the static decoder captures a DSpark round (the draft chain, the calibration
    record) as a CUDA graph: the same tokens, rounds and confidence record as the eager round, and
    the target alone's tokens."""
    import copy

    from dflash_offline.evaluate.graphed import StaticDecoder
    from dflash_offline.evaluate.speculative import TargetSession, greedy_decode

    model, drafter, prompts = dspark_fitted[kind]
    model, drafter = copy.deepcopy(model).to("cuda"), copy.deepcopy(drafter).to("cuda")
    longest, max_new = max(map(len, prompts)), 23
    alone = [greedy_decode(TargetSession(model, [1, 2]), p, max_new, set()).tokens for p in prompts]
    runs = {g: StaticDecoder(model, drafter, 3, longest, max_new, set(), graphs=g).decode_all(prompts)
            for g in (True, False)}
    assert [r.tokens for r in runs[True]] == [r.tokens for r in runs[False]] == alone
    assert [r.accepted for r in runs[True]] == [r.accepted for r in runs[False]]
    for a, b in zip(runs[True], runs[False]):
        np.testing.assert_allclose(a.confidence, b.confidence, rtol=1e-5, atol=1e-5)


def test_compiled_loss_equals_the_eager_one():
    """`compiled=True` (train --compile-loss): each full chunk one compiled graph, the short last
    chunk eager; the eager loss, hits and gradients (hidden states, both heads), and no recompile
    on a second call."""
    from dflash_offline.blocks import dspark_loss as module
    from dflash_offline.blocks.loss import _compiled
    from dflash_offline.drafter.masks import count_recompiles

    markov, conf, head = make("vanilla", True)
    markov, conf, head = markov.float(), conf.float(), head.float()
    hidden, labels, prev, weights, ids, lp, _ = batch(Q=5 * B)
    hidden, weights = hidden.float(), weights.float()
    out = {}
    for compiled in (False, True):
        h = hidden.clone().requires_grad_()
        r = dspark_loss(h, head, markov, conf, prev, labels, weights, ids, lp, chunk_tokens=16, compiled=compiled)
        params = [h, *markov.parameters(), *conf.parameters()]
        out[compiled] = (r.total.detach(), r.correct, r.survival, torch.autograd.grad(r.total * 0.37, params))
    assert module._chunk in _compiled, "the compiled chunk was not used"
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[True][1], out[False][1])
    torch.testing.assert_close(out[True][2], out[False][2], rtol=1e-5, atol=1e-5)
    for a, b in zip(out[True][3], out[False][3]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    before = count_recompiles()  # 40 slots in chunks of 16: the last 8 ran eagerly
    dspark_loss(hidden.clone().requires_grad_(), head, markov, conf, prev, labels, weights, ids, lp, chunk_tokens=16,
                compiled=True).total.backward()
    assert count_recompiles() == before
