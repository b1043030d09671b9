"""Raw records (dicts from formats.py) -> `Record`s: the format detected per file, each record
checked for structure and normalised (roles to system/user/assistant/tool, ShareGPT's variants
mapped, Alpaca's instruction and input joined)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from dflash_offline.chat.formats import (FORMATS, OPENAI_ROLES, forget_cut_off_files, PAIR_RESPONSE_KEYS, SHAREGPT_ROLES, Message, Record,
                                         iter_raw, resolve_inputs)
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


def _messages_record(rec: dict, where: str) -> list[Message]:
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
            for p in content:
                kind = p.get("type", "text") if isinstance(p, dict) else None
                if kind in ("text", "input_text", "output_text"):
                    if not isinstance(p.get("text"), str):
                        raise UserError(f"{at}: a {kind} content part without text")
                    parts.append(p["text"])
                elif isinstance(p, dict) and "text" in p:  # a text-carrying part of an unknown kind: not dropped silently
                    raise UserError(f"{at}: content part of type {kind!r} carries text but is not a text part "
                                    "(text, input_text, output_text); convert it to one")
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


def read_records(paths: list[str], fmt: str = "auto", option: str = "--data") -> Iterator[Record]:
    """Every record of every input, in order, normalised. `fmt` = auto detects per file; a file
    whose records are in different formats (or in none) is refused naming the first that differs."""
    if fmt != "auto" and fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: choose auto, {', '.join(FORMATS)}")
    forget_cut_off_files()
    index = 0
    for path in resolve_inputs(paths, option):
        file_fmt = None if fmt == "auto" else fmt
        first_where = None
        for where_in, raw in iter_raw(Path(path)):
            where = f"{path}: {where_in}"
            found = detect_format(raw)
            if fmt != "auto":
                if found != fmt and not (fmt == "text" and isinstance(raw, dict) and "text" in raw):
                    raise UserError(f"{where}: not a {fmt!r} record (keys: {_keys(raw)}); check --format")
            elif found is None and isinstance(raw, dict) and any(isinstance(raw.get(k), str) for k in (
                    "messages", "conversations")):
                key = next(k for k in ("messages", "conversations") if isinstance(raw.get(k), str))
                raise UserError(f"{where}: `{key}` is a string (JSON text?), not a list of turns; store it as a list "
                                "(decode it before writing the file)")
            elif found is None:
                raise UserError(f"{where}: unknown record format (keys: {_keys(raw)}); expected `messages`, "
                                "`conversations` (ShareGPT), `prompt` + `response`, `instruction` + `output`, or "
                                "`text`; or pass --format")
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
                msgs = {"messages": _messages_record, "sharegpt": _sharegpt_record, "pair": _pair_record,
                        "turns": _turns_record}[kind](raw, where)
                yield Record(index, where, own, source_id, messages=msgs)
            index += 1
