"""A tiny *chat* target and its conversations, made on the CPU in seconds (`dflash-offline demo
--chat`): what the chat walk-through of docs/own-data.md runs on without a GPU.

The conversations are counting chats: the user gives the first numbers of a progression (a start
below 20, a step of 1 to 3), the assistant goes on counting up to at most 40 and ends its turn; some
have a system message and a second user turn ("and from 7 5 3"?: a new progression). The tokenizer
is a byte-level BPE trained here on the rendered conversations, with the ChatML markers as special
tokens, `<|im_end|>` the end of sequence (what ends a reply), `<|endoftext|>` the padding and
`<|MASK|>` the drafter's mask token, and a ChatML chat template that marks what the assistant writes
({% generation %}). The model is the tiny dense Qwen3 (tiny.py's widths) trained for a few hundred
steps on the rendered conversations: enough that its replies count on and end, so `generate`
regenerates them in a few tokens each, and a drafter has something to learn.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from dflash_offline.demo import claim_out
from dflash_offline.runtime.launch import single_thread_compute

SPECIAL = ["<|endoftext|>", "<|MASK|>", "<|im_start|>", "<|im_end|>"]  # ids 0..3
TOP = 40  # replies count up to at most this number
CHATML = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{%- generation -%}{{- message.content + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _turn(rng: np.random.Generator) -> tuple[str, str]:
    """(user, assistant): the first three numbers of a progression, and the rest of it up to TOP."""
    start, step = int(rng.integers(0, 20)), int(rng.integers(1, 4))
    seq = list(range(start, TOP + 1, step))
    return " ".join(map(str, seq[:3])), " ".join(map(str, seq[3:]))


def conversations(n: int, seed: int = 0) -> list[dict]:
    """n conversations in OpenAI `messages` form, each with an id."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Count on."}] if rng.random() < 0.3 else []
        for k in range(1 if rng.random() < 0.6 else 2):
            user, reply = _turn(rng)
            msgs += [{"role": "user", "content": user if k == 0 else f"and {user}"},
                     {"role": "assistant", "content": reply}]
        out.append({"id": i, "messages": msgs})
    return out


def render(messages: list[dict]) -> str:
    """The conversation as the ChatML template above renders it (to train the tokenizer and the model on)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def make_tokenizer(folder: Path, texts: list[str], vocab: int = 320) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   mask_token="<|MASK|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)


def make_chat_target(folder: str | Path, chats: list[dict], steps: int = 300, batch: int = 16, lr: float = 3e-3,
                     seed: int = 0) -> dict:
    """The tokenizer and a tiny Qwen3 trained on the rendered `chats`, saved in `folder` with
    `<|im_end|>` as its end of sequence. Returns {steps, loss, seconds, vocab}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_offline.tiny import tiny_config

    single_thread_compute()  # as every stage's compute (tiny.py says why)
    folder = Path(folder)
    texts = [render(c["messages"]) for c in chats]
    make_tokenizer(folder, texts)
    tok = AutoTokenizer.from_pretrained(folder)
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    cfg = tiny_config("qwen3")
    cfg.vocab_size = len(tok)
    cfg.eos_token_id = cfg.pad_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    pad = tok.pad_token_id
    t0, loss = time.time(), None
    model.train()
    for _ in range(steps):
        pick = [rows[int(i)] for i in rng.integers(0, len(rows), size=batch)]
        width = max(map(len, pick))
        x = torch.full((batch, width), pad, dtype=torch.long)
        for r, ids in enumerate(pick):
            x[r, :len(ids)] = torch.tensor(ids)
        labels = x.masked_fill(x == pad, -100)
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for c in (model.config, model.generation_config):
        c.eos_token_id, c.pad_token_id = end, pad
    model.save_pretrained(folder)
    return {"steps": steps, "loss": float(loss.detach()), "seconds": time.time() - t0, "vocab": len(tok)}


def make_chat_demo(out: str | Path, n: int = 240) -> tuple[Path, Path, dict]:
    """OUT/target (the tiny chat target) and OUT/chats.jsonl (n conversations), made anew where
    absent. -> (target, chats, what the training did, or {} when the target was there)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    chats = conversations(n)
    data = out / "chats.jsonl"
    if not data.exists():
        tmp = out / ".chats.jsonl.tmp"
        tmp.write_text("".join(json.dumps(c) + "\n" for c in chats))
        tmp.rename(data)
    target = out / "target"
    fit = {}
    if not (target / "config.json").exists():
        tmp = out / ".target.tmp"  # renamed into place once trained: a killed run leaves no half-made target
        shutil.rmtree(tmp, ignore_errors=True)
        fit = make_chat_target(tmp, chats)
        tmp.rename(target)
    return target, data, fit


WALK_THROUGH = """\
dflash-offline prepare --target {o}/target --data {o}/chats.jsonl --out {o}/prompts --eval-fraction 0.1
dflash-offline generate --target {o}/target --prompts {o}/prompts/train --out {o}/completions --devices cpu
dflash-offline extract --target {o}/target --data {o}/completions --cache {o}/cache --devices cpu --topk 8
dflash-offline train --method dspark --target {o}/target --cache {o}/cache --out {o}/drafter --devices cpu \\
    --drafter-layers 2 --block-size 8 --num-anchors 16 --seq-len 256 --global-batch-tokens 512 --lr 3e-3 --epochs 16
dflash-offline export --run {o}/drafter
dflash-offline eval --target {o}/target --drafter {o}/drafter/export --prompts {o}/prompts/eval"""


def demo(out: str) -> None:
    """`dflash-offline demo --chat`: the target and conversations in OUT, then the commands that follow."""
    root = Path(out)
    claim_out(root)
    target, data, fit = make_chat_demo(root)
    if fit:
        print(f"target:   trained a tiny chat Qwen3 ({target}) for {fit['steps']} steps on {data.name} in "
              f"{fit['seconds']:.0f} s (loss {fit['loss']:.3f}); its replies count on and end with <|im_end|>")
    else:
        print(f"target:   {target} (made earlier)")
    print(f"data:     {data} (conversations in OpenAI `messages` form)")
    print("next (docs/own-data.md, 'A walk-through on a CPU'):")
    print("\n".join("  " + line for line in WALK_THROUGH.format(o=root.as_posix()).splitlines()))
