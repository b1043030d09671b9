"""`prepare --responses keep` masks against an independent oracle: transformers' own
`apply_chat_template(..., return_assistant_tokens_mask=True)` on the same template with
`{% generation %}` markers, for 1000 random conversations in each input format (1-6 turns, with and
without a system turn, tool calls and results, reasoning, empty content, non-ASCII, long), on a
ChatML template and on a Qwen3-style template of our own (earlier turns' <think> content dropped,
`enable_thinking` read), with tokenizers built here: one holding the ChatML markers as special
tokens, and two where <|im_end|> is ordinary text split into several tokens (as in the pycode
fixture), the newline after it a token of its own or merged with it (`.<|im_end|>\n`): the end of
turn is the template's text there, not an end-of-sequence token, and the newline stays untrained.

On ChatML a conversation is one row and must equal the oracle's rendering of the whole conversation,
ids and mask. On the Qwen3-style template the conversation's context changes from turn to turn, so
a row holds one turn (or several that render as a prefix of the next): each trained turn's tokens
must be exactly the oracle's rendering of the conversation up to that turn, and the row's mask the
union of the oracle's marks on those turns.
"""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import _chat
from conftest import run_cli

N = 1000
# The tokenizers whose end of turn is not one special token: a quarter as many records (the rule
# they test is about each reply's last tokens, met in every record; the suite stays within its time).
N_OTHER_MARKERS = 250


@pytest.fixture(scope="module")
def chat_targets(tiny_dense, tmp_path_factory):
    """markers ("special", "split", "merged": _chat.make_tokenizer) -> a chat target, made when asked."""
    made: dict[str, object] = {}

    def get(markers: str):
        if markers not in made:
            made[markers] = _chat.make_chat_target(tiny_dense, tmp_path_factory.mktemp("chat") / markers,
                                                   markers=markers)
        return made[markers]
    return get


def _records(fmt: str, rng: random.Random, n: int = N) -> tuple[list[dict], list[list[dict]]]:
    """(records written in `fmt`, the messages each one means, as the oracle is given them)."""
    records, meant = [], []
    for i in range(n):
        if fmt == "messages":
            msgs = _chat.random_conversation(rng)
            records.append({"id": i, "messages": msgs})
        elif fmt == "sharegpt":
            msgs = _chat.random_conversation(rng, tools=False, reasoning=False)
            if rng.random() < 0.1:  # a tool result turn (ShareGPT's "tool"/"observation" speakers)
                msgs.insert(2 if msgs[0]["role"] != "system" else 3, {"role": "tool", "content": "42"})
                msgs.insert(3 if msgs[0]["role"] != "system" else 4, {"role": "assistant", "content": "ok"})
            records.append({"id": f"conv-{i}", "conversations": _chat.to_sharegpt(msgs)})
        else:
            prompt, reply = _chat._text(rng) or "?", _chat._text(rng, long=rng.random() < 0.05)
            if rng.random() < 0.5:
                records.append({"id": i, "prompt": prompt, "response": reply})
                msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
            else:
                extra = _chat._text(rng) if rng.random() < 0.5 else ""
                records.append({"id": i, "instruction": prompt, "input": extra, "output": reply})
                user = f"{prompt}\n\n{extra}" if extra.strip() else prompt
                msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        meant.append(msgs)
    return records, meant


def _write(fmt: str, records: list[dict], folder):
    if fmt == "messages":
        return _chat.write_jsonl(folder / "chats.jsonl", records)
    if fmt == "sharegpt":
        path = folder / "sharegpt.json"
        path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
        return path
    path = folder / "pairs.parquet"
    cols = {k: [r.get(k) for r in records] for k in ("id", "prompt", "response", "instruction", "input", "output")}
    pq.write_table(pa.table(cols), path)
    return path


CASES = [("messages", "chatml", None, "special"), ("sharegpt", "chatml", None, "special"),
         ("pair", "chatml", None, "special"), ("messages", "qwen3_style", "on", "special"),
         ("messages", "qwen3_style", "off", "special"), ("sharegpt", "qwen3_style", "on", "special"),
         ("pair", "qwen3_style", "off", "special"),
         # <|im_end|> as several ordinary tokens, the target's eos another token (<|endoftext|>)
         ("messages", "chatml", None, "split"), ("messages", "qwen3_style", "on", "split"),
         ("pair", "qwen3_style", "off", "split"), ("messages", "chatml", None, "merged"),
         ("messages", "qwen3_style", "off", "merged")]


@pytest.mark.parametrize("fmt,template,thinking,markers", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_masks_equal_the_transformers_oracle(chat_targets, tmp_path, fmt, template, thinking, markers):
    from transformers import AutoTokenizer

    chat_target = chat_targets(markers)
    rng = random.Random(hash((fmt, template, thinking, markers)) & 0xFFFF)
    n = N if markers == "special" else N_OTHER_MARKERS
    records, meant = _records(fmt, rng, n)
    data = _write(fmt, records, tmp_path)
    tpl_file = _chat.TEMPLATES / f"{template}.jinja"
    args = ["prepare", "--target", chat_target, "--data", data, "--out", tmp_path / "out", "--responses", "keep",
            "--chat-template", tpl_file, "--max-len", 100000, "--no-dedup", "--no-progress"]
    if thinking:
        args += ["--thinking", thinking]
    r = run_cli(args)
    assert r.returncode == 0, r.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(chat_target)
    text = tpl_file.read_text()
    kw = {} if thinking is None else {"enable_thinking": thinking == "on"}
    rows = _chat.read_parts(tmp_path / "out" / "train")
    by_conv: dict[int, list[dict]] = {}
    for row in rows:
        by_conv.setdefault(row["conversation_id"], []).append(row)
    assert len(by_conv) == n  # every conversation gave rows (nothing dropped: --no-dedup, no length limit)
    checked_turns = 0
    for conv_id, conv_rows in by_conv.items():
        msgs = meant[conv_id]
        if thinking == "off":  # with thinking off, recorded reasoning is not rendered (docs/own-data.md)
            msgs = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]
        assistant = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
        trained = sorted(t for row in conv_rows for t in row["turns"])
        assert trained == list(range(len(assistant))), conv_id  # every reply trained, exactly once
        for row in conv_rows:
            a_last = assistant[row["turns"][-1]]
            ids, mask = _chat.oracle(tok, text, msgs[:a_last + 1], **kw)
            assert row["input_ids"] == ids, (conv_id, row["turns"])
            if template == "chatml":
                assert row["loss_mask"] == mask, (conv_id, row["turns"])
                continue
            union = [0] * len(ids)
            for t in row["turns"]:
                a = assistant[t]
                turn_ids, turn_mask = _chat.oracle(tok, text, msgs[:a + 1], **kw)
                prompt_ids = tok.apply_chat_template(msgs[:a], chat_template=text, tokenize=True,
                                                     add_generation_prompt=True, return_dict=True, **kw)["input_ids"]
                assert ids[:len(turn_ids)] == turn_ids, (conv_id, t)  # the turn in the very context the server saw
                for q in range(len(prompt_ids), len(turn_ids)):
                    union[q] |= turn_mask[q]
            assert row["loss_mask"] == union, (conv_id, row["turns"])
            checked_turns += len(row["turns"])
    if template == "chatml":
        assert all(len(v) == 1 for v in by_conv.values())  # history rendered as written: one row each
    else:
        assert checked_turns == sum(len([m for m in meant[c] if m["role"] == "assistant"]) for c in by_conv)
