"""Target folders as users have them, incomplete or mismatched: a folder without tokenizer files,
a tokenizer with ids past the model's vocabulary, no end-of-sequence id anywhere or only in the
tokenizer's files, limits past the target's context. Each is read for what it holds or refused in
one line before any work."""

from __future__ import annotations

import json
import shutil

import _chat
import pytest

from conftest import extract_args, run_cli


@pytest.fixture(scope="module")
def chat_target(tiny_dense, tmp_path_factory):
    return _chat.make_chat_target(tiny_dense, tmp_path_factory.mktemp("tf") / "chat")


@pytest.fixture
def chats(tmp_path):
    return _chat.write_jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}]}])


def _copy(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit:
        edit(dst)
    return dst


def _one_line(r, code=2):
    assert r.returncode == code and r.stderr.count("\n") == 1, (r.returncode, r.stderr[-3000:])
    return r.stderr.strip()


def test_a_folder_without_tokenizer_files_is_refused(chat_target, chats, tmp_path):
    """transformers 5 builds a one-token tokenizer for the model type when the folder has no
    tokenizer files: every conversation would be tokenized to nothing."""
    bare = _copy(chat_target, tmp_path / "bare", lambda p: [
        (p / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
        if (p / f).exists()])
    msg = _one_line(run_cli(["prepare", "--target", bare, "--data", chats, "--out", tmp_path / "o",
                             "--chat-template", _chat.TEMPLATES / "chatml.jinja", "--no-progress"]))
    assert msg == (f"error: --target {bare}: no tokenizer files in the folder (none of tokenizer.json, "
                   "tokenizer.model, vocab.json, vocab.txt, spiece.model); copy the model's tokenizer files into it")
    assert not (tmp_path / "o" / "train").exists()


def test_a_tokenizer_with_ids_past_the_vocabulary_is_refused(chat_target, chats, tmp_path):
    """An added token's id beyond config.json's vocab_size (with gaps below it, so the tokenizer's
    length alone looks fine) would write ids the embedding does not have."""
    def past(p):
        t = json.loads((p / "tokenizer.json").read_text())
        for a in t["added_tokens"]:
            if a["content"] == "<|im_end|>":
                a["id"] = 600
        t["model"]["vocab"]["<|im_end|>"] = 600
        (p / "tokenizer.json").write_text(json.dumps(t))
        c = json.loads((p / "tokenizer_config.json").read_text())
        c.pop("added_tokens_decoder", None)
        (p / "tokenizer_config.json").write_text(json.dumps(c))
    gap = _copy(chat_target, tmp_path / "gap", past)
    msg = _one_line(run_cli(["prepare", "--target", gap, "--data", chats, "--out", tmp_path / "o", "--no-progress"]))
    assert msg.startswith(f"error: --target {gap}: its tokenizer has token ids up to 600 ('<|im_end|>') but the "
                          "model's vocabulary is 512"), msg


def test_end_of_sequence_from_the_tokenizer_when_no_config_names_one(chat_target, tmp_path):
    from dflash_offline.targets.folder import eos_source

    def no_config_eos(p):
        (p / "generation_config.json").write_text("{}")
        c = json.loads((p / "config.json").read_text())
        c.pop("eos_token_id", None)
        (p / "config.json").write_text(json.dumps(c))
    t = _copy(chat_target, tmp_path / "tok-eos", no_config_eos)
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(t).convert_tokens_to_ids("<|im_end|>")
    assert eos_source(str(t)) == ({want}, t / "tokenizer_config.json")


def test_generate_warns_when_a_target_names_no_end_of_sequence_id(chat_target, tmp_path):
    """No end-of-sequence id anywhere: every completion runs to --max-new-tokens, said in one
    warning line (tiny random targets have none; --ignore-eos says it is meant)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def none(p):
        (p / "generation_config.json").write_text("{}")
        c = json.loads((p / "config.json").read_text())
        c.pop("eos_token_id", None)
        (p / "config.json").write_text(json.dumps(c))
        c = json.loads((p / "tokenizer_config.json").read_text())
        c.pop("eos_token", None)
        (p / "tokenizer_config.json").write_text(json.dumps(c))
    t = _copy(chat_target, tmp_path / "no-eos", none)
    prompts = tmp_path / "p.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7]]}), prompts)
    args = ["generate", "--target", t, "--prompts", prompts, "--max-new-tokens", "4", "--no-progress"]
    r = run_cli([*args, "--out", tmp_path / "g"])
    assert r.returncode == 0, r.stderr[-2000:]
    said = [ln for ln in r.stderr.splitlines() if "end-of-sequence" in ln]
    assert said == [f"warning: --target {t} names no end-of-sequence id (not generation_config.json, config.json nor "
                    "the tokenizer files): every completion runs to --max-new-tokens 4; give --eos-token-ids (or "
                    "--ignore-eos to say so)"], r.stderr
    r = run_cli([*args, "--out", tmp_path / "g2", "--ignore-eos"])
    assert r.returncode == 0 and "end-of-sequence" not in r.stderr, r.stderr


def test_prepare_warns_of_a_max_len_past_the_targets_context(chat_target, chats, tmp_path):
    r = run_cli(["prepare", "--target", chat_target, "--data", chats, "--out", tmp_path / "o", "--max-len", "100000",
                 "--no-progress"])
    assert r.returncode == 0, r.stderr
    assert "warning: --max-len 100000 exceeds the target's context (1024 positions" in r.stderr, r.stderr


def test_extract_refuses_samples_too_short_to_draft(tiny_dense, tiny_data, tmp_path):
    msg = _one_line(run_cli(extract_args(tiny_dense, tiny_data, tmp_path / "c", "--max-len", "1")))
    assert msg.startswith("error: --max-len must be >= 2 (a sample must hold a token and one to draft after it)"), msg
