"""What `eval` reports, typed: the decode's set-up, the target alone, and each drafter's figures.

`run.py` fills an EvalReport as it goes (each step returns its part: a Baseline, a DecodeSummary,
a DrafterResult's fields), `format_report` prints it, and `to_json()` writes the `--json` file:
one flat object per drafter, as readers of that file (benchmarks, outside checks) have always
read it; a figure that was not measured is left out, not written as null. The cache's figures
(`cache_walk`, `cache_estimate`, `parity`) are the dicts their own modules return.

No torch here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from dflash_offline.evaluate.verdicts import VERDICTS, Divergence
from dflash_offline.runtime.paths import REPORT_FORMAT
from dflash_offline.sampling import Sampling


def _present(obj) -> dict:
    """A dataclass's fields as JSON, those that are None left out."""
    return {f.name: getattr(obj, f.name) for f in fields(obj) if getattr(obj, f.name) is not None}


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
        out = _present(self)
        if self.confidence is not None:
            out["confidence"] = asdict(self.confidence)
        return out


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
        out = {k: v for k, v in _present(self).items() if k not in ("decode", "divergences", "implied")}
        if self.decode is not None:
            out.update(self.decode.to_json())
        if self.divergences is not None:
            out["divergences"] = [d.as_dict() for d in self.divergences]
            out["divergence_verdicts"] = self.divergence_verdicts
        if self.implied is not None:
            out["implied"] = asdict(self.implied)
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
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "sampling": asdict(self.sampling)}


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
