"""Conversation files as users have them, read into one shape: `Record`s holding `Message`s.

Inputs: JSONL, JSON (an array of records, or an object holding one under `data`), Parquet, and
Hugging Face `datasets` folders (`save_to_disk`: Arrow files, a `DatasetDict` folder reads its
`train` split; one without is refused, as reading its validation and test splits into training
would be); files, folders and globs. Formats, detected per file or given with
`--format`:

| format | a record holds |
|---|---|
| `messages` | `messages`: OpenAI chat messages (system/user/assistant/tool; `tool_calls`, `reasoning_content`) |
| `sharegpt` | `conversations`: `{from, value}` turns (human/gpt/system, and the variants found in the wild) |
| `pair` | `prompt` + `response`/`completion`/`output`, or Alpaca `instruction` (+ `input`) + `output` |
| `turns` | `turns`: the user's messages alone (MT-Bench's questions): replies only by regeneration |
| `text` | `text`: plain text, every token trained (no chat template) |

A record whose *structure* is wrong (a turn without a role or a value, an unknown role, a value
that is not text or not valid Unicode, a file mixing formats) is refused in one line naming the
file and record: it means the file is not what it claims to be. A record that is well formed but unusable (empty, no
reply) is not an error: `prepare` drops it and counts the reason. No torch here.
"""

from __future__ import annotations

import glob
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from dflash_offline.runtime.errors import UserError

FORMATS = ("messages", "sharegpt", "pair", "turns", "text")

# ShareGPT role names met in published dumps (ShareGPT_V3 holds chatgpt, bing, bard and user too).
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "function_call": "assistant",
}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
                "function": "tool"}
PAIR_RESPONSE_KEYS = ("response", "completion", "output", "answer")


@dataclass
class Message:
    role: str  # system | user | assistant | tool
    content: str
    reasoning: str | None = None  # an assistant turn's thinking (`reasoning_content`)
    tool_calls: list | None = None
    extra: dict = field(default_factory=dict)  # name, tool_call_id: passed to the template as given

    def as_template_dict(self, with_reasoning: bool = True) -> dict:
        d = {"role": self.role, "content": self.content, **self.extra}
        if self.reasoning is not None and with_reasoning:
            d["reasoning_content"] = self.reasoning
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        return d


def messages_json(msgs: list[Message]) -> str:
    """A conversation as JSON text (the `messages` column of prompt and completion parts)."""
    return json.dumps([m.as_template_dict() for m in msgs], ensure_ascii=False)


@dataclass
class Record:
    index: int  # position over all input files, in the order given
    where: str  # "FILE record N" (or line N): for messages
    own_id: int | None  # the record's own integer id, when it has one
    source_id: str | None  # the record's own id as text (ShareGPT's "hRPPgZT_0")
    messages: list[Message] | None = None  # chat formats
    text: str | None = None  # the text format


# ----------------------------------------------------------------------------------------------
# Files


def resolve_inputs(paths: list[str], option: str = "--data") -> list[Path]:
    """Files in the order given: a folder contributes its data files in name order (or is read as
    a `datasets` folder), a glob its matches in name order."""
    out: list[Path] = []
    for p in paths:
        if any(c in p for c in "*?["):
            found = sorted(Path(m) for m in glob.glob(p, recursive=True) if Path(m).is_file())
            if not found:
                raise UserError(f"{option} {p}: the pattern matches no file")
            out.extend(found)
            continue
        path = Path(p)
        if path.is_dir():
            if _is_datasets_folder(path):
                out.append(path)
                continue
            found = sorted(f for f in path.iterdir() if f.is_file() and _kind(f) is not None)
            if not found:
                raise UserError(f"{option} {p}: the folder holds no .jsonl, .json or .parquet file (nor a "
                                "`datasets` save_to_disk folder)")
            out.extend(found)
        elif path.is_file():
            if _kind(path) is None:
                raise UserError(f"{option} {p}: unknown file type {path.suffix!r}; give .jsonl, .json or .parquet "
                                "files or a `datasets` folder")
            out.append(path)
        elif "/" in p and not p.startswith((".", "/")) and p.count("/") == 1:
            out.append(Path(p))  # a hub dataset name (org/name): read_records loads it through `datasets`
        else:
            raise UserError(f"{option} {p}: no such file or folder")
    seen = set()
    for f in out:
        key = f.resolve() if f.exists() else f
        if key in seen:
            raise UserError(f"{option}: {f} is given twice (its records would be read twice)")
        seen.add(key)
    return out


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, kind in ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "json"), (".parquet", "parquet"),
                         (".arrow", "arrow")):
        if name.endswith(suffix):
            return kind
    return None


def _is_datasets_folder(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() or \
        (path / "state.json").is_file()


def _decode(raw: bytes, path: Path, where: str) -> str:
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not part of the data
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: {where}: invalid UTF-8 at byte {e.start} ({raw[e.start:e.start + 4]!r}); "
                        "convert the file to UTF-8") from None


def _too_deep(path: Path, where: str) -> UserError:
    # json's parser recurses once per level and stops at Python's recursion limit with a bare RecursionError.
    return UserError(f"{path}: {where}: not readable JSON (arrays or objects nested deeper than Python's parser "
                     "goes); a record is a few levels deep, so the text is damaged: fix or remove it")


# A \ud800-\udfff escape: JSON lets one stand alone (half of a UTF-16 pair), which no UTF-8 text
# holds; the parser keeps it, and it fails only when the text is encoded (tokenizer, Parquet).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_unicode(rec: object, raw: str | None, path: Path, where: str) -> None:
    """Refuse a record holding a lone surrogate, naming the field. `raw`, its text, is searched first:
    only records that write such an escape are walked (None: walk it)."""
    if raw is not None and not _SURROGATE_ESCAPE.search(raw):
        return
    todo = [(rec, "", False)]
    while todo:  # iterative: a record may be nested as deep as the parser allows
        v, at, key = todo.pop()
        if isinstance(v, dict):
            todo.extend((x, f"{at}.{k}" if at else str(k), False) for k, x in reversed(v.items()))
            todo.extend((k, at, True) for k in v)  # popped first: a bad key never reaches a message as a path
        elif isinstance(v, list):
            todo.extend((x, f"{at}[{i}]", False) for i, x in reversed(list(enumerate(v))))
        elif isinstance(v, str) and (bad := next((c for c in v if "\ud800" <= c <= "\udfff"), None)):
            at = (f"a key of `{at}`" if at else "a key") if key else f"`{at}`" if at else "the record"
            raise UserError(f"{path}: {where}: {at} holds \\u{ord(bad):04x}, half of a UTF-16 "
                            "surrogate pair without its other half: not valid Unicode text; fix the escape or remove "
                            "that record")


def iter_raw(path: Path) -> Iterator[tuple[str, object]]:
    """(where, raw record) pairs of one input: a file, a `datasets` folder or a hub name."""
    kind = "datasets" if path.is_dir() else _kind(path) if path.exists() else "hub"
    if kind == "jsonl":
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                line = _decode(raw, path, f"line {n}").strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}: line {n}: not valid JSON ({e.msg} at column {e.colno}); every line "
                                    "of a .jsonl file must be one JSON record") from None
                except RecursionError:
                    raise _too_deep(path, f"line {n}") from None
                _check_unicode(rec, line, path, f"line {n}")
                yield f"line {n}", rec
    elif kind == "json":
        yield from _iter_json(path)
    elif kind in ("parquet", "arrow", "datasets"):
        yield from _iter_arrow(path, kind)
    else:
        yield from _iter_hub(str(path))


def _iter_json(path: Path) -> Iterator[tuple[str, object]]:
    """A JSON array of records (or {"data": [...]}), read element by element so that a file cut
    off mid-record (as the public ShareGPT_V3 dump is) yields its complete records and then one
    warning, not a failure of the whole file."""
    text = _decode(path.read_bytes(), path, "file")
    dec = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if i == len(text):  # an empty file: no records (counted, as an empty .jsonl)
        return
    if text[i:i + 1] == "{":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            hint = (" (one JSON record per line? then name the file .jsonl)" if e.msg == "Extra data" else "")
            raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); expected an array of records"
                            + hint) from None
        except RecursionError:
            raise _too_deep(path, "file") from None
        data = obj.get("data") if isinstance(obj, dict) else None
        if not isinstance(data, list):
            raise UserError(f"{path}: a JSON object without a `data` list; expected an array of records (or "
                            "JSON Lines, one record per line, as .jsonl)")
        escapes = None if _SURROGATE_ESCAPE.search(text) else ""  # searched once, not once per record
        for n, rec in enumerate(data):
            _check_unicode(rec, escapes, path, f"record {n}")
            yield f"record {n}", rec
        return
    if text[i:i + 1] != "[":
        raise UserError(f"{path}: expected a JSON array of records (starting with '['); JSON Lines files must end "
                        "in .jsonl")
    i += 1
    n = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            logging.getLogger("dflash.prepare").warning(
                "%s: the file ends after %d complete records without closing its array (cut off?): the records "
                "read are kept, the rest of the file is ignored", path, n)
            _cut_off_files.append((str(path), n))
            return
        if text[i] == "]":
            return
        start = i
        try:
            rec, i = dec.raw_decode(text, i)
        except RecursionError:
            raise _too_deep(path, f"record {n}") from None
        except json.JSONDecodeError as e:
            # Cut off at the end (the file stops inside its last record): the parser fails at the end
            # of the text, or inside a string that no quote closes before it ends.
            end = len(text.rstrip())
            cut = text.rstrip()[-1:] != "]" and (e.pos >= end - 1 or (
                e.msg.startswith("Unterminated string") and '"' not in text[e.pos + 1:]))
            if cut:
                logging.getLogger("dflash.prepare").warning(
                    "%s: the file ends in the middle of record %d (cut off?): %d complete records are kept, the "
                    "incomplete one is dropped", path, n, n)
                _cut_off_files.append((str(path), n))
                return
            raise UserError(f"{path}: record {n}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") \
                from None
        _check_unicode(rec, text[start:i], path, f"record {n}")
        yield f"record {n}", rec
        n += 1


# Files read whole but cut off at their end: (path, complete records) for prepare's counts.
_cut_off_files: list[tuple[str, int]] = []


def cut_off_files() -> list[tuple[str, int]]:
    return list(_cut_off_files)


def forget_cut_off_files() -> None:
    """Start a new count of cut-off files (one read of a dataset)."""
    _cut_off_files.clear()


def _iter_arrow(path: Path, kind: str) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise UserError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        n = 0
        for g in range(pf.num_row_groups):
            for rec in pf.read_row_group(g).to_pylist():
                yield f"row {n}", rec
                n += 1
        return
    files = [path] if kind == "arrow" else _datasets_arrow_files(path)
    n = 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                try:
                    reader = pa.ipc.open_stream(fh)
                except pa.ArrowInvalid:
                    fh.seek(0)
                    reader = pa.ipc.open_file(fh)
                batches = reader if hasattr(reader, "__iter__") else (reader.get_batch(i)
                                                                     for i in range(reader.num_record_batches))
                for batch in batches:
                    for rec in batch.to_pylist():
                        yield f"row {n}", rec
                        n += 1
        except (pa.ArrowInvalid, OSError) as e:
            raise UserError(f"{f}: not a readable Arrow file ({e})") from None


_REDO = "the `datasets` folder is damaged: save it again (save_to_disk) or copy it whole"


def _datasets_json(file: Path) -> dict:
    """A `save_to_disk` metadata file (state.json, dataset_dict.json), a JSON object; a damaged one
    is refused naming it (a hand-edited or cut-off copy)."""
    try:
        obj = json.loads(file.read_bytes())
    except json.JSONDecodeError as e:
        raise UserError(f"{file}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {_REDO}") from None
    except (ValueError, RecursionError, OSError) as e:  # not UTF-8, nested absurdly, unreadable
        raise UserError(f"{file}: not readable JSON ({type(e).__name__}); {_REDO}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{file}: a JSON {type(obj).__name__}, not an object; {_REDO}")
    return obj


def _datasets_arrow_files(folder: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder, in their recorded order: a Dataset folder's
    state.json lists them; a DatasetDict folder holds one such folder per split, of which the
    `train` one is read (the others are evaluation data: reading them into training is refused)."""
    if (folder / "dataset_dict.json").is_file():
        dd = folder / "dataset_dict.json"
        splits = _datasets_json(dd).get("splits")
        if not isinstance(splits, list) or not all(isinstance(x, str) and x for x in splits):
            raise UserError(f"{dd}: `splits` is {json.dumps(splits)[:60]}, not a list of split names; {_REDO}")
        if "train" not in splits:
            raise UserError(f"{folder}: a `datasets` DatasetDict folder without a `train` split (its splits: "
                            f"{', '.join(splits) or 'none'}); give the split to read as its own folder"
                            + (f", e.g. {folder / splits[0]}" if splits else ""))
        if not (folder / "train").is_dir():
            raise UserError(f"{dd} lists the split `train` but {folder / 'train'} is not there; {_REDO}")
        return _datasets_arrow_files(folder / "train")
    state = folder / "state.json"
    if state.is_file():
        files = _datasets_json(state).get("_data_files") or []
        if not isinstance(files, list):
            raise UserError(f"{state}: `_data_files` is {json.dumps(files)[:60]}, not a list of files; {_REDO}")
        for k, d in enumerate(files):
            name = d.get("filename") if isinstance(d, dict) else None
            if not isinstance(name, str) or not name:
                raise UserError(f"{state}: `_data_files` entry {k} has no `filename` ({json.dumps(d)[:60]}); {_REDO}")
            if not (folder / name).is_file():
                raise UserError(f"{state}: `_data_files` entry {k} names {name}, which is not in {folder}; {_REDO}")
        if files:
            return [folder / d["filename"] for d in files]
    found = sorted(folder.glob("*.arrow"))
    if not found:
        raise UserError(f"{folder}: a `datasets` folder without Arrow files")
    return found


def _iter_hub(name: str) -> Iterator[tuple[str, object]]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"--data {name}: no such file or folder; to read a Hugging Face hub dataset by name, install "
                        "the extra: pip install 'dflash-offline[datasets]' (and have a network)") from None
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:  # network, missing dataset, ...: one line
        raise UserError(f"--data {name}: could not load it from the hub ({type(e).__name__}: {e})") from None
    for n, rec in enumerate(ds):
        yield f"row {n}", rec
