"""`dflash-offline`: the command line. Imports stay light here, and so do the stages' modules a
command imports (no torch, no transformers: tests/test_layout.py checks): each stage opens its
process log, faulthandler armed, before its heavy imports."""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
from pathlib import Path

import click

# The configs are plain dataclasses (no torch): light enough to build the options from.
from dflash_offline.config import ExtractConfig, GenerateConfig, PrepareConfig
from dflash_offline.evaluate.config import EvalConfig
from dflash_offline.sizing_config import PlanConfig
from dflash_offline.train.config import TrainConfig
from dflash_offline.options import (as_flag, cli_fields, flag_of, load_recipe, merge, parse_int_list, parse_size,
                                    under_current_names, where, warn_renamed)
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.logs import (claim_heartbeat, current_log, finish_heartbeat, in_early_log, keep_early_log,
                                        record_failure)
from dflash_offline.runtime.signals import Stopped
from dflash_offline.cli_help import PipelineGroup, SectionedCommand, section_of


def _given(ctx: click.Context, **values) -> dict:
    """Only the options the user typed (so a --config recipe is not overridden by defaults), also
    where the value typed means None (`--capture-layers auto`: the rule, over a recipe's list); repeatable
    options as lists, left out when empty."""
    out = {}
    for name, value in values.items():
        src = ctx.get_parameter_source(name)
        if src is not None and src.name not in ("DEFAULT", "DEFAULT_MAP"):
            if isinstance(value, tuple):
                if not value:
                    continue
                value = list(value)
            out[name] = value
    return out


def _config(ctx: click.Context, cls: type, config_file: str | None, options: dict, ignore: type | None = None):
    """A stage command's config: the field defaults < its --config recipe < the options typed (read
    before the stage's heavy imports, so a bad recipe is one line at once)."""
    recipe = load_recipe(config_file, cls, ignore=ignore) if config_file else {}
    return merge(cls, recipe, _renamed_given(cls, _given(ctx, **options)))


_WAS = "was__"  # the parameter name of a renamed option's earlier spelling: was__<earlier field name>


def _renamed_given(cls: type, given: dict) -> dict:
    """The typed options with values given under an earlier name moved to the field's name (with a
    one-line warning); both names at once is an error."""
    flags = {f.name: flag_of(f) for f in dataclasses.fields(cls)}
    return under_current_names(cls, {k.removeprefix(_WAS): v for k, v in given.items()},
                               lambda name: flags.get(name) or as_flag(name))


class ByteSize(click.ParamType):
    """A size in bytes: 123456, 64GB, 1.5T, 512MiB (k/M/G/T are powers of 1000, KiB/MiB/GiB/TiB of 1024)."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class IntList(click.ParamType):
    """Comma-separated integers (1,9,17), refused in one line naming the option otherwise."""

    name = "IDS"

    def __init__(self, flag: str):
        self.flag = flag

    def convert(self, value, param, ctx):
        return parse_int_list(value, option=self.flag)


def default_text(f) -> str | None:
    """What an option's help says its default is: the field's `default_text` (a rule in words), else
    the field's default written out (on/off for switches); None: no default worth stating."""
    meta = f.metadata
    if meta.get("default_text") is not None:
        return meta["default_text"]
    v = f.default  # MISSING for a field with a default factory (a list: nothing to state)
    if meta.get("is_flag") or v is None or v is dataclasses.MISSING or isinstance(v, (list, tuple)) or v == "":
        return None
    if isinstance(v, bool):
        return "on" if v else "off"
    return f"{v:g}" if isinstance(v, float) else str(v)


def option_of(f, was: str | None = None) -> click.Option:
    """The click option of a config field (options.opt): its spelling, type, choices, help and
    default text all come from the field. Its click default is None, so that `_given` tells what
    the user typed from what a recipe or the field's default supplies. `was`: one of the field's
    earlier names, as a hidden option of the same type (`_renamed_given` reads it)."""
    meta, kind = f.metadata, str(f.type)
    flag = flag_of(f) if was is None else "--" + was.replace("_", "-")
    kw: dict = {"default": None, "hidden": was is not None}
    decls = [flag, f.name if was is None else _WAS + was]
    if kind.startswith("bool"):
        if meta.get("is_flag"):
            kw["is_flag"] = True
        else:
            decls[0] = f"{flag}/--no-{flag[2:]}"
    elif "list[str]" in kind:
        kw["multiple"] = True
        kw.pop("default")
    elif "list[int]" in kind:
        kw["type"] = IntList(flag)
    elif meta.get("size"):
        kw["type"] = ByteSize()
    elif meta.get("choices"):
        kw["type"] = click.Choice(list(meta["choices"]))
    elif kind.startswith("int"):
        kw["type"] = int
    elif kind.startswith("float"):
        kw["type"] = float
    text = default_text(f)
    kw["help"] = meta["help"] + (f"  [default: {text}]" if text is not None else "")
    return click.Option(decls, **kw)


_CONFIG_HELP = "TOML recipe whose keys are these options (command-line values win)."
_PLAN_CONFIG_HELP = ("TOML whose keys are these options; an extract recipe works too (its other keys are ignored; "
                     "command-line values win).")


def config_options(cls: type, config_help: str = _CONFIG_HELP):
    """A stage command's options: --config, then one per option field of its config dataclass,
    in field order, each in the help section of the component that declares it (the command is
    made with cls=SectionedCommand). Adding an option is adding an `opt(...)` field."""
    def decorate(fn):
        params = [click.Option(["--config", "config_file"], type=click.Path(dir_okay=False), help=config_help)]
        params += [option_of(f) for f in cli_fields(cls)]
        params += [option_of(f, was) for f in cli_fields(cls) for was in f.metadata.get("old", ())]
        for p, f in zip(params[1:], cli_fields(cls)):
            p.section = section_of(cls, f)
        params[0].section = "Recipe"
        fn.__click_params__ = getattr(fn, "__click_params__", []) + params[::-1]  # click reads them reversed
        return fn
    return decorate


@click.group(cls=PipelineGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="dflash-offline")
def main() -> None:
    """Train DFlash speculative-decoding drafters from an offline hidden-state cache.

    \b
    The pipeline, in order:
      prepare   chat datasets (JSONL, Parquet, HF datasets) -> tokenized prompts for `generate`,
                or training rows for `extract`, rendered with the target's chat template
      generate  the target completes the prompts: rows in the input contract (resumable)
      extract   stage one: the frozen target writes chosen layers' hidden states and top-k
                log-probabilities into a committed, resumable Zarr cache, one process per device
      train     stage two: a DFlash or DSpark drafter trains from the cache (DDP, one process
                per GPU), resumable to the step; ends with an export
      export    a checkpoint as config.json + model.safetensors (the reference DFlash layout;
                DSpark: DeepSpec's)
    Around them:
      eval      acceptance length (tau) by speculative decoding against the target, checked
                lossless, and speed; or estimated from a held-out cache
      plan      size a run before it starts: cache bytes, whether they fit, hours per stage
      inspect   what a cache holds: manifest, shards, per-layer statistics
      status    what is done, running or failed: a cache, a run, a generate or prepare output (or a folder of them)
      verify    re-read every committed shard of a cache against its checksum; --content: a
                sample of it against a fresh forward of the target
      demo      the whole job end to end on a tiny built-in target, on the CPU

    \b
    Quick start (CPU, tiny built-in recipe):
      dflash-offline demo
    """


@main.command(cls=SectionedCommand)
@config_options(PrepareConfig)
@click.pass_context
def prepare(ctx: click.Context, config_file, **options) -> None:
    """Chat data in: render conversations with the target's chat template into prompts for
    `generate` (default) or, with --responses keep, training rows whose loss mask is 1 exactly on
    what the assistant writes (its reply and end-of-turn token).

    Reads OpenAI `messages`, ShareGPT `conversations`, prompt/response pairs, Alpaca records and
    plain `text`. Counts what it keeps and drops (and why), deduplicates, splits train/eval, and
    records the chat settings (template hash, thinking mode, system prompt) that travel with the
    data to the cache and the export. Running the same command again resumes.
    """
    cfg = _config(ctx, PrepareConfig, config_file, options)
    if cfg.data:  # a mistyped path in a moment, before the stage's imports (transformers, torch: seconds)
        from dflash_offline.chat.formats import resolve_inputs  # start-up: before the stage, as light as it is

        resolve_inputs(list(cfg.data), where(cfg, "data"))
    from dflash_offline.prepare import launcher as stage  # start-up: a command imports its own stage only

    stage.run(cfg)


@main.command(cls=SectionedCommand)
@config_options(ExtractConfig)
@click.pass_context
def extract(ctx: click.Context, config_file, **options) -> None:
    """Stage one: write target hidden states into a committed, resumable Zarr cache.

    Running the same command again resumes: committed shards are kept, debris is removed. A cache
    made with another target, layer set, top-k, dtype, max length, shard plan or input is refused,
    naming the field.
    """
    cfg = _config(ctx, ExtractConfig, config_file, options)
    from dflash_offline.extract import launcher as stage  # start-up: a command imports its own stage only

    stage.run(cfg)


@main.command(cls=SectionedCommand)
@config_options(TrainConfig)
@click.pass_context
def train(ctx: click.Context, config_file, **options) -> None:
    """Stage two: train a DFlash or DSpark drafter from a committed cache (resumes from OUT's last
    checkpoint). Options by section; each is also a key of the --config recipe."""
    cfg = _config(ctx, TrainConfig, config_file, options)
    from dflash_offline.train import launcher as stage  # start-up: a command imports its own stage only

    stage.run(cfg)


@main.command()
@click.option("--run", "run_dir", required=True, help="A training run folder (OUT of `train`).")
@click.option("--step", type=int, help="Checkpoint step to export.  [default: the latest]")
@click.option("--to", "dest", help="Export folder.  [default: RUN/export]")
@click.option("--target-tables", is_flag=True, help="DSpark: also write the target's embedding and LM head (DeepSpec's "
              "evaluator loads them from the checkpoint; vLLM, SGLang and llama.cpp lend the target's, and llama.cpp "
              "would draft with the copied input table as the LM head of an untied target).")
@click.option("--target", "target_dir", help="With --target-tables: the target the run trained against, where it is "
              "now (checked against the run's record of its weights).  [default: the run's --target]")
def export(run_dir: str, step: int | None, dest: str | None, target_tables: bool, target_dir: str | None) -> None:
    """Write a checkpoint's drafter as config.json + model.safetensors in the reference DFlash layout.

    Checked here: the export loads into the reference implementation (PyPI dflash==0.1.0,
    dflash.model.DFlashDraftModel) and decodes as `eval` does; a DSpark export is in DeepSpec's layout,
    and llama.cpp's own converter turns both kinds into the GGUF its runtime drafts with. Its
    config.json holds the keys vLLM's and SGLang's loaders read (their source, at the versions
    docs/serving.md names); a line warns when an engine cannot serve what was trained."""
    from dflash_offline import export as export_mod  # start-up: a command imports its own stage only

    earlier = dest is not None and (Path(dest) / "config.json").is_file()  # an earlier export, replaced (said)
    path = export_mod.export_checkpoint(run_dir, step, dest, target_dir, target_tables)
    click.echo(f"exported {path}" + (" (it replaced the export that was there)" if earlier else ""))


@main.command(name="eval", cls=SectionedCommand)
@config_options(EvalConfig)
@click.pass_context
def eval_(ctx: click.Context, config_file, **options) -> None:
    """Acceptance length of drafters: speculative decoding against the target (tau, acceptance per
    slot, tokens/s vs the target alone, output checked equal to its greedy decode), and/or the
    estimate from a held-out cache."""
    cfg = _config(ctx, EvalConfig, config_file, options)
    from dflash_offline.evaluate import run as evaluate  # start-up: a command imports its own stage only

    report = evaluate.run(cfg)
    # A check that failed (outputs not equal to the target's, estimates that disagree) fails the
    # command, after the report and its JSON: scripts and CI read the exit status.
    if report.failed():
        ctx.exit(1)


@main.command(cls=SectionedCommand)
@config_options(PlanConfig, config_help=_PLAN_CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.pass_context
def plan(ctx: click.Context, config_file, as_json: bool, **options) -> None:
    """Size a run before it starts: cache bytes per storage mode (bf16, fp8), whether they fit the
    budget, and estimated hours per stage. Reads config, headers and input rows; loads no weights.

    `--config stages/<deployment>/extract.toml` sizes what that recipe would extract."""
    from dflash_offline.sizing import make_plan, report  # start-up: a command imports its own stage only

    # Extract's recipe names the same target, data, layers and cache; its other keys mean nothing here.
    p = make_plan(_config(ctx, PlanConfig, config_file, options, ignore=ExtractConfig))
    if as_json:
        click.echo(json.dumps(p, indent=1))
    else:
        for line in report(p):
            click.echo(line)


@main.command()
@click.argument("cache")
@click.option("--content", "amount", metavar="N|P%", help="Instead of the checksums: N samples (or P% of them) drawn "
              "across the cache against a fresh forward of --target, per layer and for the top-k, within the storage "
              "dtype's bound; also the target's config and weights against those the cache was made with.")
@click.option("--target", "target", help="With --content: the target the cache was made from.")
@click.option("--devices", "device", default="cpu", show_default=True, help="With --content: where the target runs "
              "(one GPU index, e.g. 0, or cpu).")
@click.option("--device", "device_was", hidden=True, help="The earlier name of --devices.")
def verify(cache: str, amount: str | None, target: str | None, device: str, device_was: str | None) -> None:
    """Check every committed shard of CACHE against its checksum (reads the whole cache); with
    --content N --target T, check what a sample of it holds against the target instead."""
    if device_was is not None:  # one name for the device option in every command; the old one still works
        warn_renamed("--device", "--devices")
        device = device_was
    if amount is None:
        if target is not None:
            raise UserError(f"--target {target}: read only with --content N (the checksums need no target); add "
                            "--content 1% or leave --target out")
        from dflash_offline.inspect import verify_cache  # start-up: a command imports its own stage only

        code = verify_cache(cache)
        if code:  # damaged shards: the exit status says so (after the report)
            sys.exit(code)
        return
    if target is None:
        raise UserError(f"--content {amount}: compares the cache with a fresh forward of its target: give it with "
                        "--target")
    from dflash_offline.content import check_content, parse_amount, report_lines

    parse_amount(amount)  # one line before the cache is opened or the target loaded
    report = check_content(cache, target, amount, device)
    lines, fails = report_lines(report, cache, target, device)
    for line in lines:
        click.echo(line, err=line.startswith("warning:"))
    for line in fails:
        click.echo(line, err=True)
    if fails:
        sys.exit(1)


@main.command()
@click.argument("cache")
@click.option("--sample", "sample_id", type=int, help="Also show one sample: tokens, loss mask, norms per layer.")
@click.option("--stats/--no-stats", default=True, show_default=True, help="Per-layer statistics (reads a bounded sample).")
@click.option("--max-tokens", default=16384, show_default=True, type=click.IntRange(min=1),
              help="Tokens read for the statistics, >= 1 (--no-stats skips them).")
@click.option("--text", "as_text", is_flag=True, help="With --sample: print that sample as text instead of the summary, decoded with the target's tokenizer.json (special tokens shown); its trained spans (loss_mask 1) in green on a terminal, else between [[ and ]].")
@click.option("--tokenizer", help="With --text: the model folder (or tokenizer.json) to decode with.  [default: the target folder the cache's manifest names]")
@click.option("--color/--no-color", default=None, help="With --text: mark trained spans in colour (ANSI) or with [[ ]].  [default: colour on a terminal unless NO_COLOR is set]")
def inspect(cache: str, sample_id: int | None, stats: bool, max_tokens: int, as_text: bool, tokenizer: str | None,
            color: bool | None) -> None:
    """Summary of a cache: manifest, shards, per-layer statistics and outlier channels (no torch);
    for a folder holding caches (the demo's --out), of each of them."""
    from dflash_offline.inspect import inspect_command  # start-up: a command imports its own stage only

    inspect_command(cache, sample_id, stats, max_tokens, as_text, tokenizer, color)


@main.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(path: str, as_json: bool) -> None:
    """What is done, running or failed, for a cache (extraction), a run folder (training), a
    generate output or a prepare output; for a folder holding some of them (the demo's --out), for
    each of them."""
    from dflash_offline.status import show  # start-up: a command imports its own stage only

    click.echo(show(path, as_json))


@main.command(cls=SectionedCommand)
@config_options(GenerateConfig)
@click.pass_context
def generate(ctx: click.Context, config_file, **options) -> None:
    """The target's own completions of prompts, ready for `extract --data OUT`.

    Rows follow the input contract: id (the prompt's), input_ids = prompt + completion, loss_mask
    0 on the prompt and 1 on the completion. Parts are committed in OUT/manifest.json; running the
    same command again resumes, and a different target or setting is refused, naming the field.
    """
    cfg = _config(ctx, GenerateConfig, config_file, options)
    from dflash_offline.generate import launcher as stage  # start-up: a command imports its own stage only

    stage.run(cfg)


@main.command()
@click.option("--out", default=None, help="Folder for the tiny target, data and cache.  [default: runs/demo; "
              "with --chat, runs/chat]")
@click.option("--devices", default="cpu", show_default=True, help="Devices for the extract stage.")
@click.option("--chat", is_flag=True, help="Only make a tiny chat target and its conversations in OUT (about a "
              "minute on a CPU) for the chat walk-through of docs/own-data.md, and print its commands.")
@click.pass_context
def demo(ctx: click.Context, out: str | None, devices: str, chat: bool) -> None:
    """Run the main job end to end on an embedded default: a tiny target and data made on the fly."""
    out = out or ("runs/chat" if chat else "runs/demo")
    if chat:
        from dflash_offline import tiny_chat  # start-up: a command imports its own stage only

        tiny_chat.demo(out)
        return
    from dflash_offline import demo as demo_mod  # start-up: a command imports its own stage only

    report = demo_mod.run(out, devices)
    if report.failed():  # as eval: a failed check fails the command
        ctx.exit(1)


def entry() -> None:
    code = None
    try:
        # Outside standalone mode click returns ctx.exit()'s code instead of exiting with it.
        code = main(standalone_mode=False)
        claim_heartbeat()  # a command that succeeded keeps its log, wherever it returned from
        finish_heartbeat("done")
    except UserError as e:
        # A refusal before the command held its output leaves nothing there: its early log is
        # deleted at exit (runtime/early_log.py).
        record_failure(e)
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except Stopped as e:
        # SIGTERM/SIGINT: the work in progress was finished and committed; the message says how to resume.
        finish_heartbeat("stopped", str(e))
        click.echo(str(e), err=True)
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        # click turns Ctrl-C into Abort.
        finish_heartbeat("interrupted", "interrupted (Ctrl-C or SIGINT)")
        click.echo("interrupted: committed work is kept; run the same command again to resume", err=True)
        sys.exit(130)
    except getattr(click.exceptions, "NoArgsIsHelpError", ()) as e:  # no command given: the help, as help
        click.echo(e.format_message(), err=True)
        sys.exit(e.exit_code)
    except click.UsageError as e:
        # One line, as every other refusal: the option and what is wrong with it, where the help is.
        where = e.ctx.command_path if e.ctx is not None else "dflash-offline"
        click.echo(f"error: {e.format_message().rstrip('.')} (see {where} --help)", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except (socket.gaierror, ConnectionRefusedError) as e:
        # A storage URL (--cache ftp://..., s3://...) or a rendezvous address that cannot be reached.
        record_failure(e)
        click.echo(f"error: a network address cannot be resolved or reached ({type(e).__name__}: {e}); check the "
                   "URL given (--cache, --data) or MASTER_ADDR, and the network", err=True)
        sys.exit(2)
    except PermissionError as e:
        # A file or folder this user may not read or write (a model folder, a manifest): the path
        # and the fix in one line; the traceback is in the process log once the run has started
        # (before that, a user's mistake in a path, refused as any other: nothing is left behind).
        record_failure(e)
        log_path = None if in_early_log() else current_log()
        click.echo(f"error: {e.filename if e.filename else e}: permission denied; give this user access to it, or "
                   "choose another path" + (f" (traceback in {log_path})" if log_path else ""), err=True)
        sys.exit(2)
    except Exception as e:
        # One line on the terminal; the traceback and the phase are in the process log.
        record_failure(e)
        what = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        # A crash before the preflight passed: its log is still the early one, which only this
        # line names (a RuntimeError's own line names the log of a run that started).
        early = keep_early_log()
        log_path = early or current_log()
        click.echo(f"failed: {what}" + (f" (traceback in {log_path})" if log_path and
                                        (early or not isinstance(e, RuntimeError)) else ""), err=True)
        sys.exit(1)
    except SystemExit:  # a command's own exit status (verify's 1): not a failure to record
        raise
    except BaseException as e:
        record_failure(e)
        raise
    # A check the command ran failed (eval: outputs not lossless, --parity disagreement): its
    # report is written and its heartbeat says done; the exit status says the check failed.
    if isinstance(code, int) and code != 0:
        sys.exit(code)
