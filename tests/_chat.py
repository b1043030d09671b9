"""Chat test material made here: byte-level BPE tokenizers trained locally with `tokenizers` (one
holding the ChatML markers as special tokens, one that splits them into ordinary tokens), the
repository's test templates (tests/templates/), and random conversations of every shape the chat
path must handle (system or not, 1-6 turns, tool calls and results, reasoning, empty content,
non-ASCII, long)."""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
SPECIAL = ["<|endoftext|>", "<|MASK|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
_CORPUS = [
    "def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.", "Grüße aus Köln — ça va?",
    "数据 并行 训练", "for i in range(10):\n    print(i)\n", "user assistant system tool", "Ünïcödé ✓ 🙂",
    "import numpy as np\nx = np.zeros(3)\n", "What is 2 + 2? It is 4.", "Let me think step by step.",
]


def make_tokenizer(folder: Path, template: str | None = "qwen3_style", vocab: int = 400,
                   markers: str = "special") -> Path:
    """A tokenizer folder (tokenizer.json + tokenizer_config.json, with `template`'s chat template
    unless None) whose ids stay below `vocab`; returns the folder.

    `markers`: "special": <|im_start|>, <|im_end|> and the think and tool tags are tokens of their
    own. "split" and "merged": like the pycode fixture's tokenizer, only <|endoftext|> (id 0, the
    eos) and <|MASK|> are special and the ChatML markers are ordinary text, learnt over rendered
    chats; "split" with GPT-2's pre-tokenizer (the newline after <|im_end|> a token of its own, as
    in pycode), "merged" with no pre-tokenizer split, so that tokens span the end of turn and the
    newline after it (`.<|im_end|>\n`), and the generation prompt and the reply."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    plain = markers != "special"
    special = SPECIAL[:2] if plain else SPECIAL
    corpus = _CORPUS
    if plain:
        corpus = [f"<|im_start|>user\n{a}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{b}<|im_end|>\n"
                  for a, b in zip(_CORPUS, _CORPUS[1:] + _CORPUS[:1])]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=markers != "merged")
    tok.decoder = decoders.ByteLevel()
    added = [] if plain else ADDED
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(special) - len(added), special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus * 20, trainer)
    eos = "<|endoftext|>" if plain else "<|im_end|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                   mask_token="<|MASK|>")
    fast.add_tokens(added)
    if template is not None:
        fast.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    fast.save_pretrained(folder)
    return folder


_WORDS = ["alpha", "beta", "def", "return", "x = 1", "Köln", "naïve", "数据", "🙂", "print('hi')", "\n", "  ",
          "{", "}", "<", ">", "&", "\\n", "'", '"', "#", "tab\there"]


def _text(rng: random.Random, long: bool = False) -> str:
    n = rng.choice([0, 1, 3, 8, 20]) if not long else rng.randint(200, 400)
    return " ".join(rng.choice(_WORDS) for _ in range(n)).strip(" ") if n else ""


def random_conversation(rng: random.Random, tools: bool = True, reasoning: bool = True) -> list[dict]:
    """OpenAI-style messages: an optional system turn, 1-6 user turns each answered by an assistant
    (sometimes through tool calls and tool results), ending with an assistant turn."""
    msgs: list[dict] = []
    if rng.random() < 0.4:
        msgs.append({"role": "system", "content": _text(rng) or "You are helpful."})
    for _ in range(rng.randint(1, 6)):
        msgs.append({"role": "user", "content": _text(rng, long=rng.random() < 0.05) or "?"})
        if tools and rng.random() < 0.2:
            call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": _text(rng)}}}
            msgs.append({"role": "assistant", "content": _text(rng), "tool_calls": [call]})
            msgs.append({"role": "tool", "content": _text(rng) or "{}"})
        reply = {"role": "assistant", "content": _text(rng, long=rng.random() < 0.05)}
        if reasoning and rng.random() < 0.5:
            reply["reasoning_content"] = _text(rng) or "hmm"
        msgs.append(reply)
    return msgs


def conversations(n: int, seed: int = 0) -> list[dict]:
    """`n` records `{"id": i, "messages": random_conversation}`, the same for the same seed."""
    rng = random.Random(seed)
    return [{"id": i, "messages": random_conversation(rng)} for i in range(n)]


def manifest(folder: Path) -> dict:
    """A part folder's manifest.json."""
    return json.loads((Path(folder) / "manifest.json").read_text())


def to_sharegpt(msgs: list[dict]) -> list[dict]:
    names = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in msgs]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def make_chat_target(base: Path, out: Path, template: str | None = "qwen3_style", markers: str = "special") -> Path:
    """A copy of a tiny target folder with a chat tokenizer (ids below the tiny vocabulary) and
    <|im_end|> as its end-of-sequence token in generation_config.json (`markers` other than
    "special", `make_tokenizer`: <|im_end|> is ordinary text and <|endoftext|> the eos, as in the
    pycode fixture)."""
    import shutil

    out = Path(out)
    shutil.copytree(base, out)
    make_tokenizer(out, template, markers=markers)
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("<|im_end|>" if markers == "special" else "<|endoftext|>")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return out


def oracle(tok, template: str, msgs: list[dict], **kwargs) -> tuple[list[int], list[int]]:
    """transformers' own rendering and assistant mask of `msgs` ({% generation %} spans)."""
    out = tok.apply_chat_template(msgs, chat_template=template, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True, **kwargs)
    return list(out["input_ids"]), list(out["assistant_masks"])


def read_parts(folder: Path) -> list[dict]:
    """The rows of a part folder (prepare or generate output), in part order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(Path(folder).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]).to_pylist() if files else []
