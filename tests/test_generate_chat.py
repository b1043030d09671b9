"""Multi-turn `generate` on conversation prompts (a `prepare` output): equal to a brute-force greedy
turn-by-turn decode (fp32, no cache, one conversation at a time, the chat template applied by
transformers), on tiny dense and hybrid targets, batched over conversations of mixed lengths and
turn counts, on two workers; and SIGKILL at three moments, then a rerun equal to an uninterrupted run."""

from __future__ import annotations

import json
import random

import pytest

import _chat
from conftest import run_cli, tree_digest

NEW = 8
GEN = ["--max-new-tokens", str(NEW), "--chunk-prompts", "5", "--compute-dtype", "float32", "--no-progress"]


def _conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = _chat.random_conversation(rng)
        users = [k for k, m in enumerate(msgs) if m["role"] == "user"]
        keep = users[rng.randint(1, min(3, len(users))) - 1]  # 1-3 user turns, the rest cut
        cut = msgs[:keep + 1]
        if rng.random() < 0.5:  # half end with the assistant's (original) reply, half with the user
            cut = msgs[:next((k for k in range(keep + 1, len(msgs)) if msgs[k]["role"] == "assistant"), keep) + 1]
        out.append({"id": 10 * i + 7, "messages": cut})
    return out


@pytest.fixture(scope="module")
def chat_targets(tiny_dense, tiny_hybrid, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-targets")
    return {"dense": _chat.make_chat_target(tiny_dense, root / "dense"),
            "hybrid": _chat.make_chat_target(tiny_hybrid, root / "hybrid")}


def _prepared(target, tmp_path, n=10, seed=11):
    data = _chat.write_jsonl(tmp_path / "chats.jsonl", _conversations(n, seed))
    out = tmp_path / "prepared"
    r = run_cli(["prepare", "--target", target, "--data", data, "--out", out, "--max-len", "600", "--no-progress"])
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "train"


def _greedy(model, prompt: list[int], eos: set[int]) -> list[int]:
    import torch

    seq = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(nxt)
            if nxt in eos:
                break
    return seq[len(prompt):]


def brute_force(target, prompts_folder, last_only: bool = False) -> list[dict]:
    """Rows as the docs define them, computed the slow, obvious way."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    eos = set(json.loads((target / "generation_config.json").read_text())["eos_token_id"])
    rows = []
    for p in _chat.read_parts(prompts_folder):
        msgs = json.loads(p["messages"])
        slots = [k for k, m in enumerate(msgs) if m["role"] == "assistant" and not m.get("tool_calls")]
        if last_only:  # the final reply, and earlier replies the dataset lacks (prepare's empty slots)
            slots = [k for k in slots[:-1] if not msgs[k]["content"] and not msgs[k].get("reasoning_content")] + slots[-1:]
        conv_rows: list[dict] = []
        for a in slots:
            turn = sum(m["role"] == "assistant" for m in msgs[:a])  # assistant turns counted from 0
            text = tok.apply_chat_template(msgs[:a], tokenize=False, add_generation_prompt=True)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            if len(prompt) + NEW > 1024:
                break
            reply = _greedy(model, prompt, eos)
            ended = bool(reply) and reply[-1] in eos
            body = tok.decode(reply[:-1] if ended else reply, skip_special_tokens=False)
            reasoning, content = None, body
            if "</think>" in body:
                head, _, tail = body.partition("</think>")
                reasoning, content = head.split("<think>")[-1].strip("\n"), tail.lstrip("\n")
            elif body.lstrip().startswith("<think>"):  # never closed: all reasoning
                reasoning, content = body.split("<think>", 1)[1].strip("\n"), ""
            msgs[a] = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
            finish = "eos" if ended else "length"
            last = conv_rows[-1] if conv_rows else None
            if last is not None and prompt[:len(last["input_ids"])] == last["input_ids"]:
                gap = len(prompt) - len(last["input_ids"])
                last["loss_mask"] = last["loss_mask"] + [0] * gap + [1] * len(reply)
                last["input_ids"] = prompt + reply
                last["turns"].append(turn)
                last["finish_reason"] = finish
            else:
                conv_rows.append({"input_ids": prompt + reply, "loss_mask": [0] * len(prompt) + [1] * len(reply),
                                  "turns": [turn], "finish_reason": finish})
        for k, row in enumerate(conv_rows):
            rows.append({"id": p["id"] + k * (1 << 40), "conversation_id": p["id"], **row})
    return sorted(rows, key=lambda r: r["id"])


def _output(folder) -> list[dict]:
    keys = ("id", "conversation_id", "input_ids", "loss_mask", "turns", "finish_reason")
    return sorted(({k: r[k] for k in keys} for r in _chat.read_parts(folder)), key=lambda r: r["id"])


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_multi_turn_generate_equals_brute_force(chat_targets, tmp_path, kind):
    target = chat_targets[kind]
    prompts = _prepared(target, tmp_path)
    out = tmp_path / "gen"
    r = run_cli(["generate", "--target", target, "--prompts", prompts, "--out", out, "--devices", "cpu,cpu", *GEN])
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = _output(out), brute_force(target, prompts)
    conversations = {p["id"] for p in _chat.read_parts(prompts)}
    assert len(conversations) >= 6 and {r["conversation_id"] for r in want} == conversations
    assert sum(len(r["turns"]) for r in want) > 10  # several turns per conversation, in rows
    assert got == want
    m = json.loads((out / "manifest.json").read_text())
    assert m["chat"]["template_sha256"] and m["settings"]["turns"] == "all" and len(m["parts"]) == 2


def test_last_turn_only(chat_targets, tmp_path):
    target = chat_targets["dense"]
    prompts = _prepared(target, tmp_path, n=6, seed=2)
    out = tmp_path / "gen"
    r = run_cli(["generate", "--target", target, "--prompts", prompts, "--out", out, "--turns", "last", *GEN])
    assert r.returncode == 0, r.stderr[-3000:]
    got = _output(out)
    assert got == brute_force(target, prompts, last_only=True)
    prompts_by_id = {p["id"]: json.loads(p["messages"]) for p in _chat.read_parts(prompts)}
    turns: dict[int, list[int]] = {}
    for r in got:
        turns.setdefault(r["conversation_id"], []).extend(r["turns"])
    for conv_id, trained in turns.items():  # turn numbers counted as prepare counts them
        msgs = prompts_by_id[conv_id]
        slots = [k for k, m in enumerate(msgs) if m["role"] == "assistant" and not m.get("tool_calls")]
        want = [k for k in slots[:-1] if not msgs[k]["content"] and not msgs[k].get("reasoning_content")] + slots[-1:]
        assert sorted(trained) == [sum(m["role"] == "assistant" for m in msgs[:k]) for k in want]


@pytest.mark.parametrize("point,devices", [("generate-batch:2", "cpu"), ("part-written:1", "cpu,cpu"),
                                           ("part-committed:1", "cpu")])
def test_sigkill_then_rerun_equals_an_uninterrupted_run(chat_targets, tmp_path, point, devices):
    target = chat_targets["dense"]
    prompts = _prepared(target, tmp_path, n=10, seed=4)
    args = ["generate", "--target", target, "--prompts", prompts, *GEN]
    r = run_cli([*args, "--out", tmp_path / "straight", "--devices", "cpu"])
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "killed"
    r = run_cli([*args, "--out", out, "--devices", devices], env={"DFLASH_OFFLINE_KILL_AT": point})
    assert r.returncode == -9, (point, r.returncode, r.stderr[-2000:])
    r = run_cli([*args, "--out", out, "--devices", "cpu"])
    assert r.returncode == 0, r.stderr[-3000:]
    digest = {k: v for k, v in tree_digest(out).items() if k.startswith("part-")}
    assert digest == {k: v for k, v in tree_digest(tmp_path / "straight").items() if k.startswith("part-")}


def test_a_later_turn_the_template_refuses_cuts_the_conversation_short(chat_targets, tmp_path):
    """prepare renders only the first prompt; a template that raises on a later turn (here: on tool
    turns) stops that conversation there, counted, and the others are written."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(chat_targets["dense"], target)
    strict = (_chat.TEMPLATES / "chatml.jinja").read_text().replace(
        "{%- for message in messages -%}",
        "{%- for message in messages -%}{%- if message.role == 'tool' -%}{{ raise_exception('no tool role') }}"
        "{%- endif -%}", 1)
    (target / "strict.jinja").write_text(strict)
    convs = [{"id": 1, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                    {"role": "tool", "content": "42"}, {"role": "user", "content": "c"}]},
             {"id": 2, "messages": [{"role": "user", "content": "x"}]}]
    data = _chat.write_jsonl(tmp_path / "c.jsonl", convs)
    r = run_cli(["prepare", "--target", target, "--data", data, "--out", tmp_path / "p", "--chat-template",
                 target / "strict.jinja", "--no-progress"])
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli(["generate", "--target", target, "--prompts", tmp_path / "p" / "train", "--out", tmp_path / "g", *GEN])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "conversations cut short: 1 (template refused)" in r.stdout, r.stdout
    rows = _chat.read_parts(tmp_path / "g")
    assert sorted((x["conversation_id"], x["turns"]) for x in rows) == [(1, [0]), (2, [0])]
