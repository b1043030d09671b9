"""eval's inputs: the prompts (a Parquet file, or a prepare/generate output folder) and the
reference completions, read and checked before any model loads (one line per problem); and the
warning when the prompts were rendered another way than the drafter was trained on.

Prompts given as training rows (a `loss_mask` column: `prepare --responses keep`, a `generate`
output, a completions file of the input contract) are cut to their prompt, the tokens before the
first trained one, and a warning line says so: the whole row as a prompt would have the target
continue after a reply it already finished, and measure nothing a server sees."""

from __future__ import annotations

import logging
from pathlib import Path

from dflash_offline.chat.template import ChatTemplate, differences, turn_stop
from dflash_offline.evaluate.config import AS_FLAGS, Said
from dflash_offline.rows.parts import (PREPARED_FORMAT, chat_settings_of, damaged_fix, listed_parts, parts_folder,
                                       read_manifest)
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.paths import require_kind
from dflash_offline.rows.reader import ids_as_int64, is_int_list

log = logging.getLogger("dflash.eval")


def _parts_of(option: str, folder: str):
    """listed_parts of a folder (None: not a prepare or generate output), its refusals (an
    unreadable manifest, an unfinished output) naming the option too."""
    try:
        return listed_parts(folder)
    except UserError as e:
        raise UserError(f"{option} {e}") from None


def check_rows_path(path: str | None, option: str, what: str, folder: str) -> None:
    """A file, or a folder that is a prepare or generate output: anything else in one line (`what`
    and `folder`: the file and the folder to give instead)."""
    if path and Path(path).is_dir():
        if _parts_of(option, path) is None:
            raise UserError(f"{option} {path}: a folder, not a file; give {what}, or {folder}")
        return
    require_kind(path, option, False, what)


def check_prompts_path(prompts: str | None, said: Said = AS_FLAGS) -> None:
    """A file, or a folder that is a prepare or generate output: anything else in one line."""
    check_rows_path(prompts, said("prompts"), "a Parquet file with an input_ids column",
                    "an output folder of prepare (OUT/eval) or generate")


def check_reference_path(reference: str | None, said: Said = AS_FLAGS) -> None:
    """A file, or a generate output folder: anything else in one line."""
    check_rows_path(reference, said("reference"), "a Parquet file of the target's greedy completions",
                    "an output folder of generate")


def _int64_ids(where: str, column):
    """An `id` column as int64 (rows.reader.ids_as_int64), refused first unless it is an integer column."""
    import pyarrow as pa

    if not pa.types.is_integer(column.type):
        raise UserError(f"{where}: column 'id' must be an integer, found {column.type}")
    return pa.array(ids_as_int64(where, column), pa.int64())


def _unreadable(e: Exception) -> str:
    """An exception of pyarrow's in a line: its type and the first line of its text."""
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _read_parts(option: str, path: str, parts: list[Path], columns: tuple[str, ...], fix: str,
                optional: tuple[str, ...] = ()):
    """The parts of a prepare or generate folder as one table: each part read on its own, so that a
    damaged or missing part, a missing column or an id the contract does not allow is named by its
    part file (and row); ids as int64 in every part (a part of uint64 ids beside int64 ones)."""
    import pyarrow as pa

    damaged = damaged_fix(read_manifest(path))
    tables = []
    for f in parts:
        where = f"{option} {path}: {f.name}"
        if not f.is_file():
            raise UserError(f"{where}: no such file, though {path}/manifest.json lists it; {damaged}")
        tables.append(_read_file(where, f, columns, damaged, fix, optional))
    with_id = ["id" in t.column_names for t in tables]
    if any(with_id) and not all(with_id):
        k = with_id.index(not with_id[0])
        has = lambda j: "has an id column" if with_id[j] else "has no id column"  # noqa: E731
        raise UserError(f"{option} {path}: {parts[k].name} {has(k)}, {parts[0].name} {has(0)}; give every part "
                        "its ids, or none")
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException:
        k = next((k for k, t in enumerate(tables) if t.schema != tables[0].schema), len(tables) - 1)
        show = lambda t: ", ".join(f"{c.name} {c.type}" for c in t.schema)  # noqa: E731
        raise UserError(f"{option} {path}: {parts[k].name}: its columns ({show(tables[k])}) do not match those of "
                        f"{parts[0].name} ({show(tables[0])}); {fix}") from None


def _read_table(option: str, path: str, columns: tuple[str, ...], fix: str, optional: tuple[str, ...] = ()):
    """A Parquet table with `columns` (and `id` and `optional` ones, when there; `id` an integer
    column), or one line naming the option, the file (a folder's part file) and the fix."""

    if Path(path).is_dir():  # a part folder (a prepare or generate output): its committed parts
        parts = _parts_of(option, path)
        if parts is None:
            raise UserError(f"{option} {path}: a folder, but not a prepare or generate output; {fix}")
        if not parts:
            raise UserError(f"{option} {path}: its manifest.json lists no part file (no rows); {fix}")
        return _read_parts(option, path, parts, columns, fix, optional)
    if not Path(path).is_file():
        raise UserError(f"{option} {path}: no such file; {fix}")
    return _read_file(f"{option} {path}", Path(path), columns, fix, fix, optional)


def _read_file(where: str, f: Path, columns: tuple[str, ...], unreadable_fix: str, fix: str,
               optional: tuple[str, ...] = ()):
    """One Parquet file's `columns` (and `id`, as int64, and `optional` ones, when there), or one
    line starting `where`."""
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(f).names
        t = pq.read_table(f, columns=[c for c in dict.fromkeys(("id", *columns, *optional)) if c in names])
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        if f.suffix in (".jsonl", ".json", ".txt"):  # conversations: prepare renders them first (as extract says)
            unreadable_fix = ("conversation data (.jsonl, .json) goes through `dflash-offline prepare` first, which "
                              "writes the prompts this option reads (OUT/eval)")
        raise UserError(f"{where}: not a readable Parquet file ({_unreadable(e)}); {unreadable_fix}") from None
    need = [c for c in columns if c not in t.column_names]
    if need:
        raise UserError(f"{where}: no {', '.join(need)} column (columns: {', '.join(names)}); {fix}")
    if "id" in t.column_names:
        t = t.set_column(t.column_names.index("id"), "id", _int64_ids(where, t.column("id")))
    return t


def _part_and_row(path: str, row: int) -> tuple[str | None, int]:
    """Where row `row` of what `_read_table` read lies: (None, row) in a file; in a part folder
    (the table concatenates its parts) the part file's name and the row within it."""
    if not Path(path).is_dir():
        return None, row
    import pyarrow.parquet as pq

    for f in listed_parts(path):
        n = pq.read_metadata(f).num_rows
        if row < n:
            return f.name, row
        row -= n
    return None, row


def _at(option: str, path: str, row: int) -> str:
    """The start of a line about row `row` of what `_read_table` read: the option and file, and the
    part file that holds the row in a part folder."""
    part, _ = _part_and_row(path, row)
    return f"{option} {path}: " + (f"{part}: " if part else "")


def _row_place(option: str, path: str, row: int) -> str:
    """Row `row` of what `_read_table` read, named: the file and row, or the part file and the row within it."""
    return f"{_at(option, path, row)}row {_part_and_row(path, row)[1]}"


def read_prompts(path: str, vocab_size: int, max_prompts: int | None = None,
                 said: Said = AS_FLAGS) -> tuple[list[int], list[list[int]]]:
    """(ids, prompts) from a Parquet file with `input_ids` (and optional `id`); one line per problem.
    Rows with a `loss_mask` (prompt + completion) give their prompt (see the module doc)."""

    option = said("prompts")
    table = _read_table(option, path, ("input_ids",), "expected a Parquet file with an input_ids column",
                        optional=("loss_mask",))
    # The column types first: a wrong one would otherwise surface as a TypeError mid-loop.
    t = table.schema.field("input_ids").type
    if not is_int_list(t):
        raise UserError(f"{option} {path}: column 'input_ids' must be a list of integers (token ids), found {t}")
    prompts = table.column("input_ids").to_pylist()
    if "loss_mask" in table.column_names:
        t = table.schema.field("loss_mask").type
        if not is_int_list(t, booleans=True):
            raise UserError(f"{option} {path}: column 'loss_mask' must be a list of integers (0 on the prompt, 1 on "
                            f"the completion), found {t}")
        prompts = _prompt_parts(option, path, prompts, table.column("loss_mask").to_pylist())
    # _read_table made an id column int64 (or refused it)
    ids = table.column("id").to_pylist() if "id" in table.column_names else list(range(len(prompts)))
    if len(set(ids)) < len(ids):
        seen: set[int] = set()
        dup = next(i for i in ids if i in seen or seen.add(i))
        raise UserError(f"{option} {path}: id {dup} occurs twice; ids must be unique (outputs are reported by id)")
    if max_prompts is not None:
        prompts, ids = prompts[:max_prompts], ids[:max_prompts]
    if not prompts:
        raise UserError(f"{option} {path}: the file holds no rows; give at least one prompt")
    for row, toks in enumerate(prompts):
        if toks is None:
            raise UserError(f"{_row_place(option, path, row)} is null; every prompt needs at least one token")
        if not toks:
            raise UserError(f"{_row_place(option, path, row)} is empty; every prompt needs at least one token")
        if None in toks:
            raise UserError(f"{_row_place(option, path, row)} of column input_ids holds a null element (position "
                            f"{toks.index(None)}); every entry must be a token id: fix or drop that row")
        bad = next((t for t in toks if not 0 <= int(t) < vocab_size), None)
        if bad is not None:
            raise UserError(f"{_row_place(option, path, row)} holds token id {bad}, outside the target's vocabulary "
                            f"(0..{vocab_size - 1}); tokenize with the target's tokenizer")
    return [int(i) for i in ids], [[int(t) for t in toks] for toks in prompts]


def _prompt_parts(option: str, path: str, rows: list, masks: list) -> list:
    """Each training row's prompt: its tokens before the first one its loss_mask trains. A row
    trained from its first token (a plain-text row) has no prompt: refused, naming what writes
    prompts."""
    out = []
    for row, (toks, mask) in enumerate(zip(rows, masks)):
        if toks is None or mask is None:
            out.append(toks)  # the null row is named by the checks that follow
            continue
        n = next((k for k, v in enumerate(mask) if v), len(toks))
        if n == 0 and toks:
            raise UserError(f"{_row_place(option, path, row)}: a training row trained from its first token (its "
                            "loss_mask starts with 1), so it has no prompt to decode from; give prompts: "
                            "`dflash-offline prepare --responses regenerate` writes them (OUT/eval)")
        out.append(toks[:n])
    prepared = Path(path).is_dir() and (read_manifest(path) or {}).get("format") == PREPARED_FORMAT
    made_by = "a prepare --responses keep output" if prepared else \
        "a generate output" if Path(path).is_dir() else "a loss_mask column"
    log.warning("%s %s: training rows (%s): each prompt is its row's tokens before the first trained one "
             "(the prompt its completion was written for), not the whole row", option, path, made_by)
    return out


def _sampled_at(path: str) -> float | None:
    """The temperature a generate output was sampled at (its manifest's record: the folder's own,
    or `x.parquet.parts/` beside a merged `x.parquet`), None when greedy or not recorded."""
    folder = Path(path) if Path(path).is_dir() else parts_folder(path)
    m = read_manifest(folder) if folder.is_dir() else None
    t = ((m or {}).get("settings") or {}).get("temperature")
    return t if isinstance(t, (int, float)) and t > 0 else None


def read_reference(path: str, ids: list[int], prompts: list[list[int]], max_new: int, eos: set[int],
                   said: Said = AS_FLAGS, *, vocab_size: int | None = None, greedy: bool = True) -> list[list[int]]:
    """The output the target's greedy decode would give for each prompt, from a Parquet file of
    its greedy completions, or a generate output folder (input contract: `id`, `input_ids` =
    prompt + completion, `loss_mask` 0 on the prompt and 1 on the completion; `dflash-offline
    generate` writes it): the completion cut where `greedy_decode` stops, after max_new tokens or
    at its first end-of-sequence token. Refused in one line, before anything decodes: a prompt id
    without a row, a row without a completion, a row whose prompt part is not that prompt, a
    completion token outside the target's vocabulary (`vocab_size`, when given), a completion that
    ends before max_new tokens without an end-of-sequence token (the decode would go on where the
    reference has nothing to compare)."""

    option = said("reference")
    fix = f"give the target's greedy completions of these prompts ({said('prompts')}; dflash-offline generate)"
    sampled = _sampled_at(path)
    if greedy and sampled:  # its own record says it: the drafter would be blamed for the sampling
        raise UserError(f"{option} {path} was sampled (generate --temperature {sampled}, its manifest says): the check "
                        f"compares with the target's greedy decode; {fix} at --temperature 0 (the default)")
    table = _read_table(option, path, ("id", "input_ids", "loss_mask"), fix)
    for name in ("input_ids", "loss_mask"):  # the types first: a wrong one would be a TypeError below
        t = table.schema.field(name).type
        if not is_int_list(t, booleans=name == "loss_mask"):
            raise UserError(f"{option} {path}: column {name!r} must be a list of integers, found {t}; {fix}")
    rows: dict[int, tuple[int, list[int], list[int]]] = {}
    for row, (rid, toks, mask) in enumerate(zip(table.column("id").to_pylist(),  # int64: _read_table
                                                table.column("input_ids").to_pylist(),
                                                table.column("loss_mask").to_pylist())):
        if rid in rows:
            raise UserError(f"{_at(option, path, row)}id {rid} occurs twice; ids must be unique")
        rows[rid] = (row, toks or [], mask or [])
    missing = [i for i in ids if i not in rows]
    if missing:
        raise UserError(f"{option} {path}: no row for prompt id(s) {missing[:10]} ({len(missing)} of {len(ids)}); {fix}")
    want = []
    for i, prompt in zip(ids, prompts):
        row, toks, mask = rows[i]
        at = f"{_at(option, path, row)}id {i}"
        for name, values in (("input_ids", toks), ("loss_mask", mask)):
            if None in values:
                raise UserError(f"{at}: column {name} holds a null element (position {values.index(None)}); {fix}")
        n = next((k for k, v in enumerate(mask) if v), len(mask))
        if len(mask) != len(toks) or any(not v for v in mask[n:]):
            raise UserError(f"{at}: loss_mask is not 0 on a prompt then 1 on the completion "
                            f"({len(toks)} tokens, {len(mask)} mask entries); {fix}")
        if n == len(mask):
            raise UserError(f"{at}: the row has no completion (its loss_mask holds no 1: all {len(toks)} tokens "
                            f"are prompt); {fix}")
        if toks[:n] != prompt:
            k = next((k for k, (a, b) in enumerate(zip(toks[:n], prompt)) if a != b), min(n, len(prompt)))
            raise UserError(f"{at}: its prompt ({n} tokens) differs from the "
                            f"{said('prompts')} row ({len(prompt)} tokens) from token {k} on; {fix}")
        completion = toks[n:]
        if vocab_size is not None:
            bad = next((k for k, t in enumerate(completion) if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise UserError(f"{at}: its completion holds token id {completion[bad]} (position {bad}), outside "
                                f"the target's vocabulary (0..{vocab_size - 1}); {fix}")
        stop = next((k + 1 for k, t in enumerate(completion[:max_new]) if t in eos), max_new)
        if len(completion) < stop:
            raise UserError(f"{at}: its completion ends after {len(completion)} tokens without an "
                            f"end-of-sequence token, before {said('max_new_tokens')} {max_new}; lower it or "
                            "generate the reference with at least as many new tokens")
        want.append([int(t) for t in completion[:stop]])
    return want


def warn_chat_mismatch(prompts: str, drafters) -> None:
    """A drafter trained on text rendered one way (template, thinking mode, system prompt) and
    measured on prompts rendered another: said loudly, since served that way it loses much of its
    tau (the most reported DFlash pitfall). Known only for prompts from `prepare`."""
    used = chat_settings_of([prompts]) if Path(prompts).is_dir() else None
    for path, d in drafters:
        diff = differences(d.cfg.chat, used)
        if diff:
            log.warning("--drafter %s was trained on conversations rendered another way than --prompts %s (%s): "
                        "its tau here is not the tau it was trained for; prepare the prompts with the drafter's "
                        "settings (its config.json %s)", path, prompts, "; ".join(diff),
                        "dflash_offline.chat" if d.cfg.method == "dspark" else "dflash_config.chat")


def chat_stop_ids(prompts: str, target: str, eos: set[int], runs_to: str):
    """The ids a decode stops at for `prompts` (chat/template.py `turn_stop`), and a warning or None:
    prompts rendered by `prepare` end their replies at the chat template's end of turn, as `generate`
    ends them, so a template whose end of turn is one token the end-of-sequence ids lack (a
    generation_config.json naming <|endoftext|> alone beside a ChatML template) still stops there.
    Plain prompts, and --ignore-eos (an empty `eos`), keep `eos`."""
    chat = chat_settings_of([prompts]) if eos and Path(prompts).is_dir() else None
    if chat is None:
        return eos, None

    stop = turn_stop(ChatTemplate.recorded(target, chat, sorted(eos)), sorted(eos), None, runs_to)
    return set(stop.eos), stop.warning
