"""A small *trained* chat target made from the pycode fixture: its 17M-parameter Qwen3 taught to
answer "continue this Python code" conversations in a Qwen3-style chat template with <think> blocks.

What it makes (everything deterministic from --seed; the fine-tune itself is as deterministic as
the device's kernels):

1. The tokenizer: the pycode tokenizer (byte-level BPE, vocab 8192, `<|endoftext|>` = 0,
   `<|MASK|>` = 1) plus the special tokens `<|im_start|>` = 8192, `<|im_end|>` = 8193 and the
   added tokens `<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`,
   `</tool_response>` (8194-8199: what the template writes as single tokens); eos `<|im_end|>`, pad
   `<|endoftext|>`; the chat template is tests/templates/qwen3_style.jinja, in tokenizer_config.json
   as `chat_template`. generation_config.json: eos_token_id [8193, 0].
2. Conversations from the pycode data (token ids decoded to Python text): the user asks to
   continue a piece of code (```python fenced), the assistant thinks briefly (a sentence derived
   from the code: the def/class it is in, its last line; under 40 tokens) and answers with the next
   lines of the same source text, fenced. 1-3 turns (follow-ups "Continue." and the like, each
   answered with the next lines), a system message in 30% of them, every one under 1200 tokens
   rendered. Sources: `completions-*.parquet` (prompt + the pycode target's own greedy completion,
   up to 512 tokens: longer replies) and `prompts-train-40k.parquet` (128 tokens of real source: short
   replies). Held-out conversations come only from `completions-eval.parquet` (held-out files).
3. `--write-files DIR` (the repository's copy: benchmarks/chat_fixture): the committed material: tokenizer files,
   the template, generation_config.json, and 300 train + 100 eval conversations in three formats
   (OpenAI `messages` JSONL with `reasoning_content`, ShareGPT JSON with the think block inline,
   single-turn prompt/response JSONL). It does not train and touches no model.
4. The fine-tune (the default action): the pycode target loaded in fp32 (bf16 autocast on CUDA),
   its embedding resized to 8200 rows (new rows = the mean of the old ones; tied LM head), trained on
   --conversations conversations made on the fly from prompts-train-40k and completions-train (one row
   per assistant turn, rendered as a server renders that turn: the loss only on what the assistant
   writes, from `apply_chat_template(..., return_assistant_tokens_mask=True)`; the template's
   {% generation %} marks it), AdamW, linear warmup and cosine decay. Held-out loss on the assistant
   tokens of the 200 held-out conversations before and after, a greedy reply, then the model saved
   in bf16 (save_pretrained, like the pycode fixture) with the tokenizer and generation_config.json,
   and the figures in OUT/fixture.json.

    python benchmarks/chat_fixture.py --device cuda                     # -> .fixtures/chat/target
    python benchmarks/chat_fixture.py --write-files benchmarks/chat_fixture
    python benchmarks/chat_fixture.py --smoke                           # CPU, ~10 steps, a temp folder

`--smoke` fine-tunes on the CPU for 10 steps on a handful of conversations into a temporary folder
(or --out), to check the script; its model is a chat target only in form.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tests" / "templates" / "qwen3_style.jinja"
SPECIAL = ["<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MAX_RENDERED = 1200  # tokens: every conversation, rendered whole, stays under this
EVAL_ID_BASE = 100_000  # eval conversation ids: EVAL_ID_BASE + row id of completions-eval

SYSTEMS = [
    "You are a helpful assistant that writes Python.",
    "You continue Python source code from the standard library.",
    "You are a coding assistant. Answer with code only.",
    "You are an expert Python programmer.",
]
ASKS = [
    "Continue this Python code:\n```python\n{code}```",
    "Complete the following Python code.\n\n```python\n{code}```",
    "What comes next in this code?\n```python\n{code}```",
    "Continue this Python code:\n```python\n{code}```",
]
FOLLOW_UPS = ["Continue.", "Go on.", "Keep going.", "Continue the code."]
_HEADER = re.compile(r"^([ \t]*)(?:async[ \t]+)?(def|class)[ \t]+(\w+)")


# ----------------------------------------------------------------------------------------------
# The tokenizer


def build_tokenizer(pycode_target: Path):
    """The pycode tokenizer with the chat tokens and the template (not yet saved)."""
    from transformers import AddedToken, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pycode_target))
    assert len(tok) == 8192 and tok.convert_tokens_to_ids("<|endoftext|>") == 0, "not the pycode tokenizer"
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok.chat_template = TEMPLATE.read_text()
    ids = tok.convert_tokens_to_ids(SPECIAL + ADDED)
    assert ids == list(range(8192, 8200)), ids
    return tok


def save_tokenizer(tok, folder: Path) -> None:
    """save_pretrained, then the template moved into tokenizer_config.json as `chat_template` (as
    model folders on the hub carry it) and the class named as the pycode fixture names it."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("is_local", "local_files_only"):
        cfg.pop(k, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = TEMPLATE.read_text()
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def generation_config() -> dict:
    return {"bos_token_id": 0, "do_sample": False, "eos_token_id": [8193, 0], "pad_token_id": 0}


# ----------------------------------------------------------------------------------------------
# Conversations


def _scope_and_last(text: str) -> tuple[str | None, str]:
    """The def/class the last non-blank line of `text` sits in (the nearest header above it with a
    smaller indentation, or the line itself when it is a header), and that line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None, ""
    last = lines[-1]
    m = _HEADER.match(last)
    if m:
        return f"{m.group(2)} {m.group(3)}", last.strip()
    indent = len(last) - len(last.lstrip())
    for ln in reversed(lines[:-1]):
        m = _HEADER.match(ln)
        if m and len(m.group(1).expandtabs()) < indent:
            return f"{m.group(2)} {m.group(3)}", last.strip()
    return None, last.strip()


def reasoning(before: str, first: bool, count=len, most: int = 39) -> str:
    """A short deterministic thought about the code so far: at most `most` tokens by `count`
    (the code's last line, then the def/class name, shortened until it fits)."""
    for limit in (40, 32, 24, 16, 8, 0):
        text = _reasoning(before, first, limit)
        if count(text) <= most:
            break
    return text


def _reasoning(before: str, first: bool, limit: int) -> str:
    scope, last = _scope_and_last(before)
    header = _HEADER.match(last) is not None
    last = last.replace("`", "'")
    if len(last) > limit:
        last = last[:limit].rstrip() + "..."
    if scope and len(scope) > limit + 8:
        scope = scope[:limit + 8] + "..."
    where = f"inside `{scope}`" if scope else "in an indented block" if before_indent(before) else "at module level"
    if first:
        if header:
            return f"The code ends with the header `{scope}`. I write its body from the next line."
        return f"The code is {where}; its last line is `{last}`. I continue from the next line."
    return f"Continuing {where} after `{last}`."


def before_indent(text: str) -> int:
    """The indentation of the last non-blank line of `text`."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return len(lines[-1]) - len(lines[-1].lstrip()) if lines else 0


def _cuts(counts: list[int], start: int, budget: int) -> int:
    """The line index after `start` where `budget` tokens are first reached (at least one line)."""
    got, i = 0, start
    while i < len(counts) and (got < budget or i == start):
        got += counts[i]
        i += 1
    return i


def conversation(lines: list[str], counts: list[int], rng: random.Random, long: bool, count=len) -> list[dict] | None:
    """One conversation over a source text given as lines (with their token counts): code to
    continue, then 1-3 replies of the following lines. None when the text is too short."""
    if long:  # prompt + completion, up to 512 tokens
        code_budget, reply_range = rng.randint(64, 128), (40, 120)
    else:  # 128 tokens of real source
        code_budget, reply_range = rng.randint(40, 72), (16, 40)
    turns = rng.choices([1, 2, 3], weights=[0.4, 0.35, 0.25])[0]
    end_code = _cuts(counts, 0, code_budget)
    code = "".join(lines[:end_code])
    if not code.strip():
        return None
    replies, at = [], end_code
    for _ in range(turns):
        if at >= len(lines):
            break
        nxt = _cuts(counts, at, rng.randint(*reply_range))
        while nxt < len(lines) and not "".join(lines[at:nxt]).strip():
            nxt += 1
        chunk = "".join(lines[at:nxt])
        if not chunk.strip():
            break
        replies.append((at, chunk))
        at = nxt
    if not replies:
        return None
    msgs: list[dict] = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for k, (at, chunk) in enumerate(replies):
        user = rng.choice(ASKS).format(code=code) if k == 0 else rng.choice(FOLLOW_UPS)
        msgs.append({"role": "user", "content": user})
        msgs.append({"role": "assistant", "content": f"```python\n{chunk}```",
                     "reasoning_content": reasoning("".join(lines[:at]), k == 0, count)})
    return msgs


class Source:
    """The pycode data decoded into lines, conversations made per row (each from its own rng,
    keyed by seed, file and row id: the same conversation whatever else is made)."""

    def __init__(self, fixture: Path, seed: int):
        from transformers import AutoTokenizer

        self.fixture, self.seed = fixture, seed
        self.tok = AutoTokenizer.from_pretrained(str(fixture / "target"))
        self.backend = self.tok.backend_tokenizer

    def count(self, text: str) -> int:
        return len(self.backend.encode(text, add_special_tokens=False).ids)

    def rows(self, name: str, limit: int | None = None) -> list[tuple[int, list[int]]]:
        import pyarrow.parquet as pq

        t = pq.read_table(self.fixture / name, columns=["id", "input_ids"])
        if limit is not None:
            t = t.slice(0, limit)
        return list(zip(t.column("id").to_pylist(), t.column("input_ids").to_pylist()))

    def make(self, name: str, rows: list[tuple[int, list[int]]], id_base: int = 0) -> list[dict]:
        """Records {"id", "source", "messages"} of these rows (rows too short give none)."""
        texts = self.tok.batch_decode([ids for _, ids in rows], skip_special_tokens=True)
        out = []
        for (rid, _), text in zip(rows, texts):
            lines = text.splitlines(keepends=True)
            if lines and not lines[-1].endswith("\n"):
                lines = lines[:-1]  # cut mid-line at the token limit
            if len(lines) < 2:
                continue
            counts = [len(e.ids) for e in self.backend.encode_batch(lines, add_special_tokens=False)]
            rng = random.Random(f"{self.seed}:{name}:{rid}")
            msgs = conversation(lines, counts, rng, name.startswith("completions"), self.count)
            if msgs is not None:
                out.append({"id": id_base + int(rid), "source": f"{name}:{rid}", "messages": msgs})
        return out


def rendered_len(tok, msgs: list[dict]) -> int:
    return len(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])


def keep_short(tok, records: list[dict]) -> list[dict]:
    return [r for r in records if rendered_len(tok, r["messages"]) < MAX_RENDERED]


def to_sharegpt(rec: dict) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    conv = []
    for m in rec["messages"]:
        value = m["content"]
        if m.get("reasoning_content"):
            value = f"<think>\n{m['reasoning_content']}\n</think>\n\n{value}"
        conv.append({"from": names[m["role"]], "value": value})
    return {"id": rec["id"], "source": rec["source"], "conversations": conv}


def to_pair(rec: dict) -> dict:
    """Single-turn: the first question and its answer (think block inline)."""
    msgs = rec["messages"]
    system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
    user = next(m for m in msgs if m["role"] == "user")
    reply = next(m for m in msgs if m["role"] == "assistant")
    out = {"id": rec["id"], "source": rec["source"]}
    if system:
        out["system"] = system
    out["prompt"] = user["content"]
    out["response"] = f"<think>\n{reply['reasoning_content']}\n</think>\n\n{reply['content']}"
    return out


def committed_sets(src: Source, tok, n_train: int = 300, n_eval: int = 100) -> dict[str, list[dict]]:
    """The committed conversations: n_train from completions-train (a seeded sample of rows), the
    first n_eval usable ones from completions-eval (held-out files)."""
    train_rows = src.rows("completions-train.parquet")
    pick = sorted(random.Random(f"{src.seed}:committed").sample(range(len(train_rows)), min(len(train_rows),
                                                                                          n_train * 2)))
    train = keep_short(tok, src.make("completions-train.parquet", [train_rows[i] for i in pick]))[:n_train]
    evals = keep_short(tok, src.make("completions-eval.parquet", src.rows("completions-eval.parquet"),
                                     EVAL_ID_BASE))[:n_eval]
    return {"train": train, "eval": evals}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def write_files(fixture: Path, dest: Path, seed: int, n_train: int = 300, n_eval: int = 100) -> dict:
    """The committed material (see the module doc); returns counts."""
    dest.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(fixture / "target")
    save_tokenizer(tok, dest)
    (dest / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
    shutil.copyfile(TEMPLATE, dest / "qwen3_style.jinja")
    src = Source(fixture, seed)
    sets = committed_sets(src, tok, n_train, n_eval)
    counts = {}
    for split, recs in sets.items():
        write_jsonl(dest / f"{split}.messages.jsonl", recs)
        (dest / f"{split}.sharegpt.json").write_text(
            json.dumps([to_sharegpt(r) for r in recs], ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        write_jsonl(dest / f"{split}.pairs.jsonl", [to_pair(r) for r in recs])
        counts[split] = {"conversations": len(recs), "turns": sum(len(turn_indices(r["messages"])) for r in recs),
                         "tokens_rendered": sum(rendered_len(tok, r["messages"]) for r in recs)}
    counts["bytes"] = sum(f.stat().st_size for f in dest.iterdir() if f.is_file())
    return counts


# ----------------------------------------------------------------------------------------------
# Training rows


def turn_indices(msgs: list[dict]) -> list[int]:
    return [i for i, m in enumerate(msgs) if m["role"] == "assistant"]


_TOK = None


def _init_worker(folder: str) -> None:
    global _TOK
    from transformers import AutoTokenizer

    _TOK = AutoTokenizer.from_pretrained(folder)


def render_rows(msgs: list[dict]) -> list[tuple[list[int], list[int]]]:
    """One row per assistant turn, each the conversation up to that turn as the template renders
    it when that turn is the one written (earlier turns' thinking dropped): (input_ids, mask)."""
    out = []
    for a in turn_indices(msgs):
        enc = _TOK.apply_chat_template(msgs[:a + 1], tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
    return out


def render_all(convs: list[list[dict]], tok_folder: Path, workers: int) -> list[tuple[list[int], list[int]]]:
    if workers <= 1:
        _init_worker(str(tok_folder))
        return [r for c in convs for r in render_rows(c)]
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(workers, _init_worker, (str(tok_folder),)) as pool:
        return [r for rows in pool.imap(render_rows, convs, chunksize=64) for r in rows]


def batches(rows: list, batch: int, steps: int, rng: random.Random):
    """`steps` batches of `batch` rows, epochs of shuffled rows."""
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch:
            perm = list(range(len(rows)))
            rng.shuffle(perm)
            order.extend(perm)
        yield [rows[i] for i in order[:batch]]
        del order[:batch]


def collate(rows, device):
    import torch

    n = max(len(ids) for ids, _ in rows)
    ids = torch.zeros((len(rows), n), dtype=torch.long)
    att = torch.zeros((len(rows), n), dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    for r, (x, m) in enumerate(rows):
        t = torch.tensor(x)
        ids[r, :len(x)] = t
        att[r, :len(x)] = 1
        labels[r, :len(x)] = torch.where(torch.tensor(m, dtype=torch.bool), t, torch.tensor(-100))
    return ids.to(device), att.to(device), labels.to(device)


def loss_sum(model, rows, device, autocast):
    """(sum of assistant-token losses, tokens, correct greedy predictions)."""
    import torch.nn.functional as F

    ids, att, labels = collate(rows, device)
    with autocast():
        logits = model(input_ids=ids, attention_mask=att).logits
    logits, target = logits[:, :-1].float(), labels[:, 1:]
    valid = target != -100
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                           reduction="sum")
    correct = ((logits.argmax(-1) == target) & valid).sum()
    return loss, int(valid.sum()), int(correct)


def heldout(model, rows, device, autocast, batch: int) -> dict:
    import torch

    model.eval()
    tot = n = ok = 0
    with torch.no_grad():
        for a in range(0, len(rows), batch):
            loss, k, c = loss_sum(model, rows[a:a + batch], device, autocast)
            tot, n, ok = tot + float(loss), n + k, ok + c
    model.train()
    return {"loss": tot / max(n, 1), "accuracy": ok / max(n, 1), "tokens": n}


def sample_reply(model, tok, msgs: list[dict], device, max_new: int) -> str:
    import torch

    first = turn_indices(msgs)[0]
    prompt = tok.apply_chat_template(msgs[:first], add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = torch.tensor([list(prompt["input_ids"])], device=device)
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=[8193, 0], pad_token_id=0)
    model.train()
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)


# ----------------------------------------------------------------------------------------------
# The fine-tune


def finetune(args) -> dict:
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    t_start = time.time()
    fixture = Path(args.fixture).absolute()
    out = Path(args.out).absolute()
    if out.exists() and any(out.iterdir()) and not (out / "fixture.json").is_file():
        raise SystemExit(f"--out {out}: the folder holds something other than a chat fixture target (replaced "
                         "when made again); give a new or empty folder")
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tok = build_tokenizer(fixture / "target")
    tok_dir = Path(tempfile.mkdtemp(prefix="chat-tok-"))
    save_tokenizer(tok, tok_dir)

    src = Source(fixture, args.seed)
    rng = random.Random(f"{args.seed}:finetune")
    # The pool: --long-share of it from completions-train (longer replies), the rest from
    # prompts-train-40k (short real-source replies), shuffled.
    n_long = 0 if args.smoke else min(4000, round(args.conversations * args.long_share))
    long_rows = src.rows("completions-train.parquet", n_long)
    short_rows = src.rows("prompts-train-40k.parquet", args.conversations - n_long)
    convs = [r["messages"] for r in src.make("completions-train.parquet", long_rows)
             + src.make("prompts-train-40k.parquet", short_rows)]
    rng.shuffle(convs)
    eval_recs = src.make("completions-eval.parquet", src.rows("completions-eval.parquet", args.heldout),
                         EVAL_ID_BASE)
    t0 = time.time()
    rows = render_all(convs, tok_dir, args.workers)
    _init_worker(str(tok_dir))
    eval_rows = [r for rec in eval_recs for r in render_rows(rec["messages"])]
    rows = [r for r in rows if len(r[0]) <= MAX_RENDERED]
    render_s = time.time() - t0
    trained_tokens = sum(sum(m) for _, m in rows)
    print(f"{len(convs)} conversations -> {len(rows)} training rows ({sum(len(x) for x, _ in rows):,} tokens, "
          f"{trained_tokens:,} on assistant spans), {len(eval_recs)} held-out conversations -> {len(eval_rows)} rows; "
          f"rendered in {render_s:.1f}s", flush=True)

    model = AutoModelForCausalLM.from_pretrained(str(fixture / "target"), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[old:] = emb[:old].mean(0, keepdim=True)
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr(), "the LM head is no longer tied"
    model.config.eos_token_id = 8193
    model.config.bos_token_id = model.config.pad_token_id = 0
    model.generation_config.update(**generation_config())
    model.to(device)
    model.train()

    def autocast():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    before = heldout(model, eval_rows, device, autocast, args.batch)
    print(f"held-out assistant tokens before: loss {before['loss']:.3f}, accuracy {before['accuracy']:.3f} "
          f"({before['tokens']} tokens)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    warmup = max(1, int(args.steps * args.warmup))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        p = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * p)))

    t_train = time.time()
    losses, seen = [], 0
    for step, rows_b in enumerate(batches(rows, args.batch, args.steps, rng)):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss, n, _ = loss_sum(model, rows_b, device, autocast)
        (loss / max(n, 1)).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += n
        losses.append(float(loss.detach()) / max(n, 1))
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step + 1}/{args.steps}: loss {losses[-1]:.3f}, lr {lr_at(step):.2e}, "
                  f"grad norm {float(gnorm):.2f}, {time.time() - t_train:.0f}s", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_train
    after = heldout(model, eval_rows, device, autocast, args.batch)
    print(f"held-out assistant tokens after: loss {after['loss']:.3f}, accuracy {after['accuracy']:.3f}", flush=True)
    sample = sample_reply(model, tok, eval_recs[0]["messages"], device, args.sample_tokens)
    print(f"sample greedy reply to held-out conversation {eval_recs[0]['id']} ({eval_recs[0]['source']}):\n"
          f"{sample}\n", flush=True)

    if out.exists():  # checked at the start: a chat target made earlier, or an empty folder
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
    save_tokenizer(tok, out)
    shutil.rmtree(tok_dir, ignore_errors=True)
    figures = {
        "made_by": "benchmarks/chat_fixture.py", "seed": args.seed, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "steps": args.steps, "batch": args.batch, "lr": args.lr, "warmup": warmup,
        "conversations": len(convs), "rows": len(rows), "trained_tokens_in_pool": trained_tokens,
        "assistant_tokens_seen": seen, "heldout_conversations": len(eval_recs), "heldout_before": before,
        "heldout_after": after, "train_loss_first": losses[0], "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]),
        "render_s": render_s, "train_s": train_s, "total_s": time.time() - t_start, "sample_reply": sample,
        "vocab_size": len(tok),
    }
    (out / "fixture.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(f"saved {out} ({train_s:.0f}s of training, {time.time() - t_start:.0f}s in all)", flush=True)
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default=str(ROOT.parent / "shared" / "fixtures" / "pycode"),
                    help="the pycode fixture folder (target/, *.parquet)")
    ap.add_argument("--out", default=None, help="the chat target folder (default .fixtures/chat/target; with "
                                                "--smoke a temporary folder)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=64, help="rows (assistant turns) per step")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=float, default=0.1, help="share of the steps with linear warmup")
    ap.add_argument("--min-lr", type=float, default=0.1, help="the cosine ends at this share of --lr")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=32000,
                    help="conversations made for the fine-tune (from completions-train and prompts-train-40k)")
    ap.add_argument("--long-share", type=float, default=0.125,
                    help="share of the conversations made from completions-train (at most its 4000 rows)")
    ap.add_argument("--heldout", type=int, default=200, help="completions-eval rows for the held-out loss")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="rendering processes")
    ap.add_argument("--threads", type=int, default=1, help="CPU compute threads (--device cpu)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--sample-tokens", type=int, default=160)
    ap.add_argument("--write-files", metavar="DIR", default=None,
                    help="write the committed material (tokenizer, template, conversations) into DIR and stop")
    ap.add_argument("--smoke", action="store_true", help="CPU, 10 steps on a few conversations, a temporary folder")
    args = ap.parse_args()
    if args.write_files:
        counts = write_files(Path(args.fixture).absolute(), Path(args.write_files), args.seed)
        print(json.dumps(counts, indent=1))
        return 0
    if args.smoke:
        args.device, args.steps, args.batch, args.conversations, args.heldout = "cpu", 10, 2, 16, 2
        args.workers, args.log_every, args.sample_tokens = 0, 2, 48
        if args.out is None:
            args.out = tempfile.mkdtemp(prefix="chat-fixture-smoke-") + "/target"
    if args.out is None:
        args.out = str(ROOT / ".fixtures" / "chat" / "target")
    if args.device.startswith("cpu"):
        import torch

        # One compute thread by default: on a shared machine several OpenMP threads that spin while
        # other processes hold the cores were measured 15x slower than one.
        torch.set_num_threads(args.threads)
    finetune(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
