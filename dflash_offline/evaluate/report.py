"""What `eval` reports, typed: the decode's set-up, the target alone, and each drafter's figures.

`run.py` fills an EvalReport as it goes (each step returns its part: a Baseline, a DecodeSummary,
a DrafterResult's fields), `format_report` writes it as the command prints it, and `to_json()` writes the `--json` file:
one flat object per drafter, as readers of that file (benchmarks, outside checks) have always
read it; a figure that was not measured is left out, not written as null. The cache's figures
(`cache_walk`, `cache_estimate`, `parity`) are the dicts their own modules return.

No torch here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dflash_offline.evaluate.verdicts import VERDICTS, Divergence, divergence_lines
from dflash_offline.runtime.paths import REPORT_FORMAT
from dflash_offline.sampling import Sampling


def _present(obj) -> dict:
    """A dataclass as JSON (nested dataclasses as objects), the fields that are None left out."""
    return {k: v for k, v in asdict(obj).items() if v is not None}


@dataclass
class Confidence:
    """A DSpark confidence head's calibration per draft slot: its mean predicted survival against the
    observed share of verified slots accepted, and how many slots were verified."""

    predicted: list[float]
    observed: list[float]
    verified: list[int]


@dataclass
class DecodeSummary:
    """One decode of a set of prompts, counted as the reference counts tau: new tokens committed by
    verify rounds / verify rounds, pooled over every round of every prompt (`tau`), and the mean of
    each prompt's own (`tau_per_prompt_mean`)."""

    rounds: int
    tokens: int  # new tokens written
    committed: int  # new tokens committed by verify rounds (the prefill's first token is no round's)
    seconds: float
    tokens_per_s: float
    tau: float
    tau_per_prompt_mean: float
    tau_per_prompt: list[float]
    accept_rate: list[float]  # share of rounds in which draft slot j (1..) was accepted
    target_forwards: int
    confidence: Confidence | None = None

    def to_json(self) -> dict:
        return _present(self)


@dataclass
class Baseline:
    """The target alone through the same decoder and batches: the speed-up's denominator."""

    tokens: int
    seconds: float
    tokens_per_s: float
    target_forwards: int
    mismatched_reference_ids: list[int] | None = None  # with --reference: prompts whose own decode differs from it

    def to_json(self) -> dict:
        return _present(self)


@dataclass
class Implied:
    """--implied-for: the speed-up a decoded tau implies at a named shape's measured kernel times."""

    shape: str
    speedup: float
    line: str


@dataclass
class DrafterResult:
    """One drafter's figures: its decode of the prompts and what was checked of it, and its figures
    on the cache."""

    path: str
    block_size: int
    decode: DecodeSummary | None = None
    accepted_per_prompt: list[list[int]] | None = None  # each round's accepted drafts, in prompt_ids' order
    committed_per_prompt: list[list[int]] | None = None  # each round's committed new tokens
    speedup: float | None = None
    lossless: bool | None = None  # None: not checked (no reference, or sampling)
    mismatched_prompt_ids: list[int] | None = None
    divergences: list[Divergence] | None = None  # where differing outputs part from the reference, and why
    implied: Implied | None = None
    cache_walk: dict | None = None
    cache_estimate: dict | None = None
    parity: dict | None = None

    @property
    def divergence_verdicts(self) -> dict[str, int]:
        return {v: sum(d.verdict == v for d in self.divergences or []) for v in VERDICTS}

    def to_json(self) -> dict:
        out = _present(self)
        if self.decode is not None:  # the decode's figures stand in the drafter's object
            out.update(self.decode.to_json())
            del out["decode"]
        if self.divergences is not None:
            out["divergence_verdicts"] = self.divergence_verdicts
        return out


@dataclass
class DecodeSetup:
    """What the prompts were decoded with."""

    prompts: str
    num_prompts: int
    max_new_tokens: int
    eos: list[int]
    hybrid_target: bool
    prompt_ids: list[int]
    lossless_against: str | None  # a --reference file, "baseline" (its own target-alone decode), or None
    decoder: str
    decoding: str  # the decoder path in words
    batch_size: int
    sampling: Sampling

    def to_json(self) -> dict:
        return asdict(self)  # every field, None included: lossless_against None says "not checked"


@dataclass
class EvalReport:
    target: str
    device: str
    dtype: str
    torch: str
    drafters: list[DrafterResult] = field(default_factory=list)
    decode: DecodeSetup | None = None
    baseline: Baseline | None = None
    cache: str | None = None

    def failed(self) -> bool:
        """A check that failed: outputs not equal to the target's, or a --parity disagreement (the
        command then exits 1, after the report and its JSON)."""
        return any(d.lossless is False or (d.parity is not None and not d.parity.get("agree", True))
                   for d in self.drafters)

    def to_json(self) -> dict:
        out = {"format": REPORT_FORMAT, "target": self.target, "device": self.device, "dtype": self.dtype,
               "torch": self.torch}
        if self.decode is not None:
            out.update(self.decode.to_json())
        if self.baseline is not None:
            out["baseline"] = self.baseline.to_json()
        if self.cache is not None:
            out["cache"] = self.cache
        out["drafters"] = [d.to_json() for d in self.drafters]
        return out


FEW_PROMPTS = 8  # below this many prompts the report says its speed-up means little


def format_report(report: EvalReport) -> str:
    lines = []
    setup, base = report.decode, report.baseline
    if setup is not None:
        s, against = setup.sampling, setup.lossless_against
        checked = ("" if s.temperature else "; no baseline (not checked)" if not against else "" if against == "baseline"
                   else f"; lossless (against {against})" + ("" if base else ", no baseline decode (no speed-up)"))
        how = ("greedy" if not s.temperature else f"sampling at temperature {s.temperature}"
               + (f", top-p {s.top_p}" if s.top_p < 1.0 else "") + (f", top-k {s.top_k}" if s.top_k else "")
               + f", seed {s.seed} (checked by distribution in the tests, not token by token)")
        lines.append(f"speculative decoding: {setup.num_prompts} prompts, up to {setup.max_new_tokens} new tokens, "
                     f"{how}, {report.dtype} on {report.device}, {setup.decoding}"
                     + (f"; target alone {base.tokens_per_s:.1f} tokens/s" if base else "") + checked)
        lines.append("tau: new tokens committed per verify round, pooled over all rounds (/prompt: the mean of each "
                     "prompt's own); the reference implementation's count")
        lines.append(f"{'drafter':<40} {'block':>5} {'tau':>6} {'/prompt':>7} {'rounds':>7} {'tok/s':>8} {'speedup':>7} "
                     f"{'lossless':>8}")
        for e in report.drafters:
            dec = e.decode
            if dec is None:
                continue
            lossless = "-" if e.lossless is None else ("yes" if e.lossless else f"NO ({len(e.mismatched_prompt_ids)})")
            speed = f"{e.speedup:.2f}x" if e.speedup is not None else "-"
            lines.append(f"{_short(e.path):<40} {e.block_size:>5} {dec.tau:>6.3f} {dec.tau_per_prompt_mean:>7.3f} "
                         f"{dec.rounds:>7} {dec.tokens_per_s:>8.1f} {speed:>7} {lossless:>8}")
            lines.append("  accepted per slot: " + " ".join(f"{a:.2f}" for a in dec.accept_rate))
            if dec.confidence is not None:  # a DSpark drafter's confidence head
                c = dec.confidence
                lines.append("  confidence head, predicted / observed survival per slot: " + " ".join(
                    f"{p:.2f}/{o:.2f}" for p, o in zip(c.predicted, c.observed)))
            if e.implied is not None:
                lines.append("  " + e.implied.line)
            lines += divergence_lines(e.divergences, e.divergence_verdicts, len(e.mismatched_prompt_ids or []))
        if base and setup.num_prompts < FEW_PROMPTS and any(e.speedup is not None for e in report.drafters):
            lines.append(f"note: {setup.num_prompts} prompt(s), {base.seconds:.1f} s for the target alone: start-up "
                         "and warm-up dominate times this short, so the speed-up says little; decode a few dozen "
                         "prompts to measure it")
    if any(e.cache_walk is not None or e.cache_estimate is not None for e in report.drafters):
        lines.append(f"estimate from the cache {report.cache}:")
        lines.append("  walk: tau over the blocks decoding would draft, pooled over rounds (/sample: mean of the "
                     "samples' taus); every: over all anchors; random: over random anchors of packed rows")
        lines.append(f"{'drafter':<40} {'block':>5} {'walk':>6} {'/sample':>7} {'rounds':>7} {'every':>6} "
                     f"{'random':>6} {'blocks':>7}  slot accuracy")
        for e in report.drafters:
            walk, est = e.cache_walk or {}, e.cache_estimate or {}
            num = lambda d, k, f: format(d[k], f) if k in d else "-"  # noqa: E731
            lines.append(f"{_short(e.path):<40} {e.block_size:>5} {num(walk, 'tau_pooled', '6.3f'):>6} "
                         f"{num(walk, 'tau_per_prompt_mean', '7.3f'):>7} {num(walk, 'rounds', 'd'):>7} "
                         f"{num(walk, 'tau_all_anchors', '6.3f'):>6} {num(est, 'tau', '6.3f'):>6} "
                         f"{num(est, 'blocks', 'd'):>7}  "
                         + " ".join(f"{a:.2f}" for a in (walk or est).get("slot_accuracy", [])[:8]))
    for e in report.drafters:
        if e.parity is not None:
            lines += format_parity(_short(e.path), e.parity)
    return "\n".join(lines)


def _short(path: str, width: int = 40) -> str:
    return path if len(path) <= width else "..." + path[-(width - 3):]


def format_parity(path: str, p: dict) -> list[str]:
    """--parity's lines (evaluate/parity.py's figures): the three taus, and the causes it names."""
    lines = [f"parity of {path} on {p['samples']} held-out samples (tau pooled over rounds):",
             f"  every anchor {p['every_anchor_tau']:.3f}   walk {p['walk_tau']:.3f}   decoding {p['decoding_tau']:.3f}"
             f"   ({100 * p['relative_gap']:+.1f}% decoding vs walk; {p['same_rounds_samples']}/{p['samples']} samples "
             f"with identical rounds; lossless {'yes' if p['lossless'] else 'NO'})"]
    if p["agree"]:
        lines.append(f"  consistent: decoding is within {100 * p['tolerance']:.0f}% of the walk")
        lines += [f"  but: {c}" for c in p["causes"]]  # a train-to-serve gap the tau does not show (yet)
    else:
        lines.append(f"  DISAGREE (more than {100 * p['tolerance']:.0f}%): likely cause(s):")
        lines += [f"    - {c}" for c in p["causes"]]
    return lines
