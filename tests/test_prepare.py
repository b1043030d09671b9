"""`dflash-offline prepare`: inputs in the formats users have, what is kept and dropped (and
counted), ids and the stable split, prompts for `generate`, refusals of bad input (one line, exit
2, nothing written), and SIGKILL at three moments followed by a rerun equal to an uninterrupted run."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

import _chat
from conftest import run_cli, tree_digest


@pytest.fixture(scope="module")
def chat_target(tiny_dense, tmp_path_factory):
    return _chat.make_chat_target(tiny_dense, tmp_path_factory.mktemp("chat") / "target")


@pytest.fixture(scope="module")
def plain_target(tiny_dense, tmp_path_factory):
    """A chat tokenizer without a chat template."""
    return _chat.make_chat_target(tiny_dense, tmp_path_factory.mktemp("plain") / "target", template=None)


def _prepare(target, data, out, *extra):
    datas = data if isinstance(data, list) else [data]
    return run_cli(["prepare", "--target", target, *[a for d in datas for a in ("--data", d)], "--out", out,
                    "--no-progress", *extra])


def test_formats_counts_ids_and_datasets_folder(chat_target, tmp_path):
    # JSONL messages with own ids (and a duplicate, an empty and a reply-first conversation)
    convs = _chat.conversations(30)
    convs.append({"id": 100, "messages": convs[0]["messages"]})  # duplicate content
    convs.append({"id": 101, "messages": []})
    convs.append({"id": 102, "messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"},
                                          {"role": "assistant", "content": "y"}]})
    jsonl = _chat.write_jsonl(tmp_path / "a.jsonl", convs)
    # A ShareGPT JSON array cut off mid-record, with string ids (the public dump's shape)
    sg = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                              {"from": "gpt", "value": f"answer {i} ✓"}]} for i in range(5)]
    text = json.dumps(sg, ensure_ascii=False)
    (tmp_path / "sg.json").write_text(text[: text.index('{"id": "s4"') + 20], encoding="utf-8")
    # A `datasets` save_to_disk folder (Arrow stream file + state.json), Alpaca records
    ds = tmp_path / "alpaca_ds"
    ds.mkdir()
    table = pa.table({"instruction": ["Add.", "Sub."], "input": ["1 2", ""], "output": ["3", "0"]})
    with pa.OSFile(str(ds / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (ds / "dataset_info.json").write_text("{}")
    out = tmp_path / "out"
    r = _prepare(chat_target, [jsonl, tmp_path / "sg.json", ds], out, "--responses", "keep", "--max-len", "100000")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cut off" in r.stderr + r.stdout
    m = _chat.manifest(out / "train")
    assert m["counts"]["records_read"] == 33 + 4 + 2
    assert m["counts"]["dropped"] == {"duplicate": 1, "empty": 1, "starts with an assistant turn": 1}
    assert m["totals"]["conversations"] == 30 + 4 + 2 and m["kind"] == "completions"
    assert m["chat"]["template_sha256"] and m["chat"]["thinking"] is None
    rows = _chat.read_parts(out / "train")
    conv_ids = {r["conversation_id"] for r in rows}
    assert set(range(30)) <= conv_ids  # own integer ids kept
    assert {33, 34, 35, 36} <= conv_ids and {37, 38} <= conv_ids  # string ids and id-less rows: their index
    sources = {r["conversation_id"]: r["source_id"] for r in rows}
    assert sources[33] == "s0"
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) and any(r["loss_mask"]) for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)  # row ids unique (split rows take id + k * 2^40)
    # extract reads the folder as input (the contract: input_ids, loss_mask, id)
    from dflash_offline.rows.reader import scan

    src = scan([str(out / "train")], vocab_size=512)
    assert src.rows == len(rows)


def test_split_is_stable_and_regenerate_writes_prompts(chat_target, tmp_path):
    from transformers import AutoTokenizer

    convs = _chat.conversations(60, seed=3)
    small = _chat.write_jsonl(tmp_path / "small.jsonl", convs[:40])
    big = _chat.write_jsonl(tmp_path / "big.jsonl", convs)
    for name, data in (("small", small), ("big", big)):
        r = _prepare(chat_target, data, tmp_path / name, "--eval-fraction", "0.3", "--max-len", "100000")
        assert r.returncode == 0, r.stderr[-3000:]
    ev_small = {r["id"] for r in _chat.read_parts(tmp_path / "small" / "eval")}
    ev_big = {r["id"] for r in _chat.read_parts(tmp_path / "big" / "eval")}
    assert ev_small and ev_small == {i for i in ev_big if i < 40}  # more data moves no row between splits
    tok = AutoTokenizer.from_pretrained(chat_target)
    for row in _chat.read_parts(tmp_path / "big" / "train"):
        msgs = json.loads(row["messages"])
        first = next(k for k, m in enumerate(msgs) if m["role"] == "assistant")
        want = tok.apply_chat_template(msgs[:first], tokenize=True, add_generation_prompt=True, return_dict=True)
        assert row["input_ids"] == list(want["input_ids"])
    m = _chat.manifest(tmp_path / "big" / "train")
    assert m["kind"] == "prompts" and m["status"] == "complete"


def test_eval_of_training_rows_decodes_their_prompts(chat_target, tmp_path):
    """`eval --prompts` of a `prepare --responses keep` folder (rows of prompt + reply + end of
    turn) decodes each row's prompt, the server's prompt for its first trained reply as transformers
    renders it, and says so in a warning line: the same prompts and outputs (`--show`) as eval of
    those prompts written as a file.
    Rows trained from their first token (plain text) have no prompt: one line, exit 2."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from dflash_offline.drafter.config import DrafterConfig
    from dflash_offline.drafter.export import export_drafter
    from dflash_offline.drafter.model import DFlashDrafter

    convs = _chat.conversations(6, seed=5)
    data = _chat.write_jsonl(tmp_path / "chats.jsonl", convs)
    r = _prepare(chat_target, data, tmp_path / "keep", "--responses", "keep", "--max-len", "1000", "--no-dedup")
    assert r.returncode == 0, r.stderr[-3000:]
    keep = tmp_path / "keep" / "train"
    rows = _chat.read_parts(keep)
    tok = AutoTokenizer.from_pretrained(chat_target)
    want = []
    for row in rows:
        msgs = convs[row["conversation_id"]]["messages"]
        a = [k for k, m in enumerate(msgs) if m["role"] == "assistant"][row["turns"][0]]
        want.append(list(tok.apply_chat_template(msgs[:a], tokenize=True, add_generation_prompt=True,
                                                 return_dict=True)["input_ids"]))
        assert len(want[-1]) < len(row["input_ids"])
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": pa.array([row["id"] for row in rows], pa.int64()),
                             "input_ids": pa.array(want, pa.list_(pa.int32()))}), prompts)
    cfg = DrafterConfig.from_target(str(chat_target), [1, 3], block_size=4, drafter_layers=1, mask_token_id=1)
    drafter = export_drafter(DFlashDrafter(cfg), str(tmp_path / "drafter"))
    reports, shown = {}, {}
    for name, given in (("rows", keep), ("prompts", prompts)):
        r = run_cli(["eval", "--target", chat_target, "--drafter", drafter, "--prompts", given, "--max-new-tokens", "3",
                     "--ignore-eos", "--no-progress", "--show", len(rows), "--json", tmp_path / f"{name}.json"])
        assert r.returncode == 0, r.stderr[-3000:]
        said = (f"warning: --prompts {keep}: training rows (a prepare --responses keep output): each prompt is its "
                "row's tokens before the first trained one")
        assert (said.lower() in r.stderr.lower()) == (name == "rows"), r.stderr[-3000:]  # the level as the console writes it
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
        shown[name] = r.stdout.split("speculative decoding:")[0]  # each prompt and output as text
    assert shown["rows"].count("\nprompt: ") == len(rows) and shown["rows"] == shown["prompts"]
    assert reports["rows"]["prompt_ids"] == reports["prompts"]["prompt_ids"] == [row["id"] for row in rows]

    text = _chat.write_jsonl(tmp_path / "text.jsonl", [{"id": i, "text": f"plain text {i}"} for i in range(4)])
    r = _prepare(chat_target, text, tmp_path / "text", "--responses", "keep", "--max-len", "100000")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(["eval", "--target", chat_target, "--drafter", drafter, "--prompts", tmp_path / "text" / "train",
                 "--max-new-tokens", "3", "--no-progress"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    assert ("its loss_mask starts with 1), so it has no prompt to decode from; give prompts: `dflash-offline prepare "
            "--responses regenerate` writes them") in r.stderr


def test_turns_records_get_a_reply_slot_per_question(chat_target, tmp_path):
    mt = _chat.write_jsonl(tmp_path / "q.jsonl", [{"question_id": 81, "category": "writing",
                                                    "turns": ["Write a haiku.", "Now in French."]}])
    r = _prepare(chat_target, mt, tmp_path / "out")
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = _chat.read_parts(tmp_path / "out" / "train")
    roles = [m["role"] for m in json.loads(row["messages"])]
    assert row["id"] == 81 and roles == ["user", "assistant", "user", "assistant"]


def _bad(tmp_path):
    p = tmp_path
    cases = {}
    cases["unknown format"] = (_chat.write_jsonl(p / "u.jsonl", [{"foo": 1}]), [], "unknown record format")
    cases["mixed formats"] = (_chat.write_jsonl(p / "m.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                                             {"role": "assistant", "content": "b"}]},
                                                               {"prompt": "a", "response": "b"}]), [],
                              "one file holds one format")
    cases["missing role"] = (_chat.write_jsonl(p / "r.jsonl", [{"messages": [{"content": "a"}]}]), [], "no `role`")
    cases["missing value"] = (_chat.write_jsonl(p / "v.jsonl", [{"conversations": [{"from": "human"}]}]), [],
                              "no `value`")
    cases["ends with user"] = (_chat.write_jsonl(p / "e.jsonl", [{"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}]),
        ["--responses", "keep"], "ends with a user turn")
    bad_utf8 = p / "b.jsonl"
    bad_utf8.write_bytes(b'{"prompt": "caf\xe9", "response": "x"}\n')
    cases["invalid utf-8"] = (bad_utf8, [], "invalid UTF-8")
    long = _chat.write_jsonl(p / "l.jsonl", [{"prompt": "def " * 3000, "response": "x"}])
    cases["longer than the context"] = (long, ["--responses", "keep"], "longer than the target's context")
    cases["empty after filtering"] = (_chat.write_jsonl(p / "f.jsonl", [{"messages": []}]), [],
                                      "no row is left after filtering")
    cases["text regenerated"] = (_chat.write_jsonl(p / "t.jsonl", [{"text": "abc"}]), [], "--responses keep")
    pair = {"prompt": "a", "response": "b"}
    cases["id too large"] = (_chat.write_jsonl(p / "big.jsonl", [{"id": 2**41, **pair}]), [], "below 2^40")
    cases["id beyond int64"] = (_chat.write_jsonl(p / "huge.jsonl", [{"id": 2**70, **pair}]), [], "below 2^40")
    mixed_ids = p / "ids"
    mixed_ids.mkdir()
    _chat.write_jsonl(mixed_ids / "a.jsonl", [{"id": k, "prompt": str(k), "response": "b"} for k in range(1, 6)])
    _chat.write_jsonl(mixed_ids / "b.jsonl", [{"id": "s0", **pair}])
    cases["position id taken"] = (mixed_ids, [], "its id 's0' is not an integer, so it takes its position 5")
    float_first = p / "float-first"
    float_first.mkdir()
    _chat.write_jsonl(float_first / "a.jsonl", [{"id": 3.0, **pair}, {"id": 0, **pair}])
    cases["an integer id a position took"] = (float_first, [], "id 0 was already used by "
                                              f"{float_first / 'a.jsonl'}: line 1 (its id '3.0' is not an integer, so it "
                                              "took its position 0)")
    cases["messages as text"] = (_chat.write_jsonl(p / "s.jsonl", [{"messages": "[]"}]), [], "is a string")
    cases["unknown text part"] = (_chat.write_jsonl(p / "part.jsonl", [{"messages": [
        {"role": "user", "content": [{"type": "refusal", "text": "x"}]}]}]), [], "is not a text part")
    bad_jinja = p / "bad.jinja"
    bad_jinja.write_text("{% for m in messages %}{{ m.content }")
    cases["invalid template"] = (_chat.write_jsonl(p / "ok2.jsonl", [pair]), ["--chat-template", bad_jinja],
                                 "not valid Jinja")
    return cases


def test_bad_input_is_one_line_exit_2_nothing_written(chat_target, plain_target, tmp_path):
    for name, (data, extra, words) in _bad(tmp_path).items():
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        r = _prepare(chat_target, data, out, *extra)
        lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert r.returncode == 2 and len(lines) == 1 and words in lines[0], (name, r.stderr[-2000:])
        assert not (out / "train").exists() and not (out / "eval").exists(), name
    ok = _chat.write_jsonl(tmp_path / "ok.jsonl", _chat.conversations(3))
    r = _prepare(plain_target, ok, tmp_path / "out-plain")
    assert r.returncode == 2 and "--chat-template" in r.stderr, r.stderr[-2000:]
    # --thinking with a template that ignores it: a warning, not a refusal
    r = _prepare(chat_target, ok, tmp_path / "out-chatml", "--chat-template", _chat.TEMPLATES / "chatml.jinja",
                 "--thinking", "on", "--max-len", "100000")
    assert r.returncode == 0 and "does not read `enable_thinking`" in r.stderr, r.stderr[-2000:]
    # an existing folder that prepare did not make is never written into
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    r = _prepare(chat_target, ok, foreign)
    assert r.returncode == 2 and "nothing is overwritten" in r.stderr
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_byte_order_mark_and_content_parts_are_read(chat_target, tmp_path):
    from transformers import AutoTokenizer

    rec = {"id": 1, "messages": [{"role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                               {"type": "image_url", "image_url": {"url": "x"}},
                                                               {"type": "text", "text": "there"}]},
                                 {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]}]}
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + (json.dumps(rec) + "\r\n\r\n").encode())
    r = _prepare(chat_target, f, tmp_path / "out", "--responses", "keep")
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = _chat.read_parts(tmp_path / "out" / "train")
    tok = AutoTokenizer.from_pretrained(chat_target)
    want = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    assert (row["input_ids"], row["loss_mask"]) == _chat.oracle(tok, tok.chat_template, want)


def _digest(out) -> dict:
    """Every file but logs and the manifests' timestamps."""
    d = tree_digest(out, exclude=("logs",))
    for split in ("train", "eval"):
        m = out / split / "manifest.json"
        if m.exists():
            data = json.loads(m.read_text())
            for k in ("created", "completed"):
                data.pop(k, None)
            d[f"{split}/manifest.json"] = json.dumps(data, sort_keys=True)
    d.pop(".run.lock", None)
    return d


@pytest.mark.parametrize("point", ["prepare-render:3", "part-written:2", "prepare-part-committed:3"])
def test_sigkill_then_rerun_equals_an_uninterrupted_run(chat_target, tmp_path, point):
    data = _chat.write_jsonl(tmp_path / "c.jsonl", _chat.conversations(90, seed=5))
    args = ["--responses", "keep", "--eval-fraction", "0.2", "--chunk-records", "15", "--max-len", "100000"]
    r = _prepare(chat_target, data, tmp_path / "straight", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "killed"
    # A kill before the run is held leaves its early log in the temporary space (runtime/early_log.py):
    # this test's own, not the machine's.
    (tmp_path / "tmp").mkdir()
    r = run_cli(["prepare", "--target", chat_target, "--data", data, "--out", out, "--no-progress", *args],
                env={"DFLASH_OFFLINE_KILL_AT": point, "TMPDIR": tmp_path / "tmp"})
    assert r.returncode == -9, (point, r.returncode, r.stderr[-2000:])
    r = _prepare(chat_target, data, out, *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _digest(out) == _digest(tmp_path / "straight")


def test_text_the_tokenizer_cannot_read_is_refused(tiny_dense, tmp_path):
    """A word-level tokenizer that knows none of the data's words renders it as its unknown token:
    prepare refuses in one line (the wrong --target), and writes nothing."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = tmp_path / "target"
    shutil.copytree(tiny_dense, target)
    words = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = (_chat.TEMPLATES / "chatml.jinja").read_text()
    fast.save_pretrained(target)
    data = _chat.write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"some words here {k}", "response": "and more words"}
                                                    for k in range(6)])
    out = tmp_path / "out"
    r = _prepare(target, data, out, "--responses", "keep")
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert "the tokenizer's unknown token '[UNK]' (id 0)" in line and "cannot read this text" in line, line
    assert not (out / "train").exists() and not (out / "eval").exists()
