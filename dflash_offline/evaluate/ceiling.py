"""The speed-up a tau implies on a big target: kernel times of one measured target shape, and the formula.

`eval` measures tau and the speed-up on the target it runs, often a small one on a host where
every forward is bound by kernel launches. What the same tau buys on a big target served without
launch overhead follows from three kernel times, measured once per target shape by
`benchmarks/decode_speed.py --ceiling` (torch.profiler device time, random weights: the time of a
forward does not depend on its weights' values):

    t_1      one target forward over 1 new token after a cached context (the target alone, per token)
    t_B      one target forward over B new tokens after the same context (a verify round)
    t_draft  one drafter forward drafting a block of B over that context (embedding, layers, LM head)

A speculative round costs t_draft + t_B and commits tau tokens on average; the target alone
costs t_1 per token. So

    implied speed-up = tau * t_1 / (t_draft + t_B)        ceiling (every draft accepted, tau = B):
                                                           B * t_1 / (t_draft + t_B)

Assumed: launch overhead removed (CUDA graphs, as a serving engine runs its forwards), and a
verify that leaves the target's cache at the accepted length (engines that keep the recurrent
state per draft position do; eval's hybrid decoder instead runs the target again after a
rejection, which this leaves out). Neglected: the drafter's context update (its keys/values for
the newly committed positions: a table entry records its time as `draft_context_ms`, to show
its size), capturing and concatenating the target's features, and the acceptance bookkeeping
(argmax, comparison, cache cut). docs/evaluation.md, "Implied speed-up on a big target".

The table of measured shapes is `ceilings.json` beside this module; `decode_speed.py --ceiling
--out FILE` writes a file `load_shapes` reads too. No torch here.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from dflash_offline.runtime.errors import UserError

TABLE = Path(__file__).with_name("ceilings.json")
MEASURE_HINT = "measure one with benchmarks/decode_speed.py --ceiling"


@dataclass(frozen=True)
class MeasuredShape:
    """Kernel times of one target shape with its recipe's drafter, on one device, in one dtype."""

    name: str
    """What `eval --implied-for` names, e.g. "qwen3.6-27b"."""
    description: str
    """The target and drafter shapes in words (layers, widths, weights), and how the times were taken."""
    hardware: str
    """The device, e.g. "NVIDIA H200"."""
    dtype: str
    """The weights' and activations' dtype, e.g. "bfloat16"."""
    block_size: int
    """B: tokens per verify forward and per drafted block."""
    context: int
    """Tokens in the target's and the drafter's cache before the timed forwards."""
    target_1_ms: float
    """t_1: one target forward over 1 new token (LM head included)."""
    target_block_ms: float
    """t_B: one target forward over B new tokens (LM head over all B included)."""
    draft_ms: float
    """t_draft: one drafter forward of a block of B over the cached context, LM head over its B - 1 drafts."""
    timing: str = "kernel"
    """"kernel": device time of the kernels (torch.profiler), what a forward costs without launch
    overhead; "wall": host wall time (no profiler: a CPU smoke run), not a serving engine's cost."""
    command: str = ""
    """The command that measured it."""
    draft_context_ms: float | None = None
    """The drafter's context update for B newly committed positions (an upper bound of a round's):
    not in the formula, recorded to show how small it is."""
    extrapolated_from_layers: list[int] | None = None
    """None: the target was measured with all its layers. [n, 2n]: target times measured with n and
    2n layers and extended linearly in the layer count to all of them (`extend_to_layers`)."""
    verify_priced: str | None = None
    """None: t_B measured at this block size. Else how `verify_width_shape` priced it from other widths."""

    def __post_init__(self) -> None:
        for f in ("target_1_ms", "target_block_ms", "draft_ms"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{self.name}: {f} must be a positive number of milliseconds, got {v!r}")
        if not (isinstance(self.block_size, int) and self.block_size >= 2):
            raise ValueError(f"{self.name}: block_size must be an integer >= 2, got {self.block_size!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def implied_speedup(tau: float, shape: MeasuredShape) -> float:
    """tau * t_1 / (t_draft + t_B): the decode speed-up over the target alone at batch 1 that a
    drafter committing tau tokens per verify round (eval's tau) gives on `shape`, when every forward
    costs only its kernels (launch overhead removed: CUDA graphs) and the drafter's context update,
    feature capture and acceptance bookkeeping are neglected (see the module docstring)."""
    if not (math.isfinite(tau) and 1 <= tau <= shape.block_size):
        raise ValueError(f"tau {tau}: a round commits between 1 and the block size ({shape.block_size}) tokens")
    return tau * shape.target_1_ms / (shape.draft_ms + shape.target_block_ms)


def ceiling_speedup(shape: MeasuredShape) -> float:
    """B * t_1 / (t_draft + t_B): the implied speed-up of a perfect drafter (every draft accepted)."""
    return implied_speedup(shape.block_size, shape)


def extend_to_layers(t_small: float, t_large: float, small: int, large: int, total: int) -> float:
    """A forward's time with `total` layers from its times with `small` and `large` layers: linear in
    the layer count through both points (the embedding and LM head are the intercept, not scaled)."""
    if not 0 < small < large <= total:
        raise ValueError(f"layers: need 0 < {small} < {large} <= {total}")
    return t_small + (total - small) * (t_large - t_small) / (large - small)


def verify_width_shape(shape: MeasuredShape, width: int, shapes: list[MeasuredShape],
                       option: str = "--implied-for") -> MeasuredShape:
    """`shape` priced for a verify forward of `width` tokens: a DSpark drafter of block B drafts B
    tokens a round, so its round verifies B + 1 (the anchor and B drafts) where DFlash's verifies
    B, and commits up to B + 1. t_width comes from the verify times measured for the same target
    (same description, hardware, dtype, context and timing: the records of one `--block-sizes`
    run), linear in the width between the two nearest measured widths, or through the two largest
    for one token past them (B + 1 past the largest B measured). The drafter's time stays t_draft
    of the shape's block: its forward covers B positions either way (DSpark's Markov head adds a
    rank-r product per slot, neglected like the bookkeeping). -> a shape whose block_size is `width`."""
    if width == shape.block_size:
        return shape
    target = lambda s: (s.description, s.hardware, s.dtype, s.context, s.timing, s.target_1_ms)  # noqa: E731
    points = sorted({s.block_size: s.target_block_ms for s in shapes if target(s) == target(shape)}.items())
    widths = [w for w, _ in points]
    if len(points) < 2 or not widths[0] <= width <= widths[-1] + 1:
        raise UserError(f"{option} {shape.name}: a verify of {width} tokens is not priced (measured widths of this target: "
                        f"{', '.join(map(str, widths))}); measure it with benchmarks/decode_speed.py --ceiling "
                        f"--block-sizes {shape.block_size},{width}")
    exact = dict(points).get(width)
    if exact is None:
        (w0, t0), (w1, t1) = next(((a, b) for a, b in zip(points, points[1:]) if a[0] <= width <= b[0]), points[-2:])
        exact = t0 + (width - w0) * (t1 - t0) / (w1 - w0)
        how = "interpolated" if width <= widths[-1] else "extrapolated by one token"
        priced = f"verify of {width} tokens {how} from widths {w0} and {w1}"
    else:
        priced = f"verify of {width} tokens measured"
    return MeasuredShape(**{**shape.to_dict(), "block_size": width, "target_block_ms": exact, "verify_priced": priced})


# ----------------------------------------------------------------------------------------------
# The table


def _entries(data, where: str) -> list:
    """The list of shape records in a table ({"shapes": [...]}) or a decode_speed.py --out file
    ({"ceiling": {"shapes": [...]}})."""
    if isinstance(data, dict) and isinstance(data.get("ceiling"), dict):
        data = data["ceiling"]
    if isinstance(data, dict) and "shapes" in data:
        data = data["shapes"]
    if not isinstance(data, list):
        raise UserError(f"{where}: no list of measured shapes (a {{\"shapes\": [...]}} table, or the --out file of "
                        "benchmarks/decode_speed.py --ceiling)")
    return data


def load_shapes(path: str | Path | None = None) -> list[MeasuredShape]:
    """The measured shapes of the committed table (`ceilings.json` beside this module), or of `path`:
    a table of the same form or what `decode_speed.py --ceiling --out FILE` wrote."""
    p = Path(path) if path is not None else TABLE
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{p}: no such file of measured target shapes") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{p}: not a readable JSON table of measured target shapes ({e})") from None
    known = {f.name for f in fields(MeasuredShape)}
    required = {f.name for f in fields(MeasuredShape) if f.default is MISSING}
    out = []
    for i, entry in enumerate(_entries(data, str(p))):
        if not isinstance(entry, dict):
            raise UserError(f"{p}: shape {i} is not an object")
        missing = sorted(required - entry.keys())
        if missing:
            raise UserError(f"{p}: shape {i} ({entry.get('name', 'unnamed')}) has no {', '.join(missing)}")
        try:  # fields a later version adds are ignored
            out.append(MeasuredShape(**{k: v for k, v in entry.items() if k in known}))
        except (TypeError, ValueError) as e:
            raise UserError(f"{p}: shape {i}: {e}") from None
    return out


def find_shape(name: str, path: str | Path | None = None, option: str = "--implied-for") -> MeasuredShape:
    """The measured shape called `name` (case-insensitive) in the table (see load_shapes)."""
    shapes = load_shapes(path)
    for s in shapes:
        if s.name.lower() == name.strip().lower():
            return s
    known = ", ".join(s.name for s in shapes) or "none yet"
    raise UserError(f"{option} {name}: no measured target shape of that name in {Path(path or TABLE).name}; "
                    f"known: {known}; {MEASURE_HINT}")


def format_implied(tau: float, shape: MeasuredShape, drafter_block_size: int | None = None) -> str:
    """One report line, e.g. "implied on qwen3.6-27b (NVIDIA H200, bfloat16, kernel times, context
    1024): 3.41x at tau 5.20 (ceiling at tau = 16: 7.9x)"; `drafter_block_size`, when it differs from
    the measured shape's, is named (the times are for the shape's block size)."""
    head = f"implied on {shape.name} ({shape.hardware}, {shape.dtype}, {shape.timing} times, context {shape.context})"
    if not math.isfinite(tau) or tau < 1:
        return f"{head}: no tau to scale"
    speed = implied_speedup(min(tau, shape.block_size), shape)
    line = (f"{head}: {speed:.2f}x at tau {tau:.2f} (ceiling at tau = {shape.block_size}: "
            f"{ceiling_speedup(shape):.1f}x)")
    if "WITHOUT" in shape.description:  # measured without a fast kernel: say so where the figure is read
        line += "; " + shape.description[shape.description.index("WITHOUT"):]
    if shape.extrapolated_from_layers:
        line += f"; target times extended from {' and '.join(map(str, shape.extrapolated_from_layers))} layers"
    if shape.verify_priced:
        line += "; " + shape.verify_priced
    if drafter_block_size is not None and drafter_block_size != shape.block_size:
        line += (f"; measured for blocks of {shape.block_size}, this drafter drafts blocks of {drafter_block_size}: "
                 f"measure that block size (decode_speed.py --ceiling --block-sizes {drafter_block_size})")
    return line
