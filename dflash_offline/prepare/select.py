"""Which conversations `prepare` keeps, under which id, in which split: a pure function of the
records and the settings (no tokenizer), so a rerun after a crash plans exactly the same parts.

Dropped conversations are counted by reason (empty, no user turn, starts with the assistant, no
reply to keep, duplicate); a few things are refused outright because they say the settings do
not fit the data (a kept-reply conversation that ends with the user, regeneration of plain text).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

from dflash_offline.chat.formats import Message, Record
from dflash_offline.chat.template import ROW_ID_STRIDE
from dflash_offline.runtime.errors import UserError


@dataclass
class Kept:
    """A kept record: its id, its split, and what is rendered."""

    id: int
    split: str  # train | eval
    record: Record


@dataclass
class Selection:
    splits: dict[str, list[Kept]]
    read: int
    dropped: Counter = field(default_factory=Counter)
    cut_off: list = field(default_factory=list)  # (file, complete records) of files that end mid-record


def content_key(rec: Record) -> str:
    """The normalised content hash used to find duplicates: roles and texts, case and whitespace
    folded (the same conversation typed twice, or copied with other spacing, is one)."""
    if rec.text is not None:
        parts = [["text", " ".join(rec.text.lower().split())]]
    else:
        parts = [[m.role, " ".join(m.content.lower().split()), " ".join((m.reasoning or "").lower().split())]
                 for m in rec.messages]
    return hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()


def in_eval(conv_id: int, fraction: float) -> bool:
    """Stable split: a hash of the id, not the record's position, so adding data moves no row."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(f"dflash-split:{conv_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def problem(rec: Record, responses: str) -> str | None:
    """Why a well-formed record cannot be used (it is dropped and counted), or None."""
    if rec.text is not None:
        return "empty" if not rec.text.strip() else None
    msgs = rec.messages
    if not msgs:
        return "empty"
    first = next((m for m in msgs if m.role != "system"), None)
    if first is None or not any(m.role == "user" for m in msgs):
        return "no user turn"
    if first.role != "user":
        return "starts with an assistant turn"
    if responses == "keep" and not any(m.role == "assistant" for m in msgs):
        return "no assistant reply to keep"
    if responses == "regenerate" and not any(m.role == "assistant" and not m.tool_calls
                                             for m in with_reply_slots(msgs)):
        return "no reply to regenerate (it ends in a tool call)"
    return None


def with_reply_slots(msgs: list[Message]) -> list[Message]:
    """For regeneration: an empty assistant message after every user (or tool) turn that has no
    reply, so that every reply the target writes has its place (MT-Bench's two questions give two)."""
    out: list[Message] = []
    for i, m in enumerate(msgs):
        out.append(m)
        nxt = msgs[i + 1].role if i + 1 < len(msgs) else None
        if m.role in ("user", "tool") and nxt not in ("assistant", "tool"):
            out.append(Message("assistant", ""))
    return out


def select(records: list[Record], responses: str, eval_fraction: float, dedup: bool,
           drop_unanswered: bool = False) -> Selection:
    """Drop unusable records and duplicates, give ids, split."""
    sel = Selection({"train": [], "eval": []}, read=len(records))
    seen: set[str] = set()
    ids: dict[int, str] = {}
    for rec in records:
        if rec.text is not None and responses == "regenerate":
            raise UserError(f"{rec.where}: a plain `text` record has no turns to regenerate; use --responses keep "
                            "(every token of the text is trained)")
        unanswered = False
        if rec.messages is not None and responses == "keep":
            last = next((m for m in reversed(rec.messages) if m.role != "system"), None)
            unanswered = last is not None and last.role in ("user", "tool")
            if unanswered and not drop_unanswered:
                raise UserError(f"{rec.where}: the conversation ends with a {last.role} turn, so its last reply is "
                                "missing; with --responses keep every conversation ends with the assistant (drop the "
                                "final turn, use --responses regenerate, or --drop-unanswered to drop such "
                                "conversations)")
        conv_id = rec.own_id if rec.own_id is not None else rec.index
        if conv_id < 0:
            raise UserError(f"{rec.where}: id {conv_id} is negative; ids must be >= 0")
        if conv_id >= ROW_ID_STRIDE:  # the rows a template splits off take id + k * 2^40
            raise UserError(f"{rec.where}: id {conv_id} is too large; conversation ids must be below 2^40 "
                            f"({ROW_ID_STRIDE}): the k-th extra row of a conversation takes id + k * 2^40")
        if conv_id in ids:
            if rec.own_id is not None:
                raise UserError(f"{rec.where}: id {conv_id} was already used by {ids[conv_id]}; ids must be unique "
                                "across all input files")
            why = f"its id {rec.source_id!r} is not an integer, so it" if rec.source_id is not None else "it has no id, so it"
            raise UserError(f"{rec.where}: {why} takes its position {conv_id} as id, which {ids[conv_id]} already uses; "
                            "give every record an integer id, or none")
        ids[conv_id] = rec.where if rec.own_id is not None else (
            f"{rec.where} (its id {rec.source_id!r} is not an integer, so it took its position {conv_id})"
            if rec.source_id is not None else f"{rec.where} (it has no id, so it took its position {conv_id})")
        why = "ends with the user (unanswered)" if unanswered else problem(rec, responses)
        if why is not None:
            sel.dropped[why] += 1
            continue
        if dedup:
            key = content_key(rec)
            if key in seen:
                sel.dropped["duplicate"] += 1
                continue
            seen.add(key)
        split = "eval" if in_eval(conv_id, eval_fraction) else "train"
        sel.splits[split].append(Kept(conv_id, split, rec))
    return sel
