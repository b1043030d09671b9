"""Tokenized completions in Parquet (cache-contract.md, Input): validation, lengths, row fetches.

The launcher scans every file once before any model is loaded: schema, lengths, mask lengths,
token range, ids. Workers later fetch only the rows of their own shards, one row group at a time.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_offline.rows.parts import listed_parts
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.paths import file_sha256

log = logging.getLogger("dflash.data")


def resolve_files(paths: list[str], option: str = "--data") -> list[Path]:
    """Files in the order given; a folder contributes its *.parquet files in name order, or, for
    the output folder of `dflash-offline generate`, the parts its manifest lists (only once the
    generation is complete: a folder still being written is refused)."""
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = listed_parts(path)
            if found is None:
                found = sorted(path.glob("*.parquet"))
            if not found:
                raise UserError(f"{option} {p}: folder holds no *.parquet files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise UserError(f"{option} {p}: no such file or folder")
    seen = set()
    for f in files:
        if f.resolve() in seen:
            raise UserError(f"{option}: {f} is given twice (rows would be read twice)")
        seen.add(f.resolve())
    return files


@dataclass
class SourceFile:
    path: Path
    rows: int
    sha256: str
    row_group_starts: np.ndarray  # first row of each row group, plus the total at the end
    mask_column: str | None  # "loss_mask" or "prompt_len"; None for prompts (scan with need_mask=False)


@dataclass
class Source:
    """What the launcher learned from scanning the input, before loading any weights."""

    files: list[SourceFile]
    ids: np.ndarray  # int64 [rows], the id of each global row
    lengths: np.ndarray  # int64 [rows], untruncated token counts
    max_token: int
    trained_tokens: int = -1  # tokens with loss_mask 1 (prompt_len: past the prompt), untruncated; -1: not counted
    first_trained: np.ndarray | None = None  # int64 [rows]: each row's first trained position (its length if none)

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @functools.cached_property
    def _file_starts(self) -> np.ndarray:
        return np.cumsum([0] + [f.rows for f in self.files])

    def file_of_row(self, row: int) -> tuple[int, int]:
        """Global row -> (file index, row within file)."""
        fi = int(np.searchsorted(self._file_starts, row, side="right") - 1)
        return fi, row - int(self._file_starts[fi])

    def state(self) -> dict:
        """Plain fields, to cross a process spawn (`from_state` rebuilds it in the worker)."""
        return {"files": [{"path": str(f.path), "rows": f.rows, "sha256": f.sha256,
                           "row_group_starts": f.row_group_starts, "mask_column": f.mask_column} for f in self.files],
                "ids": self.ids, "lengths": self.lengths, "max_token": self.max_token,
                "trained_tokens": self.trained_tokens}

    @classmethod
    def from_state(cls, st: dict) -> "Source":
        return cls(files=[SourceFile(**f) for f in st["files"]], ids=st["ids"], lengths=st["lengths"],
                   max_token=st["max_token"], trained_tokens=st.get("trained_tokens", -1))

    def manifest_entry(self) -> dict:
        return {
            "files": [{"path": str(f.path), "rows": f.rows, "sha256": f.sha256} for f in self.files],
            "rows": self.rows,
        }


def _refuse_null_element(path: Path, column: str, flat, lens: np.ndarray, base: int) -> None:
    """A null inside a row's list (e.g. [1, None, 3]) is refused naming the row: min/max and the
    casts to numpy skip or garble nulls, so one would be written as a token id or a mask value.
    `flat` is the column's values (list_flatten, nulls of whole rows excluded): its null_count is
    kept by Arrow, so the check costs nothing when there are none."""
    if not flat.null_count:
        return
    k = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
    row = int(np.searchsorted(np.cumsum(lens), k, side="right"))
    pos = k - (int(np.cumsum(lens)[row - 1]) if row else 0)
    raise UserError(f"{path}: row {base + row} of column {column} holds a null element (position {pos}); every "
                    "entry must be a value: fix or drop that row")


INT64_MAX = (1 << 63) - 1


def ids_as_int64(where: str, column, base: int = 0) -> np.ndarray:
    """An `id` column as int64, the contract's id type, read in the file's own type first: an
    unsigned id above 2^63 - 1 is refused naming the row and its value as the file holds it (cast
    first, it would wrap to a negative number that no one wrote); `where` names the file (and
    option), `base` the first row's index."""
    col = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    if col.null_count:
        r = base + int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise UserError(f"{where}: row {r} has a null id; every row needs one (or drop the id column)")
    values = col.to_numpy(zero_copy_only=False)
    if values.dtype.kind == "u" and values.size and int(values.max()) > INT64_MAX:
        r = int(np.flatnonzero(values > np.uint64(INT64_MAX))[0])
        raise UserError(f"{where}: row {base + r}: id {int(values[r])} (the column is {col.type}) is above the "
                        f"largest id the contract allows, 2^63 - 1 = {INT64_MAX} (ids are int64); renumber the ids")
    return values.astype(np.int64)


def is_int_list(t: pa.DataType, booleans: bool = False) -> bool:
    """A list column of integers (token ids; `booleans`: or of bools, as a loss_mask may be)."""
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
        pa.types.is_integer(t.value_type) or (booleans and pa.types.is_boolean(t.value_type)))


def _checked_columns(path, schema, need_mask: bool) -> str | None:
    """The file's columns checked against the contract (input_ids, an id if any, and with
    `need_mask` a loss_mask or prompt_len); -> the mask column read (None for prompts)."""
    names = set(schema.names)
    if "input_ids" not in names:
        raise UserError(f"{path}: missing column 'input_ids' (columns: {', '.join(schema.names)})")
    if not is_int_list(schema.field("input_ids").type):
        raise UserError(f"{path}: column 'input_ids' must be a list of integers, found {schema.field('input_ids').type}")
    if "id" in names and not pa.types.is_integer(schema.field("id").type):
        raise UserError(f"{path}: column 'id' must be an integer, found {schema.field('id').type}")
    if not need_mask:
        return None  # prompts: a mask column, if any, is not read
    if "loss_mask" in names:
        t = schema.field("loss_mask").type
        if not is_int_list(t, booleans=True):
            raise UserError(f"{path}: column 'loss_mask' must be a list of int8/bool, found {t}")
        return "loss_mask"
    if "prompt_len" in names:
        if not pa.types.is_integer(schema.field("prompt_len").type):
            raise UserError(f"{path}: column 'prompt_len' must be an integer, found {schema.field('prompt_len').type}")
        return "prompt_len"
    raise UserError(f"{path}: needs a 'loss_mask' (list per row) or a 'prompt_len' (integer) column; found "
                    f"{', '.join(schema.names)} (prompts alone, e.g. prepare's --responses regenerate output, "
                    "are completed by `dflash-offline generate` first)")


def _checked_tokens(path, ids_col, base: int, vocab_size: int) -> tuple[np.ndarray, int]:
    """A row group's input_ids checked (no null row or token, none empty, every id in the
    vocabulary); -> (each row's length, the largest id or -1)."""
    if ids_col.null_count:
        r = base + int(np.flatnonzero(ids_col.is_null().to_numpy(zero_copy_only=False))[0])
        raise UserError(f"{path}: row {r}: input_ids is null")
    lens = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    empty = np.flatnonzero(lens == 0)
    if empty.size:
        raise UserError(f"{path}: row {base + int(empty[0])}: input_ids is empty")
    flat = pc.list_flatten(ids_col)
    _refuse_null_element(path, "input_ids", flat, lens, base)
    if not len(flat):
        return lens, -1
    mm = pc.min_max(flat)
    lo, hi = mm["min"].as_py(), mm["max"].as_py()
    if lo < 0 or hi >= vocab_size:
        vals = flat.to_numpy(zero_copy_only=False)
        bad = int(np.flatnonzero((vals < 0) | (vals >= vocab_size))[0])
        row = int(np.searchsorted(np.cumsum(lens), bad, side="right"))
        raise UserError(
            f"{path}: row {base + row}: token id {int(vals[bad])} is outside the target "
            f"vocabulary [0, {vocab_size}); was the data tokenized for another model?"
        )
    return lens, hi


def _checked_mask(path, mask_col: str, mask, lens: np.ndarray, base: int) -> tuple[int, np.ndarray]:
    """A row group's loss_mask (0/1 per token, as long as its row) or prompt_len (within its row)
    checked; -> the tokens it trains, and each row's first trained position (its length if none)."""
    if mask.null_count:
        r = base + int(np.flatnonzero(mask.is_null().to_numpy(zero_copy_only=False))[0])
        raise UserError(f"{path}: row {r}: {mask_col} is null")
    if mask_col == "prompt_len":
        pl = mask.to_numpy(zero_copy_only=False)
        bad = np.flatnonzero((pl < 0) | (pl > lens))
        if bad.size:
            r = int(bad[0])
            raise UserError(
                f"{path}: row {base + r}: prompt_len {int(pl[r])} is outside [0, {int(lens[r])}] (the row's length)"
            )
        return int((lens - pl).sum()), pl.astype(np.int64)
    mlens = pc.list_value_length(mask).to_numpy(zero_copy_only=False)
    diff = np.flatnonzero(mlens != lens)
    if diff.size:
        r = int(diff[0])
        raise UserError(
            f"{path}: row {base + r}: loss_mask has {int(mlens[r])} entries but input_ids has {int(lens[r])}"
        )
    mflat = pc.list_flatten(mask)
    _refuse_null_element(path, "loss_mask", mflat, lens, base)
    if len(mflat) and not pa.types.is_boolean(mflat.type):
        mvals = mflat.to_numpy(zero_copy_only=False)
        bad = np.flatnonzero((mvals < 0) | (mvals > 1))
        if bad.size:
            row = int(np.searchsorted(np.cumsum(lens), int(bad[0]), side="right"))
            raise UserError(f"{path}: row {base + row}: loss_mask holds {int(mvals[bad[0]])}; only 0 and 1 are allowed")
    ones = np.flatnonzero(np.asarray(mflat.to_numpy(zero_copy_only=False), dtype=bool))
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    first = lens.astype(np.int64).copy()
    if ones.size:
        row_of = np.searchsorted(starts, ones, side="right") - 1
        rows, at = np.unique(row_of, return_index=True)  # each row's first 1 (ones are in order)
        first[rows] = ones[at] - starts[rows]
    return int(ones.size), first


def scan(paths: list[str], vocab_size: int, option: str = "--data", need_mask: bool = True) -> Source:
    """Validate every input file against the contract; raise UserError naming file, row, problem.
    `need_mask=False` reads prompts (`generate --prompts`): `input_ids` and the optional `id`."""
    files = resolve_files(paths, option)
    out_files: list[SourceFile] = []
    ids_all, lens_all = [], []
    max_token, trained, firsts = -1, 0, []
    positional: set[int] = set()  # files without an id column (their rows' ids are global positions)
    offset = 0
    for path in files:
        try:
            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
        except Exception as e:  # pyarrow raises several types for a bad file
            hint = ("; conversation data (.jsonl, .json) goes through `dflash-offline prepare` first, which writes "
                    "the token rows this option reads" if str(path).endswith((".jsonl", ".json", ".txt")) else
                    f"; {option} takes Parquet with an input_ids column (the input contract), or a prepare or "
                    "generate output folder")
            raise UserError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e}){hint}") from None
        mask_col = _checked_columns(path, schema, need_mask)
        has_id = "id" in schema.names

        rg_rows = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
        starts = np.concatenate([[0], np.cumsum(rg_rows)]).astype(np.int64)
        cols = ["input_ids"] + ([mask_col] if mask_col else []) + (["id"] if has_id else [])
        for g in range(pf.num_row_groups):
            try:
                tab = pf.read_row_group(g, columns=cols)
            except Exception as e:
                raise UserError(f"{path}: row group {g} unreadable ({type(e).__name__}: {e})") from None
            base = int(starts[g])
            lens, hi = _checked_tokens(path, tab.column("input_ids").combine_chunks(), base, vocab_size)
            max_token = max(max_token, hi)
            if mask_col:
                got, first = _checked_mask(path, mask_col, tab.column(mask_col).combine_chunks(), lens, base)
                trained += got
                firsts.append(first)
            if has_id:
                ids_all.append(ids_as_int64(str(path), tab.column("id"), base))
            else:
                ids_all.append(None)  # filled below from global indices
            lens_all.append(lens)
        if pf.metadata.num_rows == 0:
            raise UserError(f"{path}: file has no rows")
        if not has_id:
            positional.add(len(out_files))
        out_files.append(SourceFile(path=path, rows=int(starts[-1]), sha256=file_sha256(path),
                                    row_group_starts=starts, mask_column=mask_col))
        offset += int(starts[-1])

    # Ids: explicit where given, the global index otherwise; unique across all files.
    ids_parts, pos = [], 0
    for part, lens in zip(ids_all, lens_all):
        n = lens.shape[0]
        ids_parts.append(part if part is not None else np.arange(pos, pos + n, dtype=np.int64))
        pos += n
    ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int64)
    lengths = np.concatenate(lens_all) if lens_all else np.zeros(0, np.int64)
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.shape[0] != ids.shape[0]:
        dup = int(uniq[np.flatnonzero(counts > 1)[0]])
        rows = np.flatnonzero(ids == dup)[:2]
        src = Source(out_files, ids, lengths, max_token)
        # A file without an id column numbers its rows by global position: say so, or the clash is a riddle.
        where = [f"{src.files[fi].path} row {fr}" + (" (no id column: its ids are row positions over all inputs)"
                                                      if fi in positional else "")
                 for fi, fr in (src.file_of_row(int(r)) for r in rows)]
        raise UserError(f"id {dup} occurs twice ({where[0]}; {where[1]}): ids must be unique across all input files")
    if (ids < 0).any():
        r = int(np.flatnonzero(ids < 0)[0])
        src = Source(out_files, ids, lengths, max_token)
        fi, fr = src.file_of_row(r)
        raise UserError(f"{out_files[fi].path}: row {fr}: id {int(ids[r])} is negative; ids must be >= 0")
    return Source(files=out_files, ids=ids, lengths=lengths, max_token=max_token,
                  trained_tokens=trained if need_mask else -1,
                  first_trained=np.concatenate(firsts) if need_mask and firsts else None)


def require_trained(source: Source, label: str) -> None:
    """Refuse input with no token to train on (`label`: the option and paths as given): a cache of
    it would be complete and train nothing (extract), a plan for one sizes nothing (plan)."""
    if source.trained_tokens == 0:
        raise UserError(f"{label}: no row has a token to train on (every loss_mask value is 0, or every prompt_len "
                        "is the row's length); give the completions, with loss_mask 1 on what the model writes")


class RowReader:
    """Fetch rows (tokens and loss mask) by global index, reading whole row groups, one cached."""

    def __init__(self, source: Source):
        self.source = source
        self._key: tuple[int, int] | None = None
        self._ids: list | None = None
        self._mask: list | None = None

    def _load(self, fi: int, g: int) -> None:
        if self._key == (fi, g):
            return
        f = self.source.files[fi]
        tab = pq.ParquetFile(f.path).read_row_group(g, columns=["input_ids"] + ([f.mask_column] if f.mask_column else []))
        self._ids = tab.column("input_ids").combine_chunks()
        self._mask = tab.column(f.mask_column).combine_chunks() if f.mask_column else None
        self._key = (fi, g)

    def row(self, global_row: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32 [n], loss_mask uint8 [n]) of one row, untruncated."""
        fi, r = self.source.file_of_row(global_row)
        f = self.source.files[fi]
        g = int(np.searchsorted(f.row_group_starts, r, side="right") - 1)
        self._load(fi, g)
        i = r - int(f.row_group_starts[g])
        ids = np.asarray(self._ids[i].values.to_numpy(zero_copy_only=False), dtype=np.int32)
        if f.mask_column is None:
            mask = np.zeros(ids.shape[0], np.uint8)
        elif f.mask_column == "loss_mask":
            mask = np.asarray(self._mask[i].values.to_numpy(zero_copy_only=False), dtype=np.uint8)
        else:
            mask = np.zeros(ids.shape[0], np.uint8)
            mask[int(self._mask[i].as_py()):] = 1
        return ids, mask
