"""Token ids as text where people look: `inspect --text` (a sample's trained spans), `eval --show`
(where the drafter was right), `open_cache(...).sample(i).text()`.

The tokenizer is the target's `tokenizer.json`, read with the `tokenizers` library alone (no torch,
no transformers: `inspect` stays light). Tokens are decoded span by span, one maximal run of equally
marked tokens at a time, so a character split over several tokens inside a run comes out whole,
and special tokens are shown (`skip_special_tokens=False`). A run is marked with ANSI colour on a
terminal and with visible brackets elsewhere (a pipe, a file, a notebook).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dflash_offline.runtime.errors import UserError

TRAINED_MARKS = ("[[", "]]")  # inspect --text and Sample.text(): the trained spans (loss_mask 1)
ACCEPTED_MARKS = ("{{", "}}")  # eval --show: the drafts a verify round accepted
ANSI_ON, ANSI_OFF = "\x1b[30;42m", "\x1b[0m"  # black on green


def load_tokenizer(where: str | os.PathLike, fix: str, what: str = ""):
    """A `tokenizers.Tokenizer` from a model folder's tokenizer.json (or that file itself); a missing
    or unreadable one is one line naming the path (and `what` it is) and `fix` (the option that gives
    another)."""
    p = Path(where)
    f = p if p.is_file() else p / "tokenizer.json"
    if not f.is_file():
        raise UserError(f"no tokenizer at {f}{f' ({what})' if what else ''}; {fix}")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # the Rust side raises plain Exceptions for a malformed file
        raise UserError(f"{f}: not a readable tokenizer.json ({type(e).__name__}: {e}); {fix}") from None


def decode_spans(tokenizer, ids, flags) -> list[tuple[str, bool]]:
    """[(text, flag)] of each maximal run of tokens with the same flag, each run decoded on its own
    (special tokens shown): the runs' texts joined are the whole text, up to what a decoder does at
    a run's edges (a character whose bytes straddle two runs comes out as replacement marks)."""
    ids = [int(t) for t in ids]
    flags = [bool(f) for f in flags]
    if len(ids) != len(flags):
        raise ValueError(f"{len(ids)} tokens but {len(flags)} flags")
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or flags[k] != flags[start]:
            out.append((tokenizer.decode(ids[start:k], skip_special_tokens=False), flags[start]))
            start = k
    return out


def render(spans: list[tuple[str, bool]], marks: tuple[str, str] | None = TRAINED_MARKS) -> str:
    """The spans as plain text, each marked span between marks[0] and marks[1] (None: unmarked)."""
    if marks is None:
        return "".join(t for t, _ in spans)
    a, b = marks
    return "".join(f"{a}{t}{b}" if m else t for t, m in spans)


def render_ansi(spans: list[tuple[str, bool]]) -> str:
    """The spans for a terminal: marked ones in colour, closed and reopened around line breaks (a
    background left on across a break paints the rest of the line in some terminals)."""
    return "".join(ANSI_ON + t.replace("\n", f"{ANSI_OFF}\n{ANSI_ON}") + ANSI_OFF if m else t for t, m in spans)


def use_color(color: bool | None = None, stream=None) -> bool:
    """colour if asked (True/False), else when the stream (stdout) is a terminal and NO_COLOR is not set."""
    if color is not None:
        return color
    isatty = getattr(sys.stdout if stream is None else stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def accepted_flags(n_out: int, accepted: list[int]) -> list[bool]:
    """Which of a decode's n_out output tokens were accepted drafts: the first comes from the
    prompt's forward (the target's), then each verify round commits its accepted drafts and one
    token of the target's; the output may end inside the last round (--max-new-tokens, an
    end-of-sequence token among the drafts)."""
    flags = [False]
    for a in accepted:
        flags += [True] * int(a) + [False]
    return flags[:n_out]


def show_tokenizer(target: str, show: int):
    """eval --show N's tokenizer, from the --target folder (None when N is 0): refused in one line
    before anything loads."""
    if not show:
        return None
    return load_tokenizer(target, f"--show {show} decodes with the target's tokenizer: give a --target folder that "
                          "holds tokenizer.json, or leave --show out", "the --target folder")


def show_decoded(tokenizer, drafter: str, ids: list[int], prompts: list[list[int]], runs, show: int) -> None:
    """eval --show: print the first `show` prompts and their decodes (`Decoded`: tokens, accepted
    per round) by one drafter, each round's accepted drafts marked."""
    color = use_color()
    for k in range(min(show, len(runs)) if tokenizer is not None else 0):
        lines = format_decoded(tokenizer, f"{drafter}, prompt {ids[k]}", prompts[k], runs[k].tokens, runs[k].accepted,
                               color)
        print("\n".join(lines), flush=True)


def format_decoded(tokenizer, label: str, prompt: list[int], out: list[int], accepted: list[int],
                   color: bool) -> list[str]:
    """eval --show's lines for one prompt: a header, the prompt as text, the output with each
    round's accepted drafts marked (colour, or ACCEPTED_MARKS)."""
    spans = decode_spans(tokenizer, out, accepted_flags(len(out), accepted))
    # The reference's count: every output token after the prefill's first is committed by a round.
    tau = f", tau {(len(out) - 1) / len(accepted):.2f}" if accepted else ""
    how = "in green" if color else "between {} and {}".format(*ACCEPTED_MARKS)
    return [f"--- {label}: {len(out)} tokens in {len(accepted)} rounds{tau}; accepted drafts {how}",
            "prompt: " + tokenizer.decode([int(t) for t in prompt], skip_special_tokens=False),
            "output: " + (render_ansi(spans) if color else render(spans, ACCEPTED_MARKS))]
