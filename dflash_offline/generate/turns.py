"""Multi-turn regeneration: every assistant turn of a conversation written by the target, in order,
each from the conversation as it stands with the target's own earlier replies (what a server
would have been sent), batched across the conversations of a part.

Round r takes the r-th reply slot of every conversation that has one: its prompt is the chat
template's rendering of the conversation so far plus the generation prompt, tokenized as a server
tokenizes it; the prompts of a round are decoded together (length-sorted batches within the token
budget). The reply's text (its thinking split off, chat/template.py `split_reasoning`) becomes the
assistant message the next round renders.

Rows: the tokens of turn k's prompt followed by its reply, the loss mask 1 on the reply (end-of-turn
token included). Replies stop at the end-of-sequence ids and at the template's end of turn where
that is one token (`chat_stop`). When turn k+1's prompt begins with the whole of the row so far (templates that
render history as it was written), the turn is appended to the same row; otherwise (the Qwen3
family drops earlier thinking) a new row begins, so each row is exactly what the server saw.
Sampling noise is keyed by (conversation id, turn): the same reply whatever batch or worker.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_offline.chat.formats import Message, messages_json
from dflash_offline.chat.template import ChatTemplate, TemplateRefused, TurnStop, row_id, split_reasoning, turn_stop
from dflash_offline.options import where
from dflash_offline.rows.parts import chat_settings_of, write_part
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.paths import file_sha256

log = logging.getLogger("dflash.generate")

TURN_KEY = 1024  # sampling row key = conversation id * TURN_KEY + turn


@dataclass
class TurnRow:
    input_ids: list[int]
    loss_mask: list[int]
    turns: list[int]
    finish_reason: str = "length"


@dataclass
class Conversation:
    id: int
    messages: list[Message]
    slots: list[int]  # message indices the target writes, in order
    rows: list[TurnRow] = field(default_factory=list)
    new_tokens: int = 0
    eos_turns: int = 0  # regenerated turns that ended with an end-of-sequence token
    stopped: str | None = None  # why its later turns were not written: the context is full, the template refused

    def add(self, turn: int, prompt: list[int], reply: list[int], trained: list[int], finish: str) -> None:
        """Append turn `turn` (its prompt and the reply tokens the row keeps) to the last row when
        the prompt continues it, else start a new row. A turn that keeps nothing (a reply that was
        all thinking, stripped) trains nothing and makes no row."""
        self.new_tokens += len(reply)
        self.eos_turns += finish == "eos"
        if not trained:
            return
        last = self.rows[-1] if self.rows else None
        if last is not None and prompt[:len(last.input_ids)] == last.input_ids:
            gap = len(prompt) - len(last.input_ids)
            last.input_ids = prompt + trained
            last.loss_mask = last.loss_mask + [0] * gap + [1] * len(trained)
            last.turns.append(turn)
            last.finish_reason = finish
        else:
            self.rows.append(TurnRow(prompt + trained, [0] * len(prompt) + [1] * len(trained), [turn], finish))

    def turn_of(self, a: int) -> int:
        """The assistant turn number of message `a`, counted from 0 over every assistant message (as
        `prepare` numbers the turns it trains)."""
        return sum(m.role == "assistant" for m in self.messages[:a])


def conversation_settings(prompts: list[str], source) -> dict | None:
    """The chat settings (with the template) when the prompts are conversations written by
    `prepare` (a `messages` column in every file); None for plain prompts."""
    import pyarrow.parquet as pq

    with_messages = ["messages" in pq.read_schema(f.path).names for f in source.files]
    if not any(with_messages):
        return None
    chat = chat_settings_of([p for p in prompts if Path(p).is_dir()])
    if not all(with_messages) or chat is None or not chat.get("template"):
        raise UserError("--prompts: conversation prompts (a `messages` column) are regenerated turn by turn with the "
                        "chat settings `dflash-offline prepare` records: give prepare's output folders (OUT/train), "
                        "all of them conversations")
    return chat


def chat_stop(cfg, chat: dict | None, eos: list[int]):
    """The ids replies stop at and a warning to print (chat/template.py `turn_stop`): for
    conversations, the template's end of turn joins the end-of-sequence ids where it is one token
    they lack (unless the user named the ids); plain prompts and --ignore-eos keep `eos`."""
    if chat is None or cfg.ignore_eos:
        return TurnStop(eos, None)
    tmpl = ChatTemplate.recorded(cfg.target, chat, eos)
    given = where(cfg, "eos_token_ids") if cfg.eos_token_ids is not None else None
    stop = turn_stop(tmpl, eos, given, f"{where(cfg, 'max_new_tokens')} {cfg.max_new_tokens}")
    if stop.eos != sorted(eos):
        log.info("replies stop at the chat template's end of turn %r too (ids %s; the target's end-of-sequence ids "
                 "are %s)", tmpl.turn_end, stop.eos, sorted(eos))
    return stop


def parse_conversation(conv_id: int, text: str, last_only: bool) -> Conversation:
    msgs = []
    for d in json.loads(text):
        extra = {k: d[k] for k in ("name", "tool_call_id") if k in d}
        msgs.append(Message(d["role"], d.get("content") or "", d.get("reasoning_content"), d.get("tool_calls"), extra))
    # Tool-calling turns stay as written: the tool results after them answer those very calls.
    slots = [i for i, m in enumerate(msgs) if m.role == "assistant" and not m.tool_calls]
    if last_only:  # the final reply, and any earlier reply the dataset lacks (a server never shows an empty one)
        slots = [i for i in slots[:-1] if not msgs[i].content and not msgs[i].reasoning] + slots[-1:]
    return Conversation(conv_id, msgs, slots)


def _turn_prompt(c: Conversation, r: int, tmpl: ChatTemplate, max_new: int, max_positions: int | None):
    """Turn r's prompt tokens (the conversation so far, rendered), or None where the conversation
    stops there (its template refuses the turn, or the prompt + a reply no longer fit the context)."""
    try:
        text = tmpl.prompt_text(c.messages, c.slots[r])
    except TemplateRefused as e:  # a later turn the template cannot render (roles out of order...)
        c.stopped = "template refused"
        log.warning("conversation %d: %s at turn %d: its later turns are not generated", c.id, e, c.turn_of(c.slots[r]))
        return None
    prompt = tmpl.tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_positions is not None and len(prompt) + max_new > max_positions:
        c.stopped = "context full"
        # In the log only: the closing line counts these conversations (one line, not one per conversation).
        log.info("conversation %d: turn %d's prompt (%d tokens) + --max-new-tokens no longer fits the "
                 "target's context (%d): its later turns are not generated", c.id, c.turn_of(c.slots[r]),
                    len(prompt), max_positions)
        return None
    return prompt


def _take_reply(c: Conversation, r: int, prompt: list[int], reply: list[int], ended: bool, tok,
                strip_reasoning: bool) -> None:
    """Turn r's reply becomes the conversation's assistant message and its row's tokens."""
    body = reply[:-1] if ended else reply
    reasoning, content = split_reasoning(tok.decode(body, skip_special_tokens=False))
    a = c.slots[r]
    c.messages[a] = Message("assistant", content, reasoning, None, c.messages[a].extra)
    kept = reply
    if strip_reasoning and reasoning is not None:  # the reply as history renders it
        kept = (tok(content, add_special_tokens=False)["input_ids"] + reply[len(body):]) if content else []
    c.add(c.turn_of(a), prompt, reply, kept, "eos" if ended else "length")


def regenerate(convs: list[Conversation], tmpl: ChatTemplate, decoder, batch_tokens: int, max_positions: int | None,
               strip_reasoning: bool, on_batch=None, start: dict[int, int] | None = None) -> None:
    """Fill each conversation's rows, round by round in padded batches (see the module doc);
    start: the round each conversation begins at (by id; default 0)."""
    start = start or {}
    for r in range(max((len(c.slots) for c in convs), default=0)):
        todo: list[tuple[Conversation, list[int]]] = []
        for c in convs:
            if r >= len(c.slots) or c.stopped or r < start.get(c.id, 0):
                continue
            prompt = _turn_prompt(c, r, tmpl, decoder.max_new, max_positions)
            if prompt is not None:
                todo.append((c, prompt))
        if not todo:
            continue
        lengths = np.asarray([len(p) for _, p in todo])
        order = np.lexsort((np.arange(len(todo)), -lengths))
        i = 0
        while i < len(order):
            rows = max(1, min(decoder.rows, batch_tokens // (int(lengths[order[i]]) + decoder.max_new)))
            batch = order[i:i + rows]
            i += len(batch)
            items = [todo[k] for k in batch]
            res = decoder.decode([p for _, p in items], [c.id * TURN_KEY + c.turn_of(c.slots[r]) for c, _ in items])
            for (c, prompt), reply, ended in zip(items, res.tokens, res.ended_by_eos):
                _take_reply(c, r, prompt, reply, ended, tmpl.tokenizer, strip_reasoning)
            if on_batch is not None:
                on_batch(len(items), sum(len(t) for t in res.tokens), res)


def regenerate_continuously(convs: list[Conversation], tmpl: ChatTemplate, decoder, max_positions: int | None,
                            strip_reasoning: bool, on_batch=None) -> list[tuple[Conversation, int]]:
    """Fill each conversation's rows through the continuous decoder: a conversation's next turn is
    queued as soon as its reply ends. -> the (conversation, round) whose prompt outgrew the slots
    (they go on in padded rounds: `regenerate(..., start=...)`)."""
    from dflash_offline.generate.continuous import Request

    outgrown: list[tuple[Conversation, int]] = []

    def request(c: Conversation, r: int) -> list[Request]:
        if r >= len(c.slots) or c.stopped:
            return []
        prompt = _turn_prompt(c, r, tmpl, decoder.max_new, max_positions)
        if prompt is None:
            return []
        if len(prompt) > decoder.max_prompt_len:
            outgrown.append((c, r))
            return []
        return [Request(c.id * TURN_KEY + c.turn_of(c.slots[r]), prompt, (c, r))]

    def finished(f) -> list[Request]:
        c, r = f.request.tag
        _take_reply(c, r, f.request.prompt, f.tokens, f.ended_by_eos, tmpl.tokenizer, strip_reasoning)
        if on_batch is not None:
            on_batch(1, len(f.tokens), None)
        return request(c, r + 1)

    decoder.run(deque(j for c in convs for j in request(c, 0)), finished)
    return outgrown


class ChatJob:
    """A worker's side of conversation mode: the chat template, the conversations of the input
    files, and how a part of them is regenerated and written."""

    def __init__(self, tmpl: ChatTemplate, src, cfg, max_positions: int | None):
        self.tmpl, self.src, self.cfg, self.max_positions = tmpl, src, cfg, max_positions
        self._messages: dict[int, list] = {}

    @classmethod
    def start(cls, job, cfg, src) -> "ChatJob":
        return cls(ChatTemplate.recorded(job.target_path, job.chat, list(job.eos)), src, cfg, job.max_positions)

    def _conversation_json(self, row: int) -> str:
        import pyarrow.parquet as pq

        fi, r = self.src.file_of_row(row)
        if fi not in self._messages:
            self._messages = {fi: pq.read_table(self.src.files[fi].path, columns=["messages"]).column(0).to_pylist()}
        return self._messages[fi][r]

    def part(self, folder, name: str, rows, decoder, on_batch, continuous=None) -> dict:
        """Regenerate the conversations at these global rows (through the continuous decoder when
        given; turns that outgrow its slots, and all without it, in padded rounds of `decoder`);
        write and return the part's entry."""
        convs = [parse_conversation(int(self.src.ids[int(r)]), self._conversation_json(int(r)),
                                    self.cfg.turns == "last") for r in rows]
        strip = self.cfg.reasoning == "strip"
        start = None
        if continuous is not None:
            outgrown = regenerate_continuously(convs, self.tmpl, continuous, self.max_positions, strip, on_batch)
            if outgrown:
                log.info("%s: %d conversations outgrew the continuous slots (%d-token prompts): their later turns "
                         "go on in padded rounds", name, len(outgrown), continuous.max_prompt_len)
            start = {c.id: r for c, r in outgrown}
            convs_left = [c for c, _ in outgrown]
        else:
            convs_left = convs
        if convs_left:  # beside the continuous slots' buffers: half the budget (generate/continuous.py)
            budget = self.cfg.batch_tokens // (2 if continuous is not None else 1)
            regenerate(convs_left, self.tmpl, decoder, budget, self.max_positions, strip, on_batch, start)
        return write_chat_part(folder, name, convs)


def write_chat_part(folder, name: str, convs: list[Conversation]) -> dict:
    """Rows in the input contract (id, input_ids, loss_mask) plus where they came from. Row k > 0 of
    a conversation split by its template takes the id `id + k * 2^40`, as `prepare` numbers them."""
    import pyarrow as pa

    cols: dict[str, list] = {k: [] for k in ("id", "input_ids", "loss_mask", "finish_reason", "conversation_id",
                                             "turns", "messages")}
    ended = sum(c.eos_turns for c in convs)
    new_tokens = 0
    for c in convs:
        for k, row in enumerate(c.rows):
            cols["id"].append(row_id(c.id, k))
            cols["input_ids"].append(row.input_ids)
            cols["loss_mask"].append(row.loss_mask)
            cols["finish_reason"].append(row.finish_reason)
            cols["conversation_id"].append(c.id)
            cols["turns"].append(row.turns)
            cols["messages"].append(messages_json(c.messages) if k == len(c.rows) - 1 else None)
        new_tokens += c.new_tokens
    table = pa.table({
        "id": pa.array(cols["id"], type=pa.int64()),
        "input_ids": pa.array(cols["input_ids"], type=pa.list_(pa.int32())),
        "loss_mask": pa.array(cols["loss_mask"], type=pa.list_(pa.int8())),
        "finish_reason": pa.array(cols["finish_reason"], type=pa.string()),
        "conversation_id": pa.array(cols["conversation_id"], type=pa.int64()),
        "turns": pa.array(cols["turns"], type=pa.list_(pa.int32())),
        "messages": pa.array(cols["messages"], type=pa.string()),
    })
    file, nbytes = write_part(folder, name, table)
    cut: dict[str, int] = {}
    for c in convs:
        if c.stopped:
            cut[c.stopped] = cut.get(c.stopped, 0) + 1
    return {"name": name, "file": file, "rows": table.num_rows, "tokens": sum(len(s) for s in cols["input_ids"]),
            "new_tokens": new_tokens, "ended_by_eos": ended, "bytes": nbytes, "sha256": file_sha256(folder / file),
            "conversations": len(convs), "cut_short": cut, "row_ids": cols["id"]}
