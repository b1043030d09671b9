"""Tokens as text where people look: `inspect --sample ID --text` and `Sample.text()` / `.spans()`
show a cache sample decoded with the target's tokenizer, its trained spans marked, exactly as
decoding each run with `tokenizers` directly gives it; `eval --show` marks each verify round's
accepted drafts, as many as eval's --json says each round accepted.

The tiny targets have no tokenizer: a byte-level BPE of exactly their 512 ids is trained here."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys

import pytest

from conftest import run_cli
import test_evaluate
from dflash_offline.text import ACCEPTED_MARKS, ANSI_ON, accepted_flags, decode_spans, render, render_ansi
from test_evaluate import WALK_B, WALK_NEW, fit_drafter, random_drafter, write_rows

# The tiny dense target's own greedy completions in a cache (its fixture, shared with test_evaluate).
own_cache = test_evaluate.own_cache

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = ("the quick brown fox jumps over lazy dog data parallel training speculative decoding drafter target "
          "token cache shard layer hidden state assistant user system tool python import numpy return def class "
          "for while print range zeros list dict value key answer question think step because therefore "
          "Grüße Köln ça va über straße naïve café 数据 并行 训练 模型 ✓ 🙂 π ≈ λ").split()
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def make_tokenizer(folder, vocab: int = 512):
    """folder/tokenizer.json: a byte-level BPE (special tokens first) with exactly `vocab` ids."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(400)], trainer)
    assert tok.get_vocab_size() == vocab
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(folder)
    return folder


def by_hand(tok, ids, mask):
    """[(text, trained)] decoded run by run with `tokenizers` directly (the brute-force reference)."""
    out, k = [], 0
    for flag, run in itertools.groupby(zip(ids, mask), key=lambda x: bool(x[1])):
        run = [int(t) for t, _ in run]
        out.append((tok.decode(run, skip_special_tokens=False), flag))
        k += len(run)
    assert k == len(ids)
    return out


def test_runs_decode_whole_characters_and_show_special_tokens(tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    prompt = tok.encode("<|im_start|>user Grüße 🚀 数据?<|im_end|>").ids
    answer = tok.encode("<|im_start|>assistant 🚀🚀 训练 ✓<|im_end|>").ids
    # A character split over several byte tokens: whole within its run, replacement marks token by token.
    assert "�" in "".join(tok.decode([t]) for t in prompt)
    ids, mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
    spans = decode_spans(tok, ids, mask)
    assert spans == [("<|im_start|>user Grüße 🚀 数据?<|im_end|>", False),
                     ("<|im_start|>assistant 🚀🚀 训练 ✓<|im_end|>", True)]
    assert render(spans) == "<|im_start|>user Grüße 🚀 数据?<|im_end|>[[<|im_start|>assistant 🚀🚀 训练 ✓<|im_end|>]]"
    assert render(spans, None) == tok.decode(ids, skip_special_tokens=False)
    # Runs alternate; each is decoded on its own.
    mask = [k % 3 == 0 for k in range(len(ids))]
    assert decode_spans(tok, ids, mask) == by_hand(tok, ids, mask)
    # On a terminal: colour, closed before each line break and reopened after it.
    shown = render_ansi([("a\nb", True), ("c", False)])
    assert shown == f"{ANSI_ON}a\x1b[0m\n{ANSI_ON}b\x1b[0mc" and ANSI.sub("", shown) == "a\nbc"
    # eval --show: the first token is the target's, then each round's accepted drafts and one target token.
    assert accepted_flags(9, [2, 0, 3]) == [False, True, True, False, False, True, True, True, False]
    assert accepted_flags(5, [2, 0, 3]) == [False, True, True, False, False]
    assert accepted_flags(7, [2, 0, 3]) == [False, True, True, False, False, True, True]  # cut in the last round


def test_sample_text_and_spans(valid_cache, tokenizer_dir):
    from tokenizers import Tokenizer

    from dflash_offline import open_cache
    from dflash_offline.runtime.errors import UserError

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    cache = open_cache(str(valid_cache), tokenizer=str(tokenizer_dir))
    for sid in (0, 5, 47):
        s = cache.sample(sid)
        want = by_hand(tok, s.input_ids.tolist(), s.loss_mask.tolist())
        assert s.spans() == want and len(want) >= 2
        assert s.text() == "".join(f"[[{t}]]" if m else t for t, m in want)
        assert s.text(marks=None) == "".join(t for t, _ in want)
        assert s.text(marks=("<", ">")) == "".join(f"<{t}>" if m else t for t, m in want)
    # A tokenizer given at the call, or as a Tokenizer object; the cache's own target has none.
    plain = open_cache(str(valid_cache))
    assert plain.sample(5).text(tokenizer=str(tokenizer_dir)) == cache.sample(5).text()
    assert plain.sample(5).spans(tokenizer=tok) == cache.sample(5).spans()
    target = json.loads((valid_cache / "manifest.json").read_text())["target"]["path"]
    with pytest.raises(UserError, match=re.escape(f"no tokenizer at {target}/tokenizer.json") + ".*--tokenizer DIR"):
        plain.sample(5).text()


def test_sample_text_imports_no_torch(valid_cache, tokenizer_dir):
    code = ("import sys, dflash_offline as d; c = d.open_cache(sys.argv[1], tokenizer=sys.argv[2]); "
            "print(len(c.sample(int(c.sample_ids[0])).text())); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code, str(valid_cache), str(tokenizer_dir)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _newlines(text: str) -> str:  # what a text-mode pipe makes of the decoded bytes (universal newlines)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def test_inspect_text_command(valid_cache, tokenizer_dir, tmp_path):
    from tokenizers import Tokenizer

    from dflash_offline import open_cache

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    s = open_cache(str(valid_cache)).sample(5)
    want = by_hand(tok, s.input_ids.tolist(), s.loss_mask.tolist())
    # Not a terminal: the trained spans between [[ and ]], and only the sample (no summary).
    r = run_cli(["inspect", valid_cache, "--sample", "5", "--text", "--tokenizer", tokenizer_dir])
    assert r.returncode == 0, r.stderr
    head, _, body = r.stdout.partition("\n")
    assert head.startswith("sample 5 of ") and f"{len(s)} tokens, {int(s.loss_mask.sum())} trained" in head
    assert "between [[ and ]]" in head and str(tokenizer_dir) in head
    assert body == _newlines("".join(f"[[{t}]]" if m else t for t, m in want) + "\n")
    assert "outlier channels" not in r.stdout
    # --color: the same text, trained spans in colour instead of brackets.
    r = run_cli(["inspect", valid_cache, "--sample", "5", "--text", "--tokenizer", tokenizer_dir / "tokenizer.json",
                 "--color"])
    assert r.returncode == 0, r.stderr
    body = r.stdout.partition("\n")[2]
    assert body.count(ANSI_ON) >= sum(m for _, m in want)
    assert ANSI.sub("", body) == _newlines("".join(t for t, _ in want) + "\n")
    # No tokenizer where the manifest points (the tiny target has none): one line naming it and --tokenizer.
    target = json.loads((valid_cache / "manifest.json").read_text())["target"]["path"]
    r = run_cli(["inspect", valid_cache, "--sample", "5", "--text"])
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert len(r.stderr.strip().splitlines()) == 1
    assert f"no tokenizer at {target}/tokenizer.json" in r.stderr and "--tokenizer DIR" in r.stderr
    r = run_cli(["inspect", valid_cache, "--text", "--tokenizer", tokenizer_dir])
    assert r.returncode == 2 and "give --sample ID" in r.stderr
    (tmp_path / "tokenizer.json").write_text("{not json")
    r = run_cli(["inspect", valid_cache, "--sample", "5", "--text", "--tokenizer", tmp_path])
    assert r.returncode == 2 and "not a readable tokenizer.json" in r.stderr, r.stderr


def test_eval_show_marks_each_rounds_accepted_drafts(own_cache, tiny_dense, tokenizer_dir, tmp_path):
    """eval --show 3: the first 3 prompts as text, their outputs with each round's accepted drafts
    between {{ and }}: exactly the runs --json's accepted_per_prompt gives, decoded by hand."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from dflash_offline.drafter.export import export_drafter

    cache, data, prompts = own_cache
    target = tmp_path / "target"
    shutil.copytree(tiny_dense, target)
    shutil.copy(tokenizer_dir / "tokenizer.json", target / "tokenizer.json")
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    export = export_drafter(fit_drafter(random_drafter(tiny_dense, block_size=WALK_B), cache), str(tmp_path / "export"))
    ids = list(prompts)
    rows = {x["id"]: x["input_ids"] for x in pq.read_table(data).to_pylist()}
    prompt_file = write_rows(tmp_path / "prompts.parquet", ids, [prompts[i] for i in ids])
    report = tmp_path / "eval.json"
    r = run_cli(["eval", "--target", target, "--drafter", export, "--prompts", prompt_file, "--max-new-tokens",
                 WALK_NEW, "--ignore-eos", "--show", "3", "--json", report, "--log-dir", tmp_path / "logs",
                 "--no-progress"])
    assert r.returncode == 0, r.stderr
    rep = json.loads(report.read_text())
    e = rep["drafters"][0]
    assert e["lossless"] is True and rep["prompt_ids"] == ids
    acc = e["accepted_per_prompt"]
    assert sum(len(a) for a in acc) == e["rounds"] and {0, WALK_B - 1} <= {a for x in acc for a in x}
    dec = lambda t: tok.decode(t, skip_special_tokens=False)  # noqa: E731
    marked = 0
    for k, pid in enumerate(ids):
        out = rows[pid][len(prompts[pid]):len(prompts[pid]) + WALK_NEW]  # the target's greedy decode (lossless)
        # By hand: the prompt's forward gives the first token; each round commits its accepted drafts
        # (marked) and one token of the target's (plain); the output may end inside the last round.
        text, plain, pos = "", out[:1], 1
        for a in acc[k]:
            drafts = out[pos:pos + a]
            if drafts:
                text += dec(plain) + "{{" + dec(drafts) + "}}"
                plain = []
                marked += k < 3
            plain += out[pos + a:pos + a + 1]
            pos += a + 1
        assert pos >= len(out)
        text += dec(plain)
        block = _newlines(f"prompt: {dec(prompts[pid])}\noutput: {text}\n")
        header = f"--- {export}, prompt {pid}: {len(out)} tokens in {len(acc[k])} rounds"
        assert (block in r.stdout and header in r.stdout) == (k < 3), (k, block, r.stdout)
    assert marked > 0 and r.stdout.count(f"--- {export}, prompt ") == 3
    assert "accepted drafts between {{ and }}" in r.stdout and ACCEPTED_MARKS == ("{{", "}}")

    # Refusals, before anything decodes: no tokenizer in --target; --show without --prompts.
    r = run_cli(["eval", "--target", tiny_dense, "--drafter", export, "--prompts", prompt_file, "--show", "1",
                 "--log-dir", tmp_path / "logs"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"no tokenizer at {tiny_dense}/tokenizer.json" in r.stderr and "--show 1" in r.stderr
    r = run_cli(["eval", "--target", target, "--drafter", export, "--cache", cache, "--show", "1"])
    assert r.returncode == 2 and "--show 1" in r.stderr and "--prompts" in r.stderr, r.stderr
