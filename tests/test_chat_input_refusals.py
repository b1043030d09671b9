"""Chat inputs that are not what they claim to be, as users have them: each is refused in one line
naming the file and the line, record or field, and how to fix it (never a traceback, never read
with a changed meaning); content parts that are not text are left out with one counting warning.
Through the readers (the exact line) and through `prepare` (exit 2, one `error:` line)."""

from __future__ import annotations

import json
import logging
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import _chat
from conftest import run_cli
from dflash_offline.chat.records import read_records
from dflash_offline.runtime.errors import UserError

CONV = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
REDO = "the `datasets` folder is damaged: save it again (save_to_disk) or copy it whole"


@pytest.fixture(scope="module")
def chat_target(tiny_dense, tmp_path_factory):
    return _chat.make_chat_target(tiny_dense, tmp_path_factory.mktemp("chat") / "target")


def _refusal(*paths, fmt: str = "auto") -> str:
    with pytest.raises(UserError) as e:
        list(read_records([str(p) for p in paths], fmt))
    assert "\n" not in str(e.value)
    return str(e.value)


def _dataset(folder, rows: list[dict]):
    """A `datasets` save_to_disk folder as the library writes it: an Arrow stream file, state.json
    listing it, dataset_info.json."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                   "_fingerprint": "0", "_split": folder.name}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


def _dataset_dict(folder, splits: list[str]):
    for s in splits:
        _dataset(folder / s, [{"messages": CONV, "id": len(s)}])
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": splits}))
    return folder


def test_dataset_dict_without_train_split_is_refused(tmp_path):
    dd = _dataset_dict(tmp_path / "dd", ["validation", "test"])
    assert _refusal(dd) == (f"{dd}: a `datasets` DatasetDict folder without a `train` split (its splits: validation, "
                            f"test); give the split to read as its own folder, e.g. {dd / 'validation'}")
    # the split's own folder is read, as the refusal says; a train split alone is read from its folder
    assert [r.own_id for r in read_records([str(dd / "validation")])] == [10]
    both = _dataset_dict(tmp_path / "both", ["train", "test"])
    assert [r.own_id for r in read_records([str(both)])] == [5]


@pytest.mark.parametrize("case", ["state-cut", "state-list", "no-filename", "files-not-list", "file-missing",
                                  "dict-cut", "dict-list", "splits-text", "split-missing"])
def test_damaged_datasets_folder_is_one_line(tmp_path, case):
    ds = _dataset(tmp_path / "ds", [{"messages": CONV}])
    dd = _dataset_dict(tmp_path / "dd", ["train"])
    state, ddj = ds / "state.json", dd / "dataset_dict.json"
    file, text, want = {
        "state-cut": (state, "{bad", "not valid JSON (Expecting property name enclosed in double quotes at line 1, "
                                     "column 2)"),
        "state-list": (state, "[1]", "a JSON list, not an object"),
        "no-filename": (state, '{"_data_files": [{"name": "x"}]}', "`_data_files` entry 0 has no `filename` "
                                                                   '({"name": "x"})'),
        "files-not-list": (state, '{"_data_files": "x.arrow"}', "`_data_files` is \"x.arrow\", not a list of files"),
        "file-missing": (state, '{"_data_files": [{"filename": "data-00001.arrow"}]}',
                         f"`_data_files` entry 0 names data-00001.arrow, which is not in {ds}"),
        "dict-cut": (ddj, '{"splits": ["tr', "not valid JSON (Unterminated string starting at at line 1, column 13)"),
        "dict-list": (ddj, '["train"]', "a JSON list, not an object"),
        "splits-text": (ddj, '{"splits": "train"}', '`splits` is "train", not a list of split names'),
        "split-missing": (ddj, '{"splits": ["train"]}', None),
    }[case]
    file.write_text(text)
    if case == "split-missing":
        shutil.rmtree(dd / "train")
        assert _refusal(dd) == f"{ddj} lists the split `train` but {dd / 'train'} is not there; {REDO}"
    else:
        assert _refusal(file.parent) == f"{file}: {want}; {REDO}"


def test_lone_surrogate_is_refused_where_it_is_read(tmp_path):
    good = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}, {"role": "assistant", "content": "ok"}]}'
    bad = '{"messages": [{"role": "user", "content": "x\\ud800"}, {"role": "assistant", "content": "ok"}]}'
    f = tmp_path / "s.jsonl"
    f.write_text(good + "\n" + bad + "\n")
    assert _refusal(f) == (f"{f}: line 2: `messages[0].content` holds \\ud800, half of a UTF-16 surrogate pair "
                           "without its other half: not valid Unicode text; fix the escape or remove that record")
    f.write_text(good + "\n")  # a whole pair, and an escaped backslash before "ud800": both text
    assert [r.messages[0].content for r in read_records([str(f)])] == ["\U0001f600 \\ud800"]
    key = tmp_path / "k.jsonl"
    key.write_text('{"messages": [], "meta": {"\\uDC00": 1}}\n')
    assert _refusal(key) == (f"{key}: line 1: a key of `meta` holds \\udc00, half of a UTF-16 surrogate pair "
                             "without its other half: not valid Unicode text; fix the escape or remove that record")
    arr = tmp_path / "a.json"
    arr.write_text("[" + good + ", " + bad.replace("x\\ud800", "\\udfff") + "]")
    assert _refusal(arr) == (f"{arr}: record 1: `messages[0].content` holds \\udfff, half of a UTF-16 surrogate "
                             "pair without its other half: not valid Unicode text; fix the escape or remove that "
                             "record")
    wrapped = tmp_path / "w.json"
    wrapped.write_text('{"data": [' + good + ", " + bad + "]}")
    assert _refusal(wrapped).startswith(f"{wrapped}: record 1: `messages[0].content` holds \\ud800")


def test_deeply_nested_json_is_one_line(tmp_path):
    deep = "damaged: fix or remove it"
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"messages": CONV}) + "\n" + "[" * 100000 + "\n")
    assert _refusal(f) == (f"{f}: line 2: not readable JSON (arrays or objects nested deeper than Python's parser "
                           f"goes); a record is a few levels deep, so the text is {deep}")
    arr = tmp_path / "d.json"
    arr.write_text("[" + json.dumps({"messages": CONV}) + ", " + "[" * 100000 + "]")
    assert _refusal(arr).startswith(f"{arr}: record 1: not readable JSON (arrays or objects nested deeper")
    obj = tmp_path / "o.json"
    obj.write_text('{"data": ' + "[" * 100000)
    assert _refusal(obj).startswith(f"{obj}: file: not readable JSON (arrays or objects nested deeper")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_non_text_content_parts_are_counted_in_one_warning(tmp_path):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    recs = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]},
                          {"role": "assistant", "content": "ok"}]},
            {"messages": CONV},
            {"messages": [{"role": "user", "content": [image, audio, {"type": "text", "text": "what?"}]},
                          {"role": "assistant", "content": [image]}]}]
    f = _chat.write_jsonl(tmp_path / "mm.jsonl", recs)
    log = logging.getLogger("dflash.prepare")
    lines = _Lines()
    log.addHandler(lines)
    try:
        got = [r.messages[0].content for r in read_records([str(f)])]
        assert lines.lines == [f"2 record(s) hold content parts that are not text (3 image_url, 1 input_audio): those "
                               "parts are left out, the text of the record is kept (the drafter trains on text "
                               f"alone); the first: {f}: line 1: message 0 (image_url)"]
        assert got == ["hi", "hi", "what?"]
        # Arrow rows hold every part's fields (null where a part has none): an image part is not "text"
        lines.lines.clear()
        parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]},
                 {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
        pq.write_table(pa.Table.from_pylist([{"messages": parts}]), tmp_path / "mm.parquet")
        assert [r.messages[0].content for r in read_records([str(tmp_path / "mm.parquet")])] == ["hi"]
        assert len(lines.lines) == 1 and lines.lines[0].startswith("1 record(s) hold content parts that are not text")
        lines.lines.clear()
        list(read_records([str(_chat.write_jsonl(tmp_path / "plain.jsonl", [{"messages": CONV}]))]))
        assert lines.lines == []
    finally:
        log.removeHandler(lines)
    odd = _chat.write_jsonl(tmp_path / "odd.jsonl", [{"messages": [{"role": "user", "content": ["hi"]}]}])
    assert _refusal(odd) == (f"{odd}: line 1: message 0: content part 0 is a string, not an object such as "
                             '{"type": "text", "text": ...}; fix or remove that record')


@pytest.mark.parametrize("rec, fmt, why", [
    ({"prompt": None, "response": "x"}, "auto",
     "`prompt` is null, not text; a `pair` record needs `prompt` and `response` as text; fix or remove that record"),
    ({"prompt": "q", "completion": None}, "pair",
     "`completion` is null, not text; a `pair` record needs `prompt` and `completion` as text; fix or remove that "
     "record"),
    ({"instruction": "q", "input": "", "output": None}, "auto",
     "`output` is null, not text; a `pair` record needs `instruction` and `output` as text; fix or remove that record"),
    ({"text": None}, "auto", "`text` is null, not text; fix or remove that record"),
    ({"turns": "q"}, "auto", "`turns` is a string, not a list of the user's messages; fix or remove that record"),
    ({"messages": None, "id": 3}, "auto", "`messages` is null, not a list of messages; fix or remove that record"),
    ({"messages": {"role": "user", "content": "x"}}, "messages",
     "`messages` is an object, not a list of messages; fix or remove that record"),
    ({"conversations": 7}, "auto", "`conversations` is a number, not a list of turns; fix or remove that record"),
    ({"conversations": '[{"from": "human"}]'}, "auto", "`conversations` is a string (JSON text?), not a list of "
     "turns; store it as a list (decode it before writing the file)"),
    (5, "auto", 'not a JSON object but a number; a record is an object such as {"messages": [...]}'),
    ([1, 2], "pair", 'not a JSON object but a list; a record is an object such as {"messages": [...]} (one JSON '
     "array of records is a .json file)"),
    ({"foo": 1}, "auto", "unknown record format (keys: foo); expected `messages`, `conversations` (ShareGPT), "
     "`prompt` + `response`, `instruction` + `output`, or `text`; or pass --format"),
])
def test_a_null_or_wrong_typed_field_is_named(tmp_path, rec, fmt, why):
    f = _chat.write_jsonl(tmp_path / "r.jsonl", [rec])
    assert _refusal(f, fmt=fmt) == f"{f}: line 1: {why}"


def test_a_null_column_value_in_parquet_is_named(tmp_path):
    f = tmp_path / "m.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": 0, "messages": CONV}, {"id": 1, "messages": None}]), f)
    assert _refusal(f) == f"{f}: row 1: `messages` is null, not a list of messages; fix or remove that record"
    mixed = tmp_path / "mixed.parquet"  # prompt/response rows and Alpaca rows: the other set of columns is null
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "response": "b", "instruction": None, "output": None},
                                         {"prompt": None, "response": None, "instruction": "c", "output": "d"},
                                         {"prompt": None, "response": None, "instruction": None, "output": None}]),
                   mixed)
    assert _refusal(mixed) == (f"{mixed}: row 2: `prompt` is null, not text; a `pair` record needs `prompt` and "
                               "`response` as text; fix or remove that record")


def test_token_rows_are_sent_on_to_extract_or_generate(tmp_path):
    rows, prompts = tmp_path / "rows.parquet", tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]]}), rows)
    pq.write_table(pa.table({"id": [0], "input_ids": [[1, 2, 3]]}), prompts)
    assert _refusal(rows) == (f"{rows}: row 0: token rows (`input_ids`), not conversations: prepare renders chat "
                              "records; give the file straight to `dflash-offline extract --data`")
    assert _refusal(prompts).endswith("give the file straight to `dflash-offline generate --prompts`")


def _cli_cases(p) -> dict:
    _dataset_dict(p / "dd", ["validation", "test"])
    _dataset(p / "ds", [{"messages": CONV}])
    (p / "ds" / "state.json").write_text("{bad")
    (p / "s.jsonl").write_text('{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", '
                               '"content": "ok"}]}\n')
    (p / "deep.jsonl").write_text("[" * 100000 + "\n")
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]]}), p / "rows.parquet")
    _chat.write_jsonl(p / "null.jsonl", [{"prompt": None, "response": "x"}])
    return {"dd": f"{p / 'dd'}: a `datasets` DatasetDict folder without a `train` split",
            "ds": f"{p / 'ds' / 'state.json'}: not valid JSON (",
            "s.jsonl": f"{p / 's.jsonl'}: line 1: `messages[0].content` holds \\ud800",
            "deep.jsonl": f"{p / 'deep.jsonl'}: line 1: not readable JSON (arrays or objects nested deeper",
            "rows.parquet": "give the file straight to `dflash-offline extract --data`",
            "null.jsonl": f"{p / 'null.jsonl'}: line 1: `prompt` is null, not text"}


def test_prepare_refuses_in_one_line_and_warns_of_left_out_parts(chat_target, tmp_path):
    for name, words in _cli_cases(tmp_path).items():
        out = tmp_path / f"out-{name}"
        r = run_cli(["prepare", "--target", chat_target, "--data", tmp_path / name, "--out", out, "--no-progress"])
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, r.stderr[-2000:])
        assert words in lines[0] and "Traceback" not in r.stderr, (name, lines)
        assert not (out / "train").exists(), name
    f = _chat.write_jsonl(tmp_path / "mm.jsonl", [{"id": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": "ok"}]}])
    r = run_cli(["prepare", "--target", chat_target, "--data", f, "--out", tmp_path / "out-mm", "--no-progress",
                 "--responses", "keep"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x for x in r.stderr.splitlines() if "not text" in x] == [
        f"warning: 1 record(s) hold content parts that are not text (1 image_url): those parts are left out, the text "
        f"of the record is kept (the drafter trains on text alone); the first: {f}: line 1: message 0 (image_url)"]
