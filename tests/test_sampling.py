"""Sampled decoding (dflash_offline.sampling): speculative sampling leaves the output distributed
exactly as the target's own sampling, and keyed noise makes every decoder give a prompt the same
tokens.

- Distribution: one prompt, decoded speculatively 20,000 times (keys 0..19999) on a tiny target
  with an 8-token vocabulary and a random drafter that accepts often but not always; the first 4
  new tokens (8^4 outcomes) are compared by a chi-square goodness-of-fit test with their exact
  distribution, the product of the target's own sampling distributions over every prefix
  (brute force). The same test must reject a decoder with a wrong rejection rule (power).
- DSpark: the same test with a DSpark drafter (drafts drawn left to right through its Markov
  head), and its power against a decoder that hands the rejection rule the unbiased q.
- Keys: the static decoder (batched), the one-prompt decoder and the KV-batched decoder give the
  same tokens for the same keys, and so do the target alone's two decoders.
- `verify_sampled` alone (no model) commits tokens distributed as p; `draw` is the inverse CDF.
- `sampling_probs` equals the reference implementation's `_sampling_probs`.
- `keyed_uniform` is in (0, 1) (the extreme hashes too), a pure function of its key, and uniform.

No scipy here: the chi-square survival function is computed from the regularised incomplete gamma
function and checked against closed forms.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from dflash_offline import sampling as sampling_module
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.evaluate.graphed import StaticDecoder
from dflash_offline.evaluate.kv_batch import KVBatchDFlashProposer, kv_batched_decode
from dflash_offline.evaluate.speculative import (DFlashProposer, TargetSession, greedy_decode,
                                                 load_target_for_decoding, speculative_decode)
from dflash_offline.sampling import (ACCEPT, DRAFT, TARGET, Sampling, draw, keyed_uniform, prompt_keys,
                                     sampling_probs, verify_sampled)

VOCAB = 8  # small enough that the joint distribution of 4 tokens (4096 outcomes) is enumerable
LAYERS = [0, 2]
PROMPT = [2, 5, 3, 7, 1, 4]
NEW = 4  # tokens whose joint distribution is tested
DRAWS = 20_000
# Block size 3: the first round drafts 2 tokens; all accepted, its bonus token is the 4th (the
# bonus path); a rejection leaves a later round that drafts 2 or 1 (the last round's cut).
BLOCK = 3
SETTINGS = [Sampling(1.0), Sampling(0.8, top_p=0.9, top_k=5)]
ALPHA = 0.01


# ----------------------------------------------------------------------------------------------
# Chi-square


def upper_gamma_q(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) = Gamma(a, x) / Gamma(a): the series for P below
    a + 1, a continued fraction (modified Lentz) above."""
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with `dof` degrees of freedom."""
    return upper_gamma_q(dof / 2, x / 2)


def goodness_of_fit(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int, float]:
    """Pearson's chi-square test of observed counts against expected counts (same total); outcomes
    expected fewer than 5 times are merged into one bin. -> (statistic, degrees of freedom, p)."""
    small = expected < 5
    obs = np.r_[counts[~small], counts[small].sum()]
    exp = np.r_[expected[~small], expected[small].sum()]
    if exp[-1] <= 0:
        assert obs[-1] == 0, "outcomes of probability 0 were observed"
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return stat, dof, chi2_sf(stat, dof)


def test_chi2_sf_matches_closed_forms():
    """The survival function behind the goodness-of-fit tests equals the closed forms: for 1 and 3
    degrees of freedom (erfc), for even ones (a Poisson tail sum, up to 600 degrees), and the
    tabulated 5% critical values, on both branches of the incomplete gamma function."""
    for x in (0.01, 0.5, 1.0, 3.841458820694124, 10.0, 30.0):
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9, abs=1e-300)
        three = math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2)
        assert chi2_sf(x, 3) == pytest.approx(three, rel=1e-9)
    for dof in (2, 10, 50, 200, 600):
        m = dof // 2
        for x in (0.3 * dof, 0.9 * dof, dof, 1.1 * dof, 1.5 * dof):
            terms = [i * math.log(x / 2) - x / 2 - math.lgamma(i + 1) for i in range(m)]
            top = max(terms)
            exact = math.exp(top) * sum(math.exp(t - top) for t in terms)
            assert chi2_sf(x, dof) == pytest.approx(exact, rel=1e-8, abs=1e-300), (dof, x)
    for dof, critical in ((1, 3.841459), (10, 18.307038), (100, 124.342113), (1000, 1074.679449)):
        assert chi2_sf(critical, dof) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(0.0, 5) == 1.0


# ----------------------------------------------------------------------------------------------
# The tiny small-vocabulary target and drafter


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(model, drafter, folder): a 4-layer Qwen3 with an 8-token vocabulary (head scaled for
    peaked but not degenerate distributions), and a random 1-layer drafter over it (block 3)."""
    from transformers import AutoModelForCausalLM

    from dflash_offline.tiny import tiny_config

    folder = tmp_path_factory.mktemp("targets") / "tiny-qwen3-v8"
    cfg = tiny_config("qwen3", num_target_layers=4)
    cfg.vocab_size = VOCAB
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(8.0)
    m.save_pretrained(folder)
    model, _ = load_target_for_decoding(str(folder), "cpu", "float32")
    return model, small_drafter(folder, BLOCK), folder


def small_drafter(folder, block_size: int, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(DrafterConfig.from_target(str(folder), LAYERS, block_size=block_size, drafter_layers=1,
                                                mask_token_id=1))
    d.load_frozen_from_target(str(folder))
    return d.eval()


def exact_distribution(model, prompt: list[int], s: Sampling, n: int = NEW) -> np.ndarray:
    """[V^n] the probability of each sequence of the first n new tokens under the target's own
    sampling (index: the tokens as base-V digits, first token most significant): one forward of
    every prompt + (n-1)-token extension, `sampling_probs` at each position, multiplied."""
    V = model.config.vocab_size
    ext = list(itertools.product(range(V), repeat=n - 1))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + list(t) for t in ext])).logits[:, len(prompt) - 1:]
    p = sampling_probs(logits, s).double().reshape((V,) * (n - 1) + (n, V))
    joint = torch.ones((), dtype=torch.float64)
    for j in range(n):
        # p(token j | tokens < j): any extension agreeing on tokens < j (take token 0 beyond).
        cond = p[tuple([slice(None)] * j + [0] * (n - 1 - j) + [j])]
        joint = joint[..., None] * cond
    return joint.reshape(-1).numpy()


def outcome_counts(out, V: int) -> np.ndarray:
    toks = np.array([o.tokens[:NEW] for o in out])
    idx = np.zeros(len(toks), np.int64)
    for j in range(NEW):
        idx = idx * V + toks[:, j]
    return np.bincount(idx, minlength=V ** NEW)


def decode_draws(small, s: Sampling):
    """DRAWS speculative decodes of PROMPT (keys 0..DRAWS-1, NEW tokens, no EOS) in one batch."""
    model, drafter, _ = small
    return StaticDecoder(model, drafter, DRAWS, len(PROMPT), NEW, set(), s).decode([PROMPT] * DRAWS, list(range(DRAWS)))


def test_exact_distribution_is_the_target_own_sampling(small):
    """The brute-force joint is a distribution, and its first factor is the sampling distribution
    after the prompt (so the enumeration's indexing is checked against a direct forward)."""
    model = small[0]
    s = SETTINGS[1]
    joint = exact_distribution(model, PROMPT, s)
    assert joint.shape == (VOCAB ** NEW,)
    assert joint.sum() == pytest.approx(1.0, abs=1e-5)
    with torch.inference_mode():
        first = sampling_probs(model(input_ids=torch.tensor([PROMPT])).logits[0, -1], s).double().numpy()
    np.testing.assert_allclose(joint.reshape(VOCAB, -1).sum(1), first, atol=1e-6)
    # Top-k 5 and top-p 0.9: at most 5 tokens per position, so at most 5^4 outcomes.
    assert 0 < (joint > 0).sum() <= 5 ** NEW


@pytest.mark.parametrize("s", SETTINGS, ids=["T1", "T0.8-p0.9-k5"])
def test_speculative_sampling_is_distributed_as_the_target(small, s, capsys):
    """The acceptance criterion of speculative sampling: 20,000 speculative decodes of one prompt
    (keys 0..19999) give the first 4 tokens with the target's own joint distribution (chi-square
    goodness of fit, p > 0.01), with a drafter whose drafts are accepted in a good share of rounds
    and rejected in another (every path of the rule taken: acceptance, residual draw, bonus)."""
    model = small[0]
    out = decode_draws(small, s)
    assert all(len(o.tokens) == NEW for o in out)
    acc = np.array([a for o in out for a in o.accepted])
    first_round = np.array([o.accepted[0] for o in out])
    assert acc.mean() > 0.2, f"drafts accepted per round {acc.mean():.3f}: the drafter tests nothing"
    assert (first_round == 0).mean() > 0.05, "hardly any draft is rejected at once: the residual draw is untested"
    assert (first_round == BLOCK - 1).mean() > 0.05, "hardly any round accepts every draft: the bonus is untested"
    expected = exact_distribution(model, PROMPT, s) * DRAWS
    stat, dof, p = goodness_of_fit(outcome_counts(out, VOCAB), expected)
    with capsys.disabled():
        print(f"\n[{s}] correct rule: chi2 {stat:.1f}, dof {dof}, p {p:.4f}, drafts accepted/round {acc.mean():.3f}")
    assert p > ALPHA, f"chi2 {stat:.1f} on {dof} degrees of freedom: p {p:.2e}"


@pytest.mark.parametrize("s", SETTINGS, ids=["T1", "T0.8-p0.9-k5"])
def test_a_wrong_rejection_rule_is_detected(small, s, monkeypatch, capsys):
    """The distribution test has power: a decoder that, at a rejection, draws from p instead of the
    residual max(0, p - q) (a classic mistake: it over-weights the tokens the drafter proposes) fails
    it with p < 0.01. The wrong rule replaces the module attribute that `verify_sampled` calls; a
    counter proves that the decoder went through it."""
    model = small[0]
    calls = []

    def wrong(p, q):
        calls.append(p.shape)
        return p

    monkeypatch.setattr(sampling_module, "residual_distribution", wrong)
    out = decode_draws(small, s)
    assert calls, "the decoder did not call sampling.residual_distribution: the patch had no effect"
    expected = exact_distribution(model, PROMPT, s) * DRAWS
    stat, dof, p = goodness_of_fit(outcome_counts(out, VOCAB), expected)
    with capsys.disabled():
        print(f"\n[{s}] wrong rule: chi2 {stat:.1f}, dof {dof}, p {p:.3g} (0: below 1e-308)")
    assert p < ALPHA, f"a wrong rejection rule passed the distribution test (chi2 {stat:.1f}, dof {dof}, p {p:.3f})"


# ----------------------------------------------------------------------------------------------
# DSpark: drafts chosen left to right through the Markov head


def small_dspark_drafter(folder, block_size: int, seed: int = 1) -> DFlashDrafter:
    """A random 1-layer DSpark drafter (rank 4) whose Markov bias is about as large as the logits:
    each draft's distribution depends on the draft before it."""
    import dataclasses

    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(str(folder), LAYERS, block_size=block_size, drafter_layers=1, mask_token_id=1)
    d = DFlashDrafter(dataclasses.replace(cfg, method="dspark", markov_rank=4, confidence_head=True))
    d.load_frozen_from_target(str(folder))
    with torch.no_grad():
        d.markov_head.markov_w1.weight.normal_(0.0, 1.0)
        d.markov_head.markov_w2.weight.normal_(0.0, 1.5)
    return d.eval()


def dspark_draws(small, s: Sampling):
    model, _, folder = small
    drafter = small_dspark_drafter(folder, BLOCK)
    return StaticDecoder(model, drafter, DRAWS, len(PROMPT), NEW, set(), s).decode([PROMPT] * DRAWS, list(range(DRAWS)))


@pytest.mark.parametrize("s", SETTINGS, ids=["T1", "T0.8-p0.9-k5"])
def test_dspark_sampling_is_distributed_as_the_target(small, s, capsys):
    """As for DFlash: 20,000 decodes of one prompt with a DSpark drafter (block 3: three drafts a
    round, each drawn from the Markov-biased distribution given the draft before it, q of the
    rejection rule) give the first 4 tokens with the target's own joint distribution."""
    model = small[0]
    out = dspark_draws(small, s)
    first_round = np.array([o.accepted[0] for o in out])
    # rejections at once, accepted drafts, and whole blocks (the bonus) all taken
    assert (first_round == 0).mean() > 0.05 and (first_round >= 1).mean() > 0.05, np.bincount(first_round)
    assert (first_round == BLOCK).sum() >= 50, np.bincount(first_round)
    expected = exact_distribution(model, PROMPT, s) * DRAWS
    stat, dof, p = goodness_of_fit(outcome_counts(out, VOCAB), expected)
    with capsys.disabled():
        print(f"\n[{s}] DSpark: chi2 {stat:.1f}, dof {dof}, p {p:.4f}, first round accepted "
              f"{np.bincount(first_round, minlength=BLOCK + 1).tolist()}")
    assert p > ALPHA, f"chi2 {stat:.1f} on {dof} degrees of freedom: p {p:.2e}"


def test_dspark_with_the_unbiased_q_is_detected(small, monkeypatch, capsys):
    """Power: a decoder that draws each draft from the Markov-biased distribution but hands the
    rejection rule the backbone's own distribution (without the bias) as q fails the test."""
    from dflash_offline.drafter import dspark

    right = dspark.draft_chain
    calls = []

    def wrong(h, head_weight, markov, s, seeded, at, anchor, confidence=None):
        calls.append(1)
        drafts, _, *conf = right(h, head_weight, markov, s, seeded, at, anchor, confidence)
        base = torch.nn.functional.linear(h, head_weight.to(h.dtype)).float()
        return drafts, sampling_probs(base, s), *conf

    monkeypatch.setattr(dspark, "draft_chain", wrong)
    s = SETTINGS[0]
    out = dspark_draws(small, s)
    assert calls
    stat, dof, p = goodness_of_fit(outcome_counts(out, VOCAB), exact_distribution(small[0], PROMPT, s) * DRAWS)
    with capsys.disabled():
        print(f"\n[{s}] DSpark, q without the bias: chi2 {stat:.1f}, dof {dof}, p {p:.3g}")
    assert p < ALPHA, f"the wrong q passed the distribution test (chi2 {stat:.1f}, dof {dof}, p {p:.3f})"


def test_verify_sampled_one_slot_distribution():
    """verify_sampled's output alone, without a model: for a draft drawn from q at one slot, the
    committed token (the draft if accepted, else the residual draw) is distributed as p, and drafts
    are accepted with probability sum(min(p, q)), for drafters that agree with p partly, not at all
    (disjoint support) and exactly; the noise is the decoders' keyed noise, a key per row."""
    V, R = 6, 200_000
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    index = torch.zeros(R, 1, dtype=torch.long)
    for i, q in enumerate((torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3]), torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0]), p)):
        seeded = prompt_keys(i, torch.arange(R))  # the decoders' keyed noise, one key per row
        draft = draw(q.expand(R, 1, V), keyed_uniform(seeded, index, DRAFT))
        acc, nxt = verify_sampled(draft, q.expand(R, 1, V), p.expand(R, 2, V), torch.ones(R, dtype=torch.long),
                                  keyed_uniform(seeded, index, ACCEPT), keyed_uniform(seeded, torch.arange(2)[None], TARGET))
        first = torch.where(acc == 1, draft[:, 0], nxt)
        # Accepted with probability sum(min(p, q)), the overlap of the two distributions.
        overlap = float(torch.minimum(p, q).sum())
        assert abs(acc.double().mean().item() - overlap) <= 4 * math.sqrt(overlap * (1 - overlap) / R) + 1e-9
        counts = np.bincount(first.numpy(), minlength=V)
        expected = p.double().numpy() * R
        assert counts[expected == 0].sum() == 0
        _, _, pv = goodness_of_fit(counts, expected)
        assert pv > ALPHA, (q, counts, expected)


# ----------------------------------------------------------------------------------------------
# The same keys, the same tokens, whichever decoder


@pytest.mark.parametrize("eos", [set(), {0}], ids=["no-eos", "eos"])
def test_decoders_agree_token_for_token(small, eos):
    """Sampled with the same keys, the static decoder (3 rows: a batch of 3 and one of 1, rows
    finishing at different rounds with an EOS), the one-prompt decoder and the KV-batched decoder
    give the same tokens and the same accepted drafts per round, for prompts of different lengths
    (fp32); the target alone gives the same tokens in the static decoder and `greedy_decode`. The
    keys (not the batch position) choose the noise: another key gives another output."""
    model, _, folder = small
    drafter = small_drafter(folder, block_size=4, seed=2)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 17, 40, 9)]
    keys = [11, 7, 3, 42]
    max_new = 30
    session = TargetSession(model, LAYERS)
    for s in (Sampling(1.0, seed=3), Sampling(0.8, top_p=0.9, seed=4, top_k=5)):
        one = [speculative_decode(session, DFlashProposer(drafter, "cpu"), p, max_new, eos, s, key=k)
               for p, k in zip(prompts, keys)]
        static = StaticDecoder(model, drafter, 3, 40, max_new, eos, s).decode_all(prompts, keys)
        kv = kv_batched_decode(model, KVBatchDFlashProposer(drafter, "cpu"), LAYERS, prompts, max_new, eos, 3,
                               sampling=s, keys=keys)
        for a, b, c in zip(one, static, kv):
            assert a.tokens == b.tokens == c.tokens
            assert a.accepted == b.accepted == c.accepted
        assert sum(sum(o.accepted) for o in one) > 0, "no draft accepted: the comparison tests no acceptance"
        if eos:
            assert len({len(o.tokens) for o in one}) > 1, "every output ended at the same length"
        alone = [greedy_decode(session, p, max_new, eos, s, key=k) for p, k in zip(prompts, keys)]
        alone_static = StaticDecoder(model, None, 2, 40, max_new, eos, s).decode_all(prompts, keys)
        assert [a.tokens for a in alone] == [b.tokens for b in alone_static]
        other = speculative_decode(session, DFlashProposer(drafter, "cpu"), prompts[2], max_new, eos, s, key=keys[2] + 1)
        assert other.tokens != one[2].tokens


# ----------------------------------------------------------------------------------------------
# Sampling distributions


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference's `dflash.model` module, installed into a temporary folder if needed (as in
    test_reference_parity.py)."""
    try:
        import dflash.model as ref  # noqa: F401
    except ImportError:
        where = tmp_path_factory.mktemp("reference")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                            str(where), "dflash==0.1.0"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            pytest.fail(f"could not install the reference implementation (dflash==0.1.0) with pip:\n{r.stderr[-2000:]}")
        sys.path.insert(0, str(where))
    import dflash.model as ref

    return ref


@pytest.mark.parametrize("temperature, top_p, top_k", [
    (1.0, 1.0, 0), (0.7, 1.0, 0), (1.5, 1.0, 0), (1.0, 0.9, 0), (0.6, 0.5, 0), (1.0, 0.05, 0),
    (1.0, 1.0, 1), (1.0, 1.0, 5), (0.8, 0.9, 5), (1.2, 0.7, 20), (1.0, 0.95, 50), (1.0, 1.0, 64),
])
def test_sampling_probs_equals_the_reference(reference, temperature, top_p, top_k):
    """Temperature, then top-k, then top-p (its first token always kept), renormalised: the same
    probabilities as the reference's `_sampling_probs`, on continuous random logits (no ties at the
    k-th score, where the two keep different tokens), including top-k >= the vocabulary (off)."""
    g = torch.Generator().manual_seed(int(temperature * 100 + top_p * 10 + top_k))
    logits = torch.randn(4, 16, 50, generator=g) * 3
    s = Sampling(temperature, top_p, 0, top_k)
    ours = sampling_probs(logits, s)
    ref = reference._sampling_probs(logits, temperature, top_p, top_k)
    torch.testing.assert_close(ours, ref.float(), atol=1e-6, rtol=1e-5)
    assert torch.allclose(ours.sum(-1), torch.ones(4, 16), atol=1e-5)
    kept = (ours > 0).sum(-1)
    assert (kept >= 1).all()
    if 0 < top_k < 50:
        assert (kept <= top_k).all()


def test_draw_is_the_inverse_cdf():
    """draw picks the token whose cumulative interval holds u times the total (unnormalised probs
    too), never a token of probability 0, and the last token for u near 1."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25]] * 6) * 2  # sums to 2
    u = torch.tensor([1e-12, 0.3, 0.4999, 0.5001, 0.8, 1 - 1e-12], dtype=torch.float64)
    assert draw(probs, u).tolist() == [1, 1, 1, 3, 4, 4]


# ----------------------------------------------------------------------------------------------
# Keyed noise


def test_keyed_uniform_is_a_pure_function_of_its_key():
    """Values lie in (0, 1); the same (seed, prompt key, index, purpose) gives the same value in any
    batch shape or row order; changing any one of them changes the value; prompt keys past 2^40
    (split conversation rows) and near 2^62 work."""
    keys = torch.tensor([0, 1, 2, 1 << 40, (1 << 40) + 1, (1 << 62) + 5])
    index = torch.arange(32)[None].expand(len(keys), -1)
    seeded = prompt_keys(0, keys)
    vals = {purpose: keyed_uniform(seeded, index, purpose) for purpose in (DRAFT, ACCEPT, TARGET)}
    stacked = torch.stack(list(vals.values()))
    assert stacked.dtype == torch.float64
    assert ((stacked > 0) & (stacked < 1)).all()
    # Every value distinct: across purposes, indices and keys.
    assert stacked.unique().numel() == stacked.numel()
    # Another seed: other values.
    assert not torch.isin(keyed_uniform(prompt_keys(1, keys), index, TARGET), stacked).any()
    # Deterministic, whatever the batch: one row alone, rows reversed, one index.
    assert torch.equal(keyed_uniform(prompt_keys(0, keys), index, DRAFT), vals[DRAFT])
    assert torch.equal(keyed_uniform(prompt_keys(0, keys[3:4]), index[3:4], ACCEPT), vals[ACCEPT][3:4])
    assert torch.equal(keyed_uniform(prompt_keys(0, keys.flip(0)), index, TARGET), vals[TARGET].flip(0))
    assert keyed_uniform(prompt_keys(0, keys[5:6]), torch.tensor([7]), TARGET).item() == vals[TARGET][5, 7].item()


def test_unit_noise_never_reaches_one():
    """The extreme hashes map strictly inside (0, 1) (every hash is reachable: splitmix64's mixer is
    a bijection), so a draw never lands on a token of probability 0 at the end of the vocabulary."""
    from dflash_offline.sampling import _to_unit

    u = _to_unit(torch.tensor([0, -1, -2048, (1 << 63) - 1]))
    assert ((u > 0) & (u < 1)).all(), u.tolist()
    assert draw(torch.tensor([[0.5, 0.5, 0.0]]).expand(4, 3), u).max() < 2


def test_keyed_uniform_is_uniform_and_uncorrelated():
    """100,000 values (1,000 keys x 100 indices) fill 100 equal bins as a uniform sample would
    (chi-square p > 0.001), their Kolmogorov-Smirnov distance stays under the 1% critical value,
    and neighbouring keys, indices and purposes are uncorrelated."""
    keys = torch.arange(1000)
    index = torch.arange(100)[None].expand(1000, -1)
    seeded = prompt_keys(0, keys)
    u = keyed_uniform(seeded, index, TARGET)
    flat = np.sort(u.reshape(-1).numpy())
    n = flat.size
    counts = np.bincount((flat * 100).astype(np.int64), minlength=100)
    _, _, p = goodness_of_fit(counts, np.full(100, n / 100))
    assert p > 0.001, counts
    grid = np.arange(1, n + 1) / n
    ks = max((grid - flat).max(), (flat - (grid - 1 / n)).max())
    assert ks < 1.628 / math.sqrt(n), ks
    a = keyed_uniform(seeded, index, ACCEPT)
    for x, y in ((u[:-1], u[1:]), (u[:, :-1], u[:, 1:]), (u, a)):
        r = np.corrcoef(x.reshape(-1).numpy(), y.reshape(-1).numpy())[0, 1]
        assert abs(r) < 0.015, r
