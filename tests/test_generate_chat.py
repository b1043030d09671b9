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


def brute_force(target, prompts_folder, last_only: bool = False, eos: set[int] | None = None) -> list[dict]:
    """Rows as the docs define them, computed the slow, obvious way (replies stop at `eos`, by
    default generation_config.json's end-of-sequence ids)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    if eos is None:
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
    assert "continuous batching:" in (out / "logs" / "generate-rank0.log").read_text()
    got, want = _output(out), brute_force(target, prompts)
    conversations = {p["id"] for p in _chat.read_parts(prompts)}
    assert len(conversations) >= 6 and {r["conversation_id"] for r in want} == conversations
    assert sum(len(r["turns"]) for r in want) > 10  # several turns per conversation, in rows
    assert got == want
    m = json.loads((out / "manifest.json").read_text())
    assert m["chat"]["template_sha256"] and m["settings"]["turns"] == "all" and len(m["parts"]) == 2


def test_turns_that_outgrow_the_continuous_slots_go_on_padded(chat_targets, tmp_path):
    """Continuous batching queues a conversation's next turn as its reply ends; a turn whose prompt
    outgrows the slots (made small here) goes on in padded rounds from that turn: the rows equal
    padded rounds throughout, with some conversations taking each path."""
    from dflash_offline.chat.template import ChatTemplate
    from dflash_offline.evaluate.speculative import load_target_for_decoding
    from dflash_offline.generate.continuous import ContinuousDecoder
    from dflash_offline.generate.decoding import BatchDecoder
    from dflash_offline.generate.turns import parse_conversation, regenerate, regenerate_continuously
    from dflash_offline.rows.parts import chat_settings_of
    from dflash_offline.sampling import Sampling

    target = chat_targets["dense"]
    prompts = _prepared(target, tmp_path)
    tmpl = ChatTemplate.recorded(str(target), chat_settings_of([str(prompts)]), [0])
    model, _ = load_target_for_decoding(str(target), "cpu", "float32")
    rows = _chat.read_parts(prompts)
    padded = BatchDecoder(model, 4, 600, NEW, {0}, Sampling())

    def conversations():
        return [parse_conversation(r["id"], r["messages"], False) for r in rows]

    want = conversations()
    regenerate(want, tmpl, padded, 1 << 20, None, False)
    first = sorted(len(c.rows[0].input_ids) - len(c.rows[0].loss_mask) + c.rows[0].loss_mask.index(1)
                   for c in want if c.rows)
    got = conversations()
    slots = ContinuousDecoder(model, 3, first[len(first) // 2] + 2 * NEW, NEW, {0}, Sampling(), stage_rows=2)
    outgrown = regenerate_continuously(got, tmpl, slots, None, False)
    assert outgrown and len(outgrown) < len(got), len(outgrown)
    regenerate([c for c, _ in outgrown], tmpl, padded, 1 << 20, None, False, start={c.id: r for c, r in outgrown})
    assert [[(r.input_ids, r.loss_mask, r.turns) for r in c.rows] for c in got] == \
        [[(r.input_ids, r.loss_mask, r.turns) for r in c.rows] for c in want]


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


def _end_of_turn_warnings(stderr: str) -> list[str]:
    """The warning lines about the end of turn, without their level prefix (checked)."""
    lines = [line for line in stderr.splitlines() if "end of turn" in line]
    assert all(line.lower().startswith("warning: ") for line in lines), lines
    return [line.split(": ", 1)[1] for line in lines]


def _writes_only(target, token: int) -> None:
    """Make the target write `token` after any context: the layers add nothing to the residual
    stream (their output projections zeroed), every embedding has a positive first coordinate,
    and the LM head reads that coordinate into `token`'s logit alone."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[token, 0] = 1.0
    model.save_pretrained(target)


def test_replies_stop_at_the_templates_end_of_turn(tiny_dense, tmp_path):
    """generation_config.json names <|endoftext|> alone while the template ends a turn with
    <|im_end|>, one token (a target that writes it at once): replies stop there as a server's do,
    <|im_end|> kept with mask 1 (finish `eos`), equal to a greedy decode stopping at either; with
    --eos-token-ids naming <|endoftext|> alone, a warning says replies run on, and they do."""
    from transformers import AutoTokenizer

    target = _chat.make_chat_target(tiny_dense, tmp_path / "target")
    tok = AutoTokenizer.from_pretrained(target)
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    _writes_only(target, im_end)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [endoftext]}))
    prompts = _prepared(target, tmp_path, n=5, seed=6)
    r = run_cli(["generate", "--target", target, "--prompts", prompts, "--out", tmp_path / "gen", *GEN])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "end of turn" not in r.stderr, r.stderr[-3000:]  # nothing to warn about
    got = _output(tmp_path / "gen")
    assert got == brute_force(target, prompts, eos={endoftext, im_end})
    turns = sum(len(row["turns"]) for row in got)
    assert turns >= 5 and all(row["finish_reason"] == "eos" for row in got)
    for row in got:  # each reply is the end-of-turn token alone, trained
        assert [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m] == [im_end] * len(row["turns"])
    assert f"({turns} ended by end-of-sequence)" in r.stdout, r.stdout
    m = json.loads((tmp_path / "gen" / "manifest.json").read_text())
    assert m["settings"]["eos_token_ids"] == sorted([endoftext, im_end])

    # eval of the same prepared prompts stops its decodes there too (both sides), so the generated
    # replies serve as its lossless reference.
    from dflash_offline.drafter.config import DrafterConfig
    from dflash_offline.drafter.export import export_drafter
    from dflash_offline.drafter.model import DFlashDrafter

    cfg = DrafterConfig.from_target(str(target), [1, 3], block_size=4, drafter_layers=1, mask_token_id=1)
    drafter = export_drafter(DFlashDrafter(cfg), str(tmp_path / "drafter"))
    r = run_cli(["eval", "--target", target, "--drafter", drafter, "--prompts", prompts, "--max-new-tokens", NEW,
                 "--no-progress", "--json", tmp_path / "eval.json"])
    assert r.returncode == 0 and "end of turn" not in r.stderr, r.stderr[-3000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["eos"] == sorted([endoftext, im_end]) and report["drafters"][0]["lossless"]
    assert report["drafters"][0]["rounds"] <= len(report["prompt_ids"])  # the end of turn at once: no decode runs on

    r = run_cli(["generate", "--target", target, "--prompts", prompts, "--out", tmp_path / "named", *GEN,
                 "--eos-token-ids", endoftext])
    assert r.returncode == 0, r.stderr[-3000:]
    warned = _end_of_turn_warnings(r.stderr)
    assert warned == [f"--eos-token-ids [{endoftext}] leaves out the chat template's end of turn '<|im_end|>' "
                      f"(token id {im_end}): replies do not stop at the end of turn but run on to --max-new-tokens "
                      f"{NEW}; add {im_end} (or leave the option out to stop there)"], r.stderr[-3000:]
    assert all(row["finish_reason"] == "length" for row in _output(tmp_path / "named"))


def test_an_end_of_turn_of_several_tokens_is_warned_of(tiny_dense, tmp_path):
    """A template whose <|im_end|> the target's tokenizer splits into ordinary tokens (the pycode
    fixture with a ChatML-style template): no id stops a reply there, so prepare (regenerate) and
    generate each say so in one warning line, before any work, naming the fix."""
    target = _chat.make_chat_target(tiny_dense, tmp_path / "target", template=None, markers="split")
    data = _chat.write_jsonl(tmp_path / "chats.jsonl", _conversations(4, 8))
    r = run_cli(["prepare", "--target", target, "--data", data, "--out", tmp_path / "p", "--max-len", "600",
                 "--chat-template", _chat.TEMPLATES / "qwen3_style.jinja", "--no-progress"])
    assert r.returncode == 0, r.stderr[-3000:]
    said = ("the chat template ends a turn with '<|im_end|>', which the target's tokenizer splits into {n} tokens, "
            "not one end-of-sequence id ([0]): replies do not stop at the end of turn but run on to {limit}; prepare "
            "again with a --chat-template that ends a turn with the target's end-of-sequence token ('<|endoftext|>')")
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(target)("<|im_end|>", add_special_tokens=False)["input_ids"])
    assert n > 1
    assert _end_of_turn_warnings(r.stderr) == [said.format(n=n, limit="generate's --max-new-tokens")], r.stderr[-3000:]
    r = run_cli(["generate", "--target", target, "--prompts", tmp_path / "p" / "train", "--out", tmp_path / "g", *GEN])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _end_of_turn_warnings(r.stderr) == [said.format(n=n, limit=f"--max-new-tokens {NEW}")], r.stderr[-3000:]
