"""`dflash-offline prepare` at the front door: the first N records of a large or cut-off file
(--max-records, reading stopped there), a target folder of tokenizer files and config.json without
weights, one `error:` prefix, no transformers warning for rows --max-len drops, a bar that counts
the records read, and drops told apart as conversations and rows."""

from __future__ import annotations

import json
import shutil

import pytest

import _chat
from conftest import run_cli


@pytest.fixture(scope="module")
def chat_target(tiny_dense, tmp_path_factory):
    return _chat.make_chat_target(tiny_dense, tmp_path_factory.mktemp("chat") / "target")


def _prepare(target, data, out, *extra, progress=False):
    return run_cli(["prepare", "--target", target, "--data", data, "--out", out,
                    *([] if progress else ["--no-progress"]), *extra])


def test_max_records_reads_the_first_n_and_stops_there(chat_target, tmp_path):
    convs = _chat.conversations(12)
    f = _chat.write_jsonl(tmp_path / "a.jsonl", convs)
    with open(f, "a", encoding="utf-8") as fh:  # past the first 12: never read, so never refused
        fh.write("{not json\n")
    r = _prepare(chat_target, f, tmp_path / "all", "--max-len", "100000")
    assert r.returncode == 2 and "line 13: not valid JSON" in r.stderr, r.stderr[-2000:]
    out = tmp_path / "first"
    r = _prepare(chat_target, f, out, "--max-len", "100000", "--max-records", "12")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "12 records read (the first 12: --max-records)" in r.stdout, r.stdout
    m = _chat.manifest(out / "train")
    assert m["counts"]["records_read"] == 12 and m["settings"]["max_records"] == 12
    assert sorted(row["id"] for row in _chat.read_parts(out / "train")) == list(range(12))
    # The same rows as the file holding only those records (same ids, same tokens)
    alone = _chat.write_jsonl(tmp_path / "alone.jsonl", convs)
    r = _prepare(chat_target, alone, tmp_path / "alone-out", "--max-len", "100000")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _chat.read_parts(out / "train") == _chat.read_parts(tmp_path / "alone-out" / "train")
    # Recorded, so a rerun with another limit is refused naming it; the same one resumes (nothing to do)
    r = _prepare(chat_target, f, out, "--max-len", "100000", "--max-records", "5")
    assert r.returncode == 2 and "settings.max_records" in r.stderr, r.stderr[-2000:]
    r = _prepare(chat_target, f, out, "--max-len", "100000", "--max-records", "12")
    assert r.returncode == 0 and "already complete" in r.stdout, r.stderr[-2000:]
    # A ShareGPT JSON array cut off mid-record (the public dump): the first N complete records, no warning
    sg = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                              {"from": "gpt", "value": f"answer {i}"}]} for i in range(6)]
    text = json.dumps(sg)
    cut = tmp_path / "sg.json"
    cut.write_text(text[: text.index('{"id": "s5"') + 20])
    r = _prepare(chat_target, cut, tmp_path / "sg", "--max-records", "3")
    assert r.returncode == 0 and "cut off" not in r.stderr + r.stdout, r.stderr[-2000:]
    assert sorted(row["source_id"] for row in _chat.read_parts(tmp_path / "sg" / "train")) == ["s0", "s1", "s2"]
    r = _prepare(chat_target, f, tmp_path / "zero", "--max-records", "0")
    assert r.returncode == 2 and r.stderr.strip() == "error: --max-records must be positive, got 0", r.stderr


def test_a_folder_without_weights_is_enough(chat_target, tmp_path):
    tokenizer_only = tmp_path / "tokenizer-only"
    shutil.copytree(chat_target, tokenizer_only, ignore=shutil.ignore_patterns("*.safetensors*"))
    assert not list(tokenizer_only.glob("*.safetensors")) and (tokenizer_only / "config.json").is_file()
    data = _chat.write_jsonl(tmp_path / "c.jsonl", _chat.conversations(8, seed=1))
    for name, target in (("with", chat_target), ("without", tokenizer_only)):
        r = _prepare(target, data, tmp_path / name, "--responses", "keep", "--max-len", "100000")
        assert r.returncode == 0, (name, r.stderr[-2000:])
    assert _chat.read_parts(tmp_path / "with" / "train") == _chat.read_parts(tmp_path / "without" / "train")
    m = _chat.manifest(tmp_path / "without" / "train")
    assert m["target"]["vocab_size"] == _chat.manifest(tmp_path / "with" / "train")["target"]["vocab_size"]
    # No tokenizer either: still one line naming what is missing
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(chat_target / "config.json", bare)
    r = _prepare(bare, data, tmp_path / "bare")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "no tokenizer files" in r.stderr, r.stderr


def test_dropped_rows_print_no_transformers_warning_and_drops_are_told_apart(chat_target, tmp_path):
    # The tokenizer declares a maximum length, as real ones do (Qwen's 131072): rows past it are
    # --max-len's to drop, without transformers' "Token indices sequence length" warning.
    target = tmp_path / "target"
    shutil.copytree(chat_target, target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 64}))
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    long = {"messages": [{"role": "user", "content": "def add " * 80}, {"role": "assistant", "content": "ok"}]}
    longer = {"messages": [{"role": "user", "content": "x = 1 " * 80}, {"role": "assistant", "content": "ok"}]}
    convs = [{"id": i, **short} for i in range(3)] + [{"id": 3, **long}, {"id": 4, **longer}]
    convs[1]["messages"] = [{"role": "user", "content": "other"}, {"role": "assistant", "content": "ok"}]
    convs[2]["messages"] = []  # empty: dropped whole
    data = _chat.write_jsonl(tmp_path / "d.jsonl", convs + [{"id": 5, **short}])  # a duplicate of 0
    r = _prepare(target, data, tmp_path / "out", "--responses", "keep", "--max-len", "60", progress=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Token indices sequence length" not in r.stderr, r.stderr
    # The bar counts records read (6), not rows or kept conversations
    assert "6/6" in r.stderr and "record" in r.stderr, r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("  dropped:")]
    assert line == ("  dropped: 2 conversations (1 empty, 1 duplicate); 2 rows (2 longer than --max-len)"), r.stdout
    assert not any(x.lower().startswith("error") for x in r.stderr.splitlines())
    # status reads the same counts from the output's manifests and tells them apart the same way.
    st = run_cli(["status", tmp_path / "out"])
    assert st.returncode == 0 and "dropped: 2 conversations (1 empty, 1 duplicate); 2 rows (2 longer than --max-len)" \
        in st.stdout, st.stdout
