"""`dflash-offline prepare`: conversation datasets -> prompts for `generate` or rows for `extract`.

Shape of a run (one process, CPU): log file -> the target folder (tokenizer, chat template,
context) -> every record read and checked (a malformed one stops the run here, before anything is
written) -> selection (select.py: drops, duplicates, ids, the train/eval split) -> every chunk
rendered and tokenized (rows.py; a row longer than the context stops the run here too) -> only
then the manifests and the parts, one part committed at a time (prepare/output.py).

OUT/train/ and OUT/eval/ are part folders of the same kind as a `generate` output: `generate
--prompts OUT/train`, `extract --data OUT/train` and `eval --prompts OUT/eval` read them. Running
the same command again resumes after the last committed part; other settings or inputs are refused.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from functools import partial
from pathlib import Path

from dflash_offline.cache.location import Location
from dflash_offline.chat.formats import cut_off_files
from dflash_offline.chat.records import read_records
from dflash_offline.chat.template import ChatTemplate, load_chat_tokenizer, turn_stop
from dflash_offline.options import where
from dflash_offline.config import PrepareConfig
from dflash_offline.prepare import output, select
from dflash_offline.prepare.output import dropped_text
from dflash_offline.rows.parts import MANIFEST, read_manifest
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.faults import fault_point
from dflash_offline.runtime.early_log import open_command_log
from dflash_offline.runtime.logs import claim_heartbeat, heartbeat
from dflash_offline.runtime.paths import refuse_foreign_folder
from dflash_offline.runtime.signals import Stopped, install_stop_handlers, signal_name, stop_requested
from dflash_offline.targets.folder import eos_ids, read_target

log = logging.getLogger("dflash.prepare")

SPLITS = ("train", "eval")


def _check_out(out: Path, option: str = "--out") -> None:
    if out.is_file():
        raise UserError(f"{option} {out}: is a file; give a folder")
    ours = any((out / s / MANIFEST).is_file() and read_manifest(out / s) is not None for s in SPLITS)
    if not ours:
        refuse_foreign_folder(out, option, "a prepare output", "train/manifest.json", {"logs", ".run.lock", *SPLITS})


def _limits(cfg: PrepareConfig, info):
    from dflash_offline.prepare.rows import Limits

    if cfg.max_len is not None:
        return Limits(cfg.max_len, cfg.truncate, True, f"{where(cfg, 'max_len')} {cfg.max_len}")
    ctx = info.max_positions or 1 << 62
    return Limits(ctx, False, False, f"the target's context ({ctx} positions, max_position_embeddings)")


def run(cfg: PrepareConfig) -> dict:
    """The `prepare` command. Returns {split: manifest}."""
    cfg.validate()
    out = Path(cfg.out)
    _check_out(out, where(cfg, "out"))
    open_command_log(cfg.log_dir, cfg.log_dir or str(out / "logs"), "prepare", cfg.out,
                     (where(cfg, "log_dir"), where(cfg, "out")))
    install_stop_handlers()
    t0 = time.time()
    heartbeat(phase="preflight")
    # Only the tokenizer, the chat template and config.json are read: a folder without weights will do.
    info = read_target(cfg.target, where(cfg, "target"), weights=False)
    tokenizer = _tokenizer(cfg, info)
    heartbeat(phase="read")
    records = list(read_records(cfg.data, cfg.format, where(cfg, "data"), limit=cfg.max_records))
    if not records:
        raise UserError(f"{where(cfg, 'data')} {' '.join(cfg.data)}: no records")
    chat = any(r.messages is not None for r in records)
    # What generate stops at (the template adds the tokenizer's own eos to it for the masks).
    eos = sorted(eos_ids(cfg.target)) if chat else []
    tmpl = ChatTemplate.load(cfg.target, cfg.chat_template, cfg.thinking, cfg.system,
                             end_ids=eos, tokenizer=tokenizer,
                             said=partial(where, cfg)) if chat else None
    sel = select.select(records, cfg.responses, cfg.eval_fraction, cfg.dedup, cfg.drop_unanswered)

    sel.cut_off = cut_off_files()
    log.info("read %d records from %d input(s); %d train, %d eval after selection; dropped %s", sel.read,
             len(cfg.data), len(sel.splits["train"]), len(sel.splits["eval"]), dict(sel.dropped) or "none")
    limits = _limits(cfg, info)
    heartbeat(phase="render")
    chunks = {s: [sel.splits[s][a:a + cfg.chunk_records] for a in range(0, len(sel.splits[s]), cfg.chunk_records)]
              for s in SPLITS}
    wanted = _wanted(cfg, info, sel, chunks, tmpl)
    stores = {s: output.PreparedStore(out / s) for s in SPLITS}
    for s in SPLITS:  # another run's output is refused before the rendering, not after it
        stores[s].check(wanted[s])
    committed = {s: stores[s].committed_names() for s in SPLITS}
    tables = _render(cfg, sel, chunks, committed, tmpl, limits, tokenizer)
    made = sum(t.table.num_rows for s in SPLITS for t in tables[s] if t is not None)
    if made == 0 and not any(committed.values()):
        dropped = sel.dropped + sum((t.dropped for s in SPLITS for t in tables[s] if t is not None), Counter())
        raise UserError(f"{where(cfg, 'data')}: no row is left after filtering ({sel.read} records read; dropped: "
                        f"{output.dropped_text(dropped)}); "
                        + ("the chat template refused them: fix it or give another with --chat-template"
                           if any(str(why).startswith("template refused") for why in dropped) else
                           "check --format, --max-len and --responses"))
    unknown = _unknown_tokens(cfg, tables, tokenizer)
    if unknown:
        log.warning(unknown)
    if cfg.max_len is not None and info.max_positions is not None and cfg.max_len > info.max_positions:
        # Asked for, so said rather than refused (after the refusals: a warning never precedes an error line).
        log.warning("%s %d exceeds the target's context (%d positions, max_position_embeddings): rows past it are "
                    "kept, and generate and extract refuse or cut them; give at most %d to drop them here",
                    where(cfg, "max_len"), cfg.max_len, info.max_positions, info.max_positions)
    if tmpl is not None and cfg.responses == "regenerate":  # said now, not after generate decodes to the limit
        warning = turn_stop(tmpl, eos, None, "generate's --max-new-tokens").warning
        if warning:
            log.warning(warning)
    if stop_requested():
        raise Stopped(stop_requested(), f"stopped on {signal_name(stop_requested())} before writing; nothing changed; "
                      "run the same command again")

    run_lock = Location(str(out)).try_run_lock()  # held until this process exits
    if run_lock is None:
        raise UserError(f"{where(cfg, 'out')} {cfg.out}: another prepare is writing this output (it holds {out / '.run.lock'}); "
                        "wait for it or stop it, then run again")
    claim_heartbeat()
    heartbeat(phase="write")
    manifests = _write(cfg, sel, chunks, tables, stores, wanted)
    fresh = any(t is not None for sp in SPLITS for t in tables[sp])
    _report(manifests, sel, out, time.time() - t0, cfg, info, fresh)
    return manifests


def _tokenizer(cfg: PrepareConfig, info):
    """The target's tokenizer (its chat template's), refused if it names ids past the model's vocabulary."""
    tokenizer = load_chat_tokenizer(cfg.target, where(cfg, "target"))
    # Lengths are prepare's to judge (--max-len, the target's context), after tokenizing: transformers'
    # "longer than the specified maximum sequence length" warning would name rows dropped anyway.
    tokenizer.model_max_length = int(1e30)  # transformers' own "no limit" value (VERY_LARGE_INTEGER)
    top = max(tokenizer.get_vocab().values(), default=-1)  # its largest id: added tokens may leave gaps
    if top >= info.vocab_size:  # ids past the embedding: another model's tokenizer
        raise UserError(f"{where(cfg, 'target')} {cfg.target}: its tokenizer has token ids up to {top} "
                        f"({tokenizer.convert_ids_to_tokens(top)!r}) but the model's vocabulary is {info.vocab_size}; "
                        "the folder mixes a tokenizer and a model that do not belong together")
    return tokenizer


def _wanted(cfg: PrepareConfig, info, sel, chunks: dict, tmpl) -> dict:
    """Each split's manifest as this run would write it (compared with an earlier run's first)."""
    settings = {"responses": cfg.responses, "train_turns": cfg.train_turns, "format": cfg.format,
                "eval_fraction": cfg.eval_fraction, "max_len": cfg.max_len, "truncate": cfg.truncate,
                "dedup": cfg.dedup, "drop_unanswered": cfg.drop_unanswered, "max_records": cfg.max_records}
    source = output.source_entry(cfg.data)
    return {s: output.new_manifest(
        kind="completions" if cfg.responses == "keep" else "prompts", target=info.manifest_entry(),
        chat=dict(tmpl.settings.manifest_entry(), template=tmpl.template) if tmpl else None, settings=settings,
        source=source,
        plan={"split": s, "chunk_records": cfg.chunk_records, "num_parts": len(chunks[s]),
              "conversations": len(sel.splits[s])},
        counts={"records_read": sel.read, "dropped": dict(sel.dropped), "cut_off_files": sel.cut_off})
        for s in SPLITS}


def _unknown_tokens(cfg: PrepareConfig, tables: dict, tokenizer) -> str | None:
    """Text this tokenizer cannot read comes out as its unknown token: refused when that is half the
    tokens or more (another model's tokenizer, or the wrong --target), a warning line from 1%."""
    import pyarrow.compute as pc

    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return None
    flat = [pc.list_flatten(t.table.column("input_ids")) for s in SPLITS for t in tables[s] if t is not None]
    total = sum(len(f) for f in flat)
    count = sum(int(pc.sum(pc.equal(f, unk)).as_py() or 0) for f in flat)
    if not total or count < total / 100:
        return None
    what = (f"{count} of the {total} tokens rendered ({100 * count / total:.0f}%) are the tokenizer's unknown token "
            f"{tokenizer.convert_ids_to_tokens(unk)!r} (id {unk})")
    if count * 2 >= total:
        raise UserError(f"{where(cfg, 'data')}: {what}: {where(cfg, 'target')} {cfg.target}'s tokenizer cannot read this "
                        "text; give the model the data is for as --target")
    return f"{what}: text this tokenizer cannot read"


def _render(cfg: PrepareConfig, sel, chunks: dict, committed: dict, tmpl, limits, tokenizer) -> dict[str, list]:
    """Each split's chunks rendered into rows (None for a part committed by an earlier run: not
    rendered again), with the bar counting the records read."""
    from tqdm import tqdm

    from dflash_offline.prepare import rows

    tables: dict[str, list] = {s: [] for s in SPLITS}
    # Counts the records read: those the selection dropped are done, the others as their chunk is rendered.
    bar = tqdm(total=sel.read, initial=sel.read - sum(len(sel.splits[s]) for s in SPLITS), unit="record",
               desc="prepare", disable=not cfg.progress, dynamic_ncols=True)
    try:
        for s in SPLITS:
            for j, chunk in enumerate(chunks[s]):
                if output.part_name(j) in committed[s]:
                    tables[s].append(None)  # committed earlier: not rendered again
                elif cfg.responses == "keep":
                    tables[s].append(rows.keep_rows(chunk, tmpl, cfg.train_turns, limits, tokenizer))
                else:
                    tables[s].append(rows.prompt_rows(chunk, tmpl, limits))
                bar.update(len(chunk))
                heartbeat(phase="render", split=s, part=j)
                fault_point("prepare-render")
    finally:
        bar.close()
    return tables


def _write(cfg: PrepareConfig, sel, chunks: dict, tables: dict, stores: dict, wanted: dict) -> dict:
    """Write and commit the rendered parts, split by split (a stop request ends it between parts,
    committed ones kept); -> {split: its manifest}."""
    manifests = {}
    for s in SPLITS:
        if not chunks[s]:
            continue
        stores[s].init_or_check(wanted[s])
        for j, made_rows in enumerate(tables[s]):
            if made_rows is None:
                continue
            if stop_requested():
                raise Stopped(stop_requested(), f"stopped on {signal_name(stop_requested())}: committed parts are "
                              "kept; run the same command again to resume")
            stores[s].write_and_commit(output.part_name(j), made_rows, sel.splits[s][j * cfg.chunk_records:]
                                       [:cfg.chunk_records])
            fault_point("prepare-part-committed")
        manifests[s] = stores[s].read()
    return manifests


def _report(manifests: dict, sel, out: Path, seconds: float, cfg: PrepareConfig, info, fresh: bool) -> None:
    dropped = Counter(sel.dropped)
    for m in manifests.values():
        for p in m["parts"]:
            dropped.update(p.get("dropped", {}))
    lines = [(f"prepared {out} in {seconds:.1f} s" if fresh else f"already complete: {out}; nothing to do")
             + f": {sel.read} records read"
             + (f" (the first {cfg.max_records}: {where(cfg, 'max_records')})" if sel.read == cfg.max_records else "")
             + (f" ({', '.join(f'{f} cut off after {n} records' for f, n in sel.cut_off)})" if sel.cut_off else "")]
    for s in SPLITS:
        if s not in manifests:
            if s == "train" or sel.splits["eval"]:
                lines.append(f"  {s}: 0 conversations" + (" (all went to eval: lower --eval-fraction)"
                                                            if s == "train" else ""))
            continue
        m = manifests[s]
        t = m["totals"]
        what = "training rows" if m["kind"] == "completions" else "prompts"
        lines.append(f"  {s}: {t['conversations']} conversations -> {t['rows']} {what}, {t['tokens']:,} tokens"
                     + (f" ({t['trained_tokens']:,} trained, {t['truncated']} rows truncated)"
                        if m["kind"] == "completions" else "") + f"  ({out / s})")
    lines.append(f"  dropped: {dropped_text(dropped)}")
    # The next command, for the train split (an eval-only output has none to suggest).
    if "train" in manifests and any(m["kind"] == "prompts" for m in manifests.values()):
        # No --max-new-tokens: generate's default fits the context and shares it among a conversation's turns.
        lines.append(f"  next: dflash-offline generate --target {cfg.target} --prompts {out / 'train'} --out "
                     f"{out}-generated")
    elif "train" in manifests:
        lines.append(f"  next: dflash-offline extract --target {cfg.target} --data {out / 'train'} --cache CACHE")
    for line in lines:
        log.info(line)
        print(line, flush=True)
