"""Chat templates: render conversations as the server renders them, and find what the model writes.

A DFlash drafter is trained on what the target writes *in the context the server gives it*: at
assistant turn k the server renders the conversation so far with the generation prompt (the
template's `add_generation_prompt`), and the model writes the reply and its end-of-turn token.
So a reply's trained span is found by rendering twice: `prefix` = messages[:a] + generation
prompt, `full` = messages[:a + 1]; the reply is `full[len(prefix):]` up to and including the
template's end of turn (what follows it, such as ChatML's newline, the model never writes). The end
of turn is the text the template writes after a reply (`turn_end`: a probe reply rendered, the
whitespace around what follows it dropped), so it is found whether the tokenizer holds it as one
special token or splits it into several ordinary ones; a special end-of-sequence token found
earlier ends the reply there. A template
for which `full` does not start with `prefix` cannot be trained turn by turn: that conversation is
dropped with the template's reason.

Rows (`TextRow`): templates that render every earlier turn the way it was written (ChatML) give one
row per conversation, every reply trained in place. Templates of the Qwen3 family drop the <think>
content of earlier turns, so the context of turn k+1 is *not* the text that turn k was trained in:
there a conversation gives one row per turn (turns merged only while the rendering stays a prefix
of the next turn's), each row exactly what the server saw when it wrote that turn. docs/own-data.md
states this for users.

Masks use transformers' own rule for `return_assistant_tokens_mask`: a token is trained when its
characters overlap a reply span, so rows equal that oracle on templates with `{% generation %}`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from dflash_offline.chat.formats import Message
from dflash_offline.options import as_flag
from dflash_offline.runtime.errors import UserError

log = logging.getLogger("dflash.chat")

THINKING = ("on", "off")
# The content of the assistant turn rendered to find what a template writes after a reply.
REPLY_PROBE = "dflashreplyprobe"


# A conversation split into several rows (templates that rewrite history) numbers them: row 0 keeps
# the conversation's id, row k > 0 takes id + k * 2^40; conversation ids stay below 2^40.
ROW_ID_STRIDE = 1 << 40


def row_id(conversation_id: int, k: int) -> int:
    """The id of a conversation's k-th row (prepare --responses keep and generate number alike)."""
    if k and conversation_id >= ROW_ID_STRIDE:
        raise ValueError(f"conversation id {conversation_id} is too large for a conversation split into rows "
                         "(ids below 2^40)")
    return conversation_id + k * ROW_ID_STRIDE


class TemplateRefused(Exception):
    """The template cannot render this conversation turn by turn (it raised, or a turn renders
    unlike its own generation prompt): the conversation is dropped with this reason."""


@dataclass(frozen=True)
class ChatSettings:
    """How conversations were rendered: recorded in every manifest from `prepare` to the export, so
    that a drafter served with another template or thinking mode is noticed."""

    template_sha256: str
    template_source: str  # "tokenizer" (the model folder's own) or the --chat-template file
    thinking: str | None  # on | off | None (the template's default)
    system: str | None  # the default system prompt added to conversations without one
    reads_thinking: bool  # the template reads `enable_thinking`

    def manifest_entry(self) -> dict:
        return {"template_sha256": self.template_sha256, "template_source": self.template_source,
                "thinking": self.thinking, "system": self.system, "reads_thinking": self.reads_thinking}

    @classmethod
    def from_entry(cls, d: dict) -> "ChatSettings":
        return cls(d["template_sha256"], d["template_source"], d.get("thinking"), d.get("system"),
                   bool(d.get("reads_thinking")))


def differences(a: dict | None, b: dict | None) -> list[str]:
    """What differs between two recorded chat settings, in words (empty when they agree or either
    is unknown)."""
    if not a or not b:
        return []
    out = []
    if a.get("template_sha256") != b.get("template_sha256"):
        out.append("chat template (sha256 %s... vs %s...)" % (str(a.get("template_sha256"))[:12],
                                                             str(b.get("template_sha256"))[:12]))
    if a.get("thinking") != b.get("thinking"):
        out.append(f"thinking {a.get('thinking') or 'default'} vs {b.get('thinking') or 'default'}")
    if a.get("system") != b.get("system"):
        out.append("default system prompt")
    return out


@dataclass
class TextRow:
    """One training row as text: `spans` are the [start, end) character ranges the model wrote."""

    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)  # assistant turn numbers (0-based) trained in this row


# Files one of which a tokenizer is built from; without any, transformers 5 builds an empty
# tokenizer for the model type (one token), which would tokenize everything to nothing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_chat_tokenizer(target: str, option: str = "--target"):
    from transformers import AutoTokenizer

    if Path(target).is_dir() and not any((Path(target) / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{option} {target}: no tokenizer files in the folder (none of {', '.join(TOKENIZER_FILES)}); "
                        "copy the model's tokenizer files into it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except Exception as e:  # damaged files, unknown class: one line (transformers' text spans lines)
        what = " ".join(str(e).split())
        raise UserError(f"{option} {target}: transformers cannot load its tokenizer ({type(e).__name__}: "
                        f"{what[:300]}); check the folder's tokenizer files (tokenizer.json, tokenizer_config.json) "
                        "and config.json") from None
    if len(tokenizer) < 2:
        raise UserError(f"{option} {target}: its tokenizer holds {len(tokenizer)} token(s); the tokenizer files are "
                        "damaged or missing: copy the model's tokenizer files into the folder")
    return tokenizer


class ChatTemplate:
    """A tokenizer, its chat template and the chat settings, rendering `Message` lists."""

    def __init__(self, tokenizer, template: str, settings: ChatSettings, end_ids: list[int]):
        self.tokenizer = tokenizer
        self.template = template
        self.settings = settings
        self.end_ids = sorted(set(end_ids))
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.end_strings = sorted({added[i].content for i in self.end_ids if i in added}, key=len, reverse=True)
        self.turn_end = self._turn_end()

    def _turn_end(self) -> str | None:
        """The text the template writes after a reply to close the turn, without the whitespace
        around it (ChatML's `<|im_end|>`), from a probe reply rendered; None when it writes nothing
        there or cannot render the probe."""
        try:
            full = self.render(self.prepared([Message("user", "Hello."), Message("assistant", REPLY_PROBE)]),
                               add_generation_prompt=False)
        except TemplateRefused:
            return None
        k = full.rfind(REPLY_PROBE)
        return (full[k + len(REPLY_PROBE):].strip() or None) if k >= 0 else None

    @classmethod
    def recorded(cls, target: str, chat: dict, end_ids: list[int]) -> "ChatTemplate":
        """The template a prepare output recorded (its manifest's `chat` entry: the template's text
        and settings) with the target folder's tokenizer: how generate and eval render and stop
        the conversations prepare rendered."""
        return cls(load_chat_tokenizer(target), chat["template"], ChatSettings.from_entry(chat), end_ids)

    @classmethod
    def load(cls, target: str, chat_template: str | None = None, thinking: str | None = None,
             system: str | None = None, end_ids: list[int] | None = None, tokenizer=None,
             said: Callable[[str], str] = as_flag) -> "ChatTemplate":
        """The target folder's tokenizer with its own template, or the template in `chat_template`
        (a file). Refuses, in one line, a tokenizer without a template when none is given. `said`:
        how messages name an option (`partial(options.where, cfg)`: the flag or recipe key)."""
        tokenizer = tokenizer or load_chat_tokenizer(target, said("target"))
        if chat_template:
            try:
                template = Path(chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"{said('chat_template')} {chat_template}: cannot read it ({e})") from None
            source = str(chat_template)
        else:
            template = tokenizer.chat_template
            if isinstance(template, dict):  # several named templates: the default one
                template = template.get("default")
            if not template:
                raise UserError(f"{said('target')} {target}: its tokenizer has no chat template; give one with "
                                "--chat-template FILE (a Jinja file, as in tokenizer_config.json's chat_template)")
            source = "tokenizer"
        if thinking is not None and thinking not in THINKING:
            raise UserError(f"{said('thinking')} {thinking!r}: choose on or off")
        reads = "enable_thinking" in template
        if thinking is not None and not reads:
            log.warning("%s %s: the chat template does not read `enable_thinking`; it renders the same "
                        "either way", said("thinking"), thinking)
        _check_syntax(tokenizer, template, f"{said('chat_template')} {source}" if chat_template
                      else f"{said('target')} {target}")
        settings = ChatSettings(hashlib.sha256(template.encode()).hexdigest(), source, thinking, system or None, reads)
        ends = list(end_ids or [])
        if tokenizer.eos_token_id is not None:
            ends.append(tokenizer.eos_token_id)
        return cls(tokenizer, template, settings, ends)

    # ------------------------------------------------------------------------------------------
    def prepared(self, messages: list[Message]) -> list[Message]:
        """The conversation as it is rendered: the default system prompt added where there is none."""
        if self.settings.system and (not messages or messages[0].role != "system"):
            return [Message("system", self.settings.system)] + list(messages)
        return list(messages)

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        # With thinking off, recorded reasoning is not rendered: the server's generation prompt
        # holds an empty think block, and a reply with reasoning would not continue it.
        keep_reasoning = self.settings.thinking != "off"
        kwargs = {}
        if self.settings.thinking is not None:
            kwargs["enable_thinking"] = self.settings.thinking == "on"
        try:
            return self.tokenizer.apply_chat_template([m.as_template_dict(keep_reasoning) for m in messages],
                                                      chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # jinja's TemplateError, raise_exception(...) of the template itself
            raise TemplateRefused(str(e)[:160] or type(e).__name__) from None

    def reply_end(self, completion: str) -> int:
        """Characters of `completion` (a reply and what the template writes after it) the model
        writes: up to and including the template's end of turn (its last occurrence: a reply may
        quote it), or the first special end-of-sequence token when that comes earlier; the whole of
        it when there is neither."""
        ends = [completion.find(s) + len(s) for s in self.end_strings if s in completion]
        if self.turn_end and self.turn_end in completion:
            ends.append(completion.rfind(self.turn_end) + len(self.turn_end))
        return min(ends, default=len(completion))

    def prompt_text(self, messages: list[Message], upto: int) -> str:
        """The server's prompt for the assistant turn at message index `upto`."""
        return self.render(messages[:upto], add_generation_prompt=True)

    def rows(self, messages: list[Message], train_turns: str = "all") -> list[TextRow]:
        """Training rows of a conversation whose replies are kept as written (see the module doc)."""
        msgs = self.prepared(messages)
        assistant = [i for i, m in enumerate(msgs) if m.role == "assistant"]
        chosen = assistant[-1:] if train_turns == "last" else assistant
        rows: list[TextRow] = []
        current: TextRow | None = None
        for a in chosen:
            prefix = self.render(msgs[:a], add_generation_prompt=True)
            full = self.render(msgs[:a + 1], add_generation_prompt=False)
            turn = assistant.index(a)
            if not full.startswith(prefix):
                raise TemplateRefused("an assistant turn renders unlike its generation prompt (the template writes "
                                      "the turn differently from what a server would prompt)")
            span = (len(prefix), len(prefix) + self.reply_end(full[len(prefix):]))
            if current is not None and prefix.startswith(current.text):
                current.text = full
                current.spans.append(span)
                current.turns.append(turn)
            else:
                if current is not None:
                    rows.append(current)
                current = TextRow(full, [span], [turn])
        if current is not None:
            rows.append(current)
        return rows

    def tokenize(self, row: TextRow) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask): the row's text tokenized once (as transformers tokenizes a rendered
        chat: no special tokens added), a token trained when it overlaps a reply span."""
        enc = self.tokenizer(row.text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        return ids, overlap_mask(offsets, row.spans)


def _check_syntax(tokenizer, template: str, where: str) -> None:
    """A template that is not valid Jinja is refused at once, with jinja's line and reason (not as
    every conversation dropped later). Errors the template raises on purpose are left to rendering."""
    import jinja2

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"{where}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
    except Exception:  # raise_exception(...), a role rule: the template's own business
        pass


def overlap_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose character range overlaps a span (spans sorted, disjoint): the rule of
    transformers' `return_assistant_tokens_mask`."""
    mask = [0] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def split_reasoning(text: str) -> tuple[str | None, str]:
    """A generated reply -> (reasoning, content): the text inside <think>...</think> (the opening tag
    may sit in the generation prompt instead) and what follows it. A think block the reply never
    closed (cut off by the length limit) is all reasoning, no content."""
    if "</think>" not in text:
        if text.lstrip().startswith("<think>"):
            return text.split("<think>", 1)[1].strip("\n"), ""
        return None, text
    head, _, tail = text.partition("</think>")
    return head.split("<think>")[-1].strip("\n"), tail.lstrip("\n")


class TurnStop(NamedTuple):
    """The ids conversation replies stop at, and a warning when they will not stop at the end of turn."""

    eos: list[int]
    warning: str | None


def turn_stop(tmpl: ChatTemplate, eos: list[int], given: str | None, runs_to: str) -> TurnStop:
    """A server ends a reply at the template's end of turn (`turn_end`). Where that is one token of
    the tokenizer that the end-of-sequence ids lack (a generation_config.json naming <|endoftext|>
    alone beside a ChatML template), it joins them, so that replies end as served. Where the ids
    were named by the user (`given`: the option, kept as named) or the tokenizer splits the end of
    turn into several tokens (a template of another model family), replies run on to `runs_to`:
    said in a warning with the fix."""
    end = tmpl.turn_end
    ids = tmpl.tokenizer(end, add_special_tokens=False)["input_ids"] if end else []
    if not ids or (len(ids) == 1 and ids[0] in eos):
        return TurnStop(sorted(eos), None)
    if len(ids) == 1 and given is None:
        return TurnStop(sorted(set(eos) | set(ids)), None)
    if len(ids) == 1:
        return TurnStop(sorted(eos), f"{given} {sorted(eos)} leaves out the chat template's end of turn {end!r} (token "
                                     f"id {ids[0]}): replies do not stop at the end of turn but run on to {runs_to}; "
                                     f"add {ids[0]} (or leave the option out to stop there)")
    names = ", ".join(repr(t) for t in tmpl.tokenizer.convert_ids_to_tokens(sorted(eos)))
    what = (f"that ends a turn with the target's end-of-sequence token ({names})" if names
            else "whose end of turn is one token of the target's tokenizer")
    fix = f"prepare again with a --chat-template {what}"
    if tmpl.settings.template_source != "tokenizer" and tmpl.tokenizer.chat_template:
        fix = f"prepare again without --chat-template (the target's own template), or with one {what}"
    return TurnStop(sorted(eos), f"the chat template ends a turn with {end!r}, which the target's tokenizer splits into "
                                 f"{len(ids)} tokens, not one end-of-sequence id ({sorted(eos)}): replies do not stop at "
                                 f"the end of turn but run on to {runs_to}; {fix}")
