"""One chunk of kept conversations -> one part's rows, as an Arrow table.

`--responses keep`: training rows in the input contract (`id`, `input_ids`, `loss_mask`) plus
where they came from (`conversation_id`, `turns`, `source_id`); a conversation gives one row, or
one per turn where its template rewrites history (chat/template.py), row k > 0 under the id
`id + k * 2^40`. `--responses regenerate`: prompts for `generate` (`id`, `input_ids` = the server's
prompt for the first reply, `messages` = the whole conversation as JSON with a slot for each
reply the target is to write, `source_id`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa

from dflash_offline.chat.formats import messages_json
from dflash_offline.chat.template import ChatTemplate, TemplateRefused, TextRow, row_id
from dflash_offline.prepare.select import Kept, with_reply_slots
from dflash_offline.runtime.errors import UserError


@dataclass
class Limits:
    max_len: int  # tokens
    truncate: bool
    context_given: bool  # False: max_len is the target's context, and a longer row is an error
    context_what: str  # "--max-len 4096" or "the target's context (2048 positions)"


@dataclass
class ChunkRows:
    table: pa.Table
    conversations: int  # kept conversations that gave at least one row
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0


def _too_long(conv: Kept, n: int, limits: Limits, what: str) -> None:
    if not limits.context_given:
        raise UserError(f"{conv.record.where}: {what} of {n} tokens is longer than {limits.context_what}; pass "
                        "--max-len N to drop such rows (or --max-len N --truncate to cut them)")


def keep_rows(chunk: list[Kept], tmpl: ChatTemplate | None, train_turns: str, limits: Limits,
              tokenizer) -> ChunkRows:
    ids, seqs, masks, conv_ids, turns, sources = [], [], [], [], [], []
    dropped: Counter = Counter()
    truncated = kept = 0
    for conv in chunk:
        rec = conv.record
        if rec.text is not None:
            toks = tokenizer(rec.text, add_special_tokens=False)["input_ids"]
            rows = [(toks, [1] * len(toks), [])]
        else:
            try:
                text_rows: list[TextRow] = tmpl.rows(rec.messages, train_turns)
            except TemplateRefused as e:
                dropped[f"template refused: {e}"] += 1
                continue
            rows = [(*tmpl.tokenize(r), r.turns) for r in text_rows]
        made = 0
        for k, (toks, mask, trained_turns) in enumerate(rows):
            if len(toks) > limits.max_len:
                _too_long(conv, len(toks), limits, "a row")
                if not limits.truncate:
                    dropped["rows longer than --max-len"] += 1
                    continue
                toks, mask = toks[:limits.max_len], mask[:limits.max_len]
                truncated += 1
            if not any(mask):
                dropped["rows with nothing to train (empty replies, or cut before them)"] += 1
                continue
            ids.append(row_id(conv.id, k))  # ids below 2^40: select.py refused larger ones
            seqs.append(toks)
            masks.append(mask)
            conv_ids.append(conv.id)
            turns.append(trained_turns)
            sources.append(rec.source_id)
            made += 1
        kept += made > 0
    table = pa.table({
        "id": pa.array(ids, type=pa.int64()),
        "input_ids": pa.array(seqs, type=pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, type=pa.list_(pa.int8())),
        "conversation_id": pa.array(conv_ids, type=pa.int64()),
        "turns": pa.array(turns, type=pa.list_(pa.int32())),
        "source_id": pa.array(sources, type=pa.string()),
    })
    return ChunkRows(table, kept, dropped, truncated)


def prompt_rows(chunk: list[Kept], tmpl: ChatTemplate, limits: Limits) -> ChunkRows:
    ids, seqs, convs, sources = [], [], [], []
    dropped: Counter = Counter()
    for conv in chunk:
        msgs = tmpl.prepared(with_reply_slots(conv.record.messages))
        first = next(i for i, m in enumerate(msgs) if m.role == "assistant")
        try:
            text = tmpl.prompt_text(msgs, first)
        except TemplateRefused as e:
            dropped[f"template refused: {e}"] += 1
            continue
        toks = tmpl.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(toks) > limits.max_len:
            _too_long(conv, len(toks), limits, "the first prompt")
            dropped["prompt longer than --max-len"] += 1
            continue
        ids.append(conv.id)
        seqs.append(toks)
        convs.append(messages_json(msgs))
        sources.append(conv.record.source_id)
    table = pa.table({
        "id": pa.array(ids, type=pa.int64()),
        "input_ids": pa.array(seqs, type=pa.list_(pa.int32())),
        "messages": pa.array(convs, type=pa.string()),
        "source_id": pa.array(sources, type=pa.string()),
    })
    return ChunkRows(table, len(ids), dropped, 0)
