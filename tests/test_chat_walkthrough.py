"""docs/own-data.md's chat walk-through, run as written on the CPU: a tiny chat target made by
`demo --chat`, then prepare -> generate -> extract -> train --method dspark -> export -> eval.

What it checks is what a newcomer would: every command succeeds, the target's replies end at the
template's end of turn (none runs to the limit, no conversation is cut short), the cache's rows
train only on what the assistant wrote, and the drafter decodes losslessly and better than a
drafter that proposes nothing (tau > 1.5)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pyarrow.parquet as pq

from conftest import run_cli
from dflash_offline.tiny_chat import WALK_THROUGH

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## A walk-through on a CPU"


def _doc_commands() -> list[list[str]]:
    text = (ROOT / "docs" / "own-data.md").read_text()
    sec = text[text.index(SECTION):]
    block = re.search(r"```bash\n(.*?)```", sec, re.S).group(1)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_doc_block_is_what_demo_chat_prints():
    """The commands `demo --chat` prints after making the target are the documented ones."""
    doc = _doc_commands()
    printed = [shlex.split(line) for line in WALK_THROUGH.format(o="runs/chat").replace("\\\n", " ").splitlines()]
    assert doc[0] == ["dflash-offline", "demo", "--chat", "--out", "runs/chat"]
    assert doc[1:] == printed


def test_chat_walkthrough_runs_as_written(tmp_path):
    outputs = {}
    for cmd in _doc_commands():
        assert cmd[0] == "dflash-offline", cmd
        r = run_cli([*cmd[1:], "--no-progress"] if cmd[1] in ("generate", "extract", "train", "eval") else cmd[1:],
                    cwd=tmp_path, timeout=300)
        assert r.returncode == 0, f"{shlex.join(cmd)}\n{r.stdout}\n{r.stderr}"
        outputs[cmd[1]] = r.stdout + r.stderr
    chat = tmp_path / "runs" / "chat"
    # demo --chat printed the rest of the walk-through
    assert "dflash-offline prepare --target runs/chat/target" in outputs["demo"]
    # generate: every reply ended at <|im_end|>, every turn written, none cut short
    m = json.loads((chat / "completions" / "manifest.json").read_text())
    assert m["status"] == "complete"
    assert "cut short" not in outputs["generate"], outputs["generate"]
    rows = [r for f in sorted((chat / "completions").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert rows
    ended = re.search(r"(\d+) new tokens \((\d+) ended by end-of-sequence\)", outputs["generate"])
    assert ended is not None, outputs["generate"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat / "target")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    n_replies = 0
    for r in rows:
        ids, mask = r["input_ids"], r["loss_mask"]
        # each trained span is one reply: it ends with <|im_end|> and what precedes it is the
        # template's assistant header
        spans, start = [], None
        for i, v in enumerate(mask + [0]):
            if v and start is None:
                start = i
            elif not v and start is not None:
                spans.append((start, i))
                start = None
        for a, b in spans:
            assert ids[b - 1] == end, tok.decode(ids[a:b])
            assert tok.decode(ids[:a]).endswith("<|im_start|>assistant\n"), tok.decode(ids[:a])
            assert re.fullmatch(r"[0-9 ]+", tok.decode(ids[a:b - 1])), tok.decode(ids[a:b])
        n_replies += len(spans)
    assert int(ended.group(2)) == n_replies
    # eval: lossless, and the drafter proposes tokens the target keeps
    line = next(x for x in outputs["eval"].splitlines() if x.startswith("runs/chat/drafter/export"))
    cols = line.split()
    assert cols[-1] == "yes", outputs["eval"]
    assert float(cols[2]) > 1.5, outputs["eval"]
