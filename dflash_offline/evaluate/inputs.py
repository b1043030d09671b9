"""eval's inputs: the prompts (a Parquet file, or a prepare/generate output folder) and the
reference completions, read and checked before any model loads (one line per problem); and the
warning when the prompts were rendered another way than the drafter was trained on."""

from __future__ import annotations

import logging
from pathlib import Path

from dflash_offline.evaluate.config import AS_FLAGS, Said
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.paths import require_kind
from dflash_offline.rows.reader import ids_as_int64

log = logging.getLogger("dflash.eval")


def check_prompts_path(prompts: str | None, said: Said = AS_FLAGS) -> None:
    """A file, or a folder that is a prepare or generate output: anything else in one line."""
    if prompts and Path(prompts).is_dir():
        from dflash_offline.rows.parts import read_manifest

        if read_manifest(prompts) is None:
            raise UserError(f"{said('prompts')} {prompts}: a folder, not a file; give a Parquet file with an input_ids "
                            "column, or an output folder of prepare (OUT/eval) or generate")
        return
    require_kind(prompts, said("prompts"), False, "a Parquet file with an input_ids column")


def _read_table(option: str, path: str, columns: tuple[str, ...], fix: str):
    """A Parquet table with `columns`, or one line naming the option, the file and the fix."""
    import pyarrow.parquet as pq

    if Path(path).is_dir():  # a part folder (a prepare or generate output): its committed parts
        from dflash_offline.rows.parts import listed_parts

        parts = listed_parts(path)
        if not parts:
            raise UserError(f"{option} {path}: a folder, but not a prepare or generate output; {fix}")
        import pyarrow as pa

        tables = [pq.read_table(f, columns=[c for c in ("id", *columns) if c in pq.read_schema(f).names])
                  for f in parts]
        return pa.concat_tables(tables)
    if not Path(path).is_file():
        raise UserError(f"{option} {path}: no such file; {fix}")
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise UserError(f"{option} {path}: not a readable Parquet file ({type(e).__name__}: {e}); {fix}") from None
    need = [c for c in columns if c not in table.column_names]
    if need:
        raise UserError(f"{option} {path}: no {', '.join(need)} column (columns: {', '.join(table.column_names)}); {fix}")
    return table


def _row_place(option: str, path: str, row: int) -> str:
    """Where row `row` of what `_read_table` read lies: the file, or a part folder's part file and
    the row within it (the table concatenates the parts)."""
    if not Path(path).is_dir():
        return f"{option} {path}: row {row}"
    import pyarrow.parquet as pq

    from dflash_offline.rows.parts import listed_parts

    for f in listed_parts(path):
        n = pq.read_metadata(f).num_rows
        if row < n:
            return f"{option} {path}: {Path(f).name}: row {row}"
        row -= n
    return f"{option} {path}: row {row}"


def read_prompts(path: str, vocab_size: int, max_prompts: int | None = None,
                 said: Said = AS_FLAGS) -> tuple[list[int], list[list[int]]]:
    """(ids, prompts) from a Parquet file with `input_ids` (and optional `id`); one line per problem."""
    import pyarrow as pa

    option = said("prompts")
    table = _read_table(option, path, ("input_ids",), "expected a Parquet file with an input_ids column")
    # The column types first: a wrong one would otherwise surface as a TypeError mid-loop.
    t = table.schema.field("input_ids").type
    if not ((pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)):
        raise UserError(f"{option} {path}: column 'input_ids' must be a list of integers (token ids), found {t}")
    if "id" in table.column_names and not pa.types.is_integer(table.schema.field("id").type):
        raise UserError(f"{option} {path}: column 'id' must be an integer, found {table.schema.field('id').type}")
    prompts = table.column("input_ids").to_pylist()
    ids = (ids_as_int64(f"{option} {path}", table.column("id")).tolist() if "id" in table.column_names
           else list(range(len(prompts))))
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


def read_reference(path: str, ids: list[int], prompts: list[list[int]], max_new: int, eos: set[int],
                   said: Said = AS_FLAGS) -> list[list[int]]:
    """The output the target's greedy decode would give for each prompt, from a Parquet file of
    its greedy completions (input contract: `id`, `input_ids` = prompt + completion, `loss_mask`
    0 on the prompt and 1 on the completion; `dflash-offline generate` writes it): the completion
    cut where `greedy_decode` stops, after max_new tokens or at its first end-of-sequence token.
    Refused in one line, before anything decodes: a prompt id without a row, a row whose prompt
    part is not that prompt, a completion that ends before max_new tokens without an
    end-of-sequence token (the decode would go on where the reference has nothing to compare)."""
    option = said("reference")
    fix = f"give the target's greedy completions of these prompts ({said('prompts')}; dflash-offline generate)"
    table = _read_table(option, path, ("id", "input_ids", "loss_mask"), fix)
    rows: dict[int, tuple[list[int], list[int]]] = {}
    for rid, toks, mask in zip(ids_as_int64(f"{option} {path}", table.column("id")).tolist(),
                               table.column("input_ids").to_pylist(),
                               table.column("loss_mask").to_pylist()):
        if rid in rows:
            raise UserError(f"{option} {path}: id {rid} occurs twice; ids must be unique")
        rows[rid] = (toks or [], mask or [])
    missing = [i for i in ids if i not in rows]
    if missing:
        raise UserError(f"{option} {path}: no row for prompt id(s) {missing[:10]} ({len(missing)} of {len(ids)}); {fix}")
    want = []
    for i, prompt in zip(ids, prompts):
        toks, mask = rows[i]
        n = next((k for k, v in enumerate(mask) if v), len(mask))
        if len(mask) != len(toks) or any(not v for v in mask[n:]):
            raise UserError(f"{option} {path}: id {i}: loss_mask is not 0 on a prompt then 1 on the completion "
                            f"({len(toks)} tokens, {len(mask)} mask entries); {fix}")
        if toks[:n] != prompt:
            k = next((k for k, (a, b) in enumerate(zip(toks[:n], prompt)) if a != b), min(n, len(prompt)))
            raise UserError(f"{option} {path}: id {i}: its prompt ({n} tokens) differs from the "
                            f"{said('prompts')} row ({len(prompt)} tokens) from token {k} on; {fix}")
        completion = toks[n:]
        stop = next((k + 1 for k, t in enumerate(completion[:max_new]) if t in eos), max_new)
        if len(completion) < stop:
            raise UserError(f"{option} {path}: id {i}: its completion ends after {len(completion)} tokens without an "
                            f"end-of-sequence token, before {said('max_new_tokens')} {max_new}; lower it or "
                            "generate the reference with at least as many new tokens")
        want.append([int(t) for t in completion[:stop]])
    return want


def warn_chat_mismatch(prompts: str, drafters) -> None:
    """A drafter trained on text rendered one way (template, thinking mode, system prompt) and
    measured on prompts rendered another: said loudly, since served that way it loses much of its
    tau (the most reported DFlash pitfall). Known only for prompts from `prepare`."""
    from dflash_offline.chat.template import differences
    from dflash_offline.rows.parts import chat_settings_of

    used = chat_settings_of([prompts]) if Path(prompts).is_dir() else None
    for path, d in drafters:
        diff = differences(d.cfg.chat, used)
        if diff:
            log.warning("--drafter %s was trained on conversations rendered another way than --prompts %s (%s): "
                        "its tau here is not the tau it was trained for; prepare the prompts with the drafter's "
                        "settings (its config.json dflash_config.chat)", path, prompts, "; ".join(diff))
