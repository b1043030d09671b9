"""Raw records (dicts from formats.py) -> `Record`s: the format detected per file, each record
checked for structure and normalised (roles to system/user/assistant/tool, ShareGPT's variants
mapped, Alpaca's instruction and input joined). Content parts that are not text (images, audio)
are left out of the text, with one warning that counts the records that held them."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Iterator

from dflash_offline.chat.formats import (FORMATS, OPENAI_ROLES, PAIR_RESPONSE_KEYS, SHAREGPT_ROLES, Message, Record,
                                         forget_cut_off_files, iter_raw, resolve_inputs)
from dflash_offline.runtime.errors import UserError


def detect_format(rec: object) -> str | None:
    """The format a raw record is written in, or None. A key whose value is null counts as absent:
    a Parquet file holding prompt/response rows and instruction/output rows has both sets of columns."""
    if not isinstance(rec, dict):
        return None
    has = {k for k, v in rec.items() if v is not None}
    if isinstance(rec.get("messages"), list):
        return "messages"
    if isinstance(rec.get("conversations"), list) or isinstance(rec.get("conversation"), list):
        return "sharegpt"
    if "prompt" in has and has & set(PAIR_RESPONSE_KEYS):
        return "pair"
    if "instruction" in has and "output" in has:
        return "pair"
    if isinstance(rec.get("turns"), list):
        return "turns"
    if isinstance(rec.get("text"), str):
        return "text"
    return None


def _keys(rec: object) -> str:
    return ", ".join(sorted(map(str, rec.keys()))[:8]) if isinstance(rec, dict) else type(rec).__name__


def _json_type(v: object) -> str:
    return {type(None): "null", bool: "true or false", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(v), f"a {type(v).__name__}")


def _not_a_record(raw: object, fmt: str | None) -> str | None:
    """Why `raw` is no record (of `fmt`, or of any format), when a field says so: a known field that
    is null or of the wrong type is named (detect_format takes a null as absent, so `{"prompt": null,
    "response": ...}` would read as an unknown format), as are token rows and non-objects."""
    if not isinstance(raw, dict):
        return (f"not a JSON object but {_json_type(raw)}; a record is an object such as {{\"messages\": [...]}}"
                + (" (one JSON array of records is a .json file)" if isinstance(raw, list) else ""))
    if fmt is None and "input_ids" in raw:  # a tokenized file: nothing to render
        to = "extract --data" if "loss_mask" in raw or "prompt_len" in raw else "generate --prompts"
        return (f"token rows (`input_ids`), not conversations: prepare renders chat records; give the file "
                f"straight to `dflash-offline {to}`")
    for key, want, kind in (("messages", "a list of messages", "messages"), ("conversations", "a list of turns",
                            "sharegpt"), ("conversation", "a list of turns", "sharegpt"),
                            ("turns", "a list of the user's messages", "turns"), ("text", "text", "text")):
        v = raw.get(key)
        if key in raw and fmt in (None, kind) and not isinstance(v, str if key == "text" else list):
            if isinstance(v, str) and v.lstrip().startswith(("[", "{")):
                return (f"`{key}` is a string (JSON text?), not {want}; store it as a list (decode it before "
                        "writing the file)")
            return f"`{key}` is {_json_type(v)}, not {want}; fix or remove that record"
    for ask, replies in (("prompt", PAIR_RESPONSE_KEYS), ("instruction", ("output",))):
        answers = [k for k in replies if k in raw]
        null = next((k for k in (ask, *answers) if raw[k] is None), None) if ask in raw and answers else None
        if fmt in (None, "pair") and null:
            return (f"`{null}` is null, not text; a `pair` record needs `{ask}` and `{answers[0]}` as text; fix or "
                    "remove that record")
    return None


def _string(value, what: str, where: str, allow_none: bool = False) -> str:
    if value is None and allow_none:
        return ""
    if not isinstance(value, str):
        shown = "missing or null" if value is None else f"a {type(value).__name__}"
        raise UserError(f"{where}: {what} is {shown}, not text; fix or remove that record")
    return value


def _own_id(rec: dict) -> tuple[int | None, str | None]:
    """The record's own id: an integer (or integer-valued text is *not* taken: "123" stays a name)."""
    for key in ("id", "question_id", "conversation_id"):
        if key in rec and rec[key] is not None:
            v = rec[key]
            if isinstance(v, bool):
                return None, str(v)
            if isinstance(v, int):
                return v, str(v)
            return None, str(v)
    return None, None


def _messages_record(rec: dict, where: str, left_out: list[tuple[str, str]]) -> list[Message]:
    """The messages; (where, kind) of each non-text content part left out is appended to `left_out`."""
    out = []
    for k, m in enumerate(rec["messages"]):
        at = f"{where}: message {k}"
        if not isinstance(m, dict):
            raise UserError(f"{at}: not an object with role and content; fix or remove that record")
        if "role" not in m:
            raise UserError(f"{at}: no `role`; every message needs a role (system, user, assistant or tool)")
        role = OPENAI_ROLES.get(str(m["role"]).lower())
        if role is None:
            raise UserError(f"{at}: unknown role {m['role']!r}; expected system, user, assistant or tool")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text parts joined (Chat and Responses API names)
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict):
                    raise UserError(f"{at}: content part {j} is {_json_type(p)}, not an object such as "
                                    "{\"type\": \"text\", \"text\": ...}; fix or remove that record")
                kind = p.get("type") or "text"
                if kind in ("text", "input_text", "output_text"):
                    if not isinstance(p.get("text"), str):
                        raise UserError(f"{at}: a {kind} content part without text")
                    parts.append(p["text"])
                elif p.get("text") is not None:  # a text-carrying part of an unknown kind: not dropped silently
                    # (`is not None`: Arrow rows hold every part's fields, null where a part has none)
                    raise UserError(f"{at}: content part of type {kind!r} carries text but is not a text part "
                                    "(text, input_text, output_text); convert it to one")
                else:  # an image, audio, file: the drafter trains on text (counted, one warning)
                    left_out.append((at, str(kind)))
            content = "".join(parts)
        if "content" not in m and not m.get("tool_calls"):
            raise UserError(f"{at}: no `content`; every message needs one (\"\" for an empty reply)")
        content = _string(content, "`content`", at, allow_none=bool(m.get("tool_calls")) or role == "assistant")
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None:
            reasoning = _string(reasoning, "`reasoning_content`", at)
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise UserError(f"{at}: `tool_calls` must be a list")
        if calls:
            calls = [_tool_call(c, f"{at}: tool call {j}") for j, c in enumerate(calls)]
        extra = {k: m[k] for k in ("name", "tool_call_id") if isinstance(m.get(k), str)}
        out.append(Message(role, content, reasoning if role == "assistant" else None, calls or None, extra))
    return out


def _tool_call(call, at: str) -> dict:
    """A tool call, checked for shape and passed to the template as written (arguments as JSON text
    or as an object: templates handle both, and the text the model wrote is the one to train on)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict) or "name" not in call["function"]:
        raise UserError(f"{at}: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": "
                        "...}}")
    return call


def _sharegpt_record(rec: dict, where: str) -> list[Message]:
    turns = rec.get("conversations", rec.get("conversation"))
    out = []
    for k, t in enumerate(turns):
        at = f"{where}: turn {k}"
        if not isinstance(t, dict):
            raise UserError(f"{at}: not an object with `from` and `value`; fix or remove that record")
        who = t.get("from", t.get("role"))
        if who is None:
            raise UserError(f"{at}: no `from`; every turn needs one (human, gpt or system)")
        role = SHAREGPT_ROLES.get(str(who).lower())
        if role is None:
            raise UserError(f"{at}: unknown speaker {who!r}; expected human, gpt or system (or {', '.join(sorted(SHAREGPT_ROLES))})")
        value = t.get("value", t.get("content"))
        if value is None and "value" not in t and "content" not in t:
            raise UserError(f"{at}: no `value`; every turn needs its text")
        out.append(Message(role, _string(value, "`value`", at)))
    return out


def _pair_record(rec: dict, where: str) -> list[Message]:
    if rec.get("prompt") is not None:
        prompt = _string(rec["prompt"], "`prompt`", where)
        key = next(k for k in PAIR_RESPONSE_KEYS if rec.get(k) is not None)
        response = _string(rec[key], f"`{key}`", where)
    else:  # Alpaca: the instruction, then its input on the next lines when there is one
        prompt = _string(rec["instruction"], "`instruction`", where)
        extra = _string(rec.get("input"), "`input`", where, allow_none=True)
        prompt = f"{prompt}\n\n{extra}" if extra.strip() else prompt
        response = _string(rec["output"], "`output`", where)
    msgs = []
    if isinstance(rec.get("system"), str) and rec["system"]:
        msgs.append(Message("system", rec["system"]))
    return msgs + [Message("user", prompt), Message("assistant", response)]


def _turns_record(rec: dict, where: str) -> list[Message]:
    msgs = [Message("system", rec["system"])] if isinstance(rec.get("system"), str) and rec["system"] else []
    return msgs + [Message("user", _string(t, f"turn {k}", where)) for k, t in enumerate(rec["turns"])]


def read_records(paths: list[str], fmt: str = "auto", option: str = "--data",
                 limit: int | None = None) -> Iterator[Record]:
    """Every record of every input, in order, normalised. `fmt` = auto detects per file; a file
    whose records are in different formats (or in none) is refused naming the first that differs.
    `limit`: the first `limit` records only; reading stops there (the rest of a JSONL, Parquet or
    Arrow input and the inputs after it are not read; a JSON array file is loaded whole, but its
    later records are not parsed)."""
    if fmt != "auto" and fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: choose auto, {', '.join(FORMATS)}")
    forget_cut_off_files()
    index = 0
    left_out: list[tuple[str, str]] = []  # per record: its non-text content parts
    with_parts, first_parts, kinds = 0, None, Counter()
    for path in resolve_inputs(paths, option):
        file_fmt = None if fmt == "auto" else fmt
        first_where = None
        for where_in, raw in iter_raw(Path(path)):
            where = f"{path}: {where_in}"
            found = detect_format(raw)
            if fmt != "auto":
                if found != fmt and not (fmt == "text" and isinstance(raw, dict) and "text" in raw):
                    why = _not_a_record(raw, fmt)
                    raise UserError(f"{where}: " + (why or f"not a {fmt!r} record (keys: {_keys(raw)}); check --format"))
            elif found is None:
                raise UserError(f"{where}: " + (_not_a_record(raw, None) or (
                    f"unknown record format (keys: {_keys(raw)}); expected `messages`, `conversations` (ShareGPT), "
                    "`prompt` + `response`, `instruction` + `output`, or `text`; or pass --format")))
            elif file_fmt is None:
                file_fmt, first_where = found, where_in
            elif found != file_fmt:
                raise UserError(f"{where}: a {found!r} record in a file whose {first_where} is {file_fmt!r}: one file "
                                "holds one format; split the file, or pass --format")
            own, source_id = _own_id(raw)
            kind = fmt if fmt != "auto" else found
            if kind == "text":
                yield Record(index, where, own, source_id, text=_string(raw.get("text"), "`text`", where))
            else:
                msgs = _messages_record(raw, where, left_out) if kind == "messages" else {
                    "sharegpt": _sharegpt_record, "pair": _pair_record, "turns": _turns_record}[kind](raw, where)
                if left_out:
                    with_parts += 1
                    first_parts = first_parts or f"{left_out[0][0]} ({left_out[0][1]})"
                    kinds.update(k for _, k in left_out)
                    left_out.clear()
                yield Record(index, where, own, source_id, messages=msgs)
            index += 1
            if limit is not None and index >= limit:
                break  # before the next record is read
        if limit is not None and index >= limit:
            break
    if with_parts:  # told, not silent: the records stay, rendered from their text
        logging.getLogger("dflash.prepare").warning(
            "%d record(s) hold content parts that are not text (%s): those parts are left out, the text of the "
            "record is kept (the drafter trains on text alone); the first: %s", with_parts,
            ", ".join(f"{n} {k}" for k, n in kinds.most_common()), first_parts)
