"""`dflash-offline`: the command line. Imports stay light here; each command imports its stage
only after its process log is open."""

from __future__ import annotations

import socket
import sys

import click

from dflash_offline.runtime.errors import UserError


def _given(ctx: click.Context, **values) -> dict:
    """Only the options the user typed (so a --config recipe is not overridden by defaults);
    repeatable options as lists, left out when empty."""
    out = {}
    for name, value in values.items():
        src = ctx.get_parameter_source(name)
        if src is not None and src.name not in ("DEFAULT", "DEFAULT_MAP") and value is not None:
            if isinstance(value, tuple):
                if not value:
                    continue
                value = list(value)
            out[name] = value
    return out


class ByteSize(click.ParamType):
    """A size in bytes: 123456, 64GB, 1.5T, 512MiB (k/M/G/T are powers of 1000, KiB/MiB/GiB/TiB of 1024)."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        from dflash_offline.options import parse_size

        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
      train     stage two: a DFlash drafter trains from the cache (DDP, one process per GPU),
                resumable to the step; ends with an export
      export    a checkpoint as config.json + model.safetensors (the reference DFlash layout)
    Around them:
      eval      acceptance length (tau) by speculative decoding against the target, checked
                lossless, and speed; or estimated from a held-out cache
      plan      size a run before it starts: cache bytes, whether they fit, hours per stage
      inspect   what a cache holds: manifest, shards, per-layer statistics
      status    what is done, running or failed: a cache, a run, a generate output (or a folder of them)
      verify    re-read every committed shard of a cache against its checksum
      demo      the whole job end to end on a tiny built-in target, on the CPU

    \b
    Quick start (CPU, tiny built-in recipe):
      dflash-offline demo
    """


@main.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML recipe whose keys are these options (command-line values win).")
@click.option("--target", help="Hugging Face model folder: its tokenizer, chat template and context length.")
@click.option("--data", multiple=True, help="Conversation data: .jsonl/.json/.parquet files, folders, globs, or a `datasets` save_to_disk folder; repeat for several.")
@click.option("--out", help="Output folder: OUT/train/ and OUT/eval/ (Parquet parts, each folder committed in its manifest.json).")
@click.option("--format", type=click.Choice(["auto", "messages", "sharegpt", "pair", "turns", "text"]), help="Record format: messages (OpenAI), sharegpt (conversations of from/value), pair (prompt + response, or Alpaca instruction/input/output), turns (user messages only), text (every token trained).  [default: auto, per file]")
@click.option("--chat-template", help="A Jinja chat template file to render with instead of the tokenizer's own.")
@click.option("--thinking", type=click.Choice(["on", "off"]), help="enable_thinking for templates that read it (Qwen3 family).  [default: the template's default]")
@click.option("--system", help="A system prompt for conversations that have none.")
@click.option("--responses", type=click.Choice(["regenerate", "keep"]), help="regenerate: prompts for `generate` (the target writes the replies); keep: the dataset's replies become training rows for `extract`.  [default: regenerate]")
@click.option("--train-turns", type=click.Choice(["all", "last"]), help="With --responses keep: train every assistant reply, or only the last of each conversation.  [default: all]")
@click.option("--eval-fraction", type=float, help="Share of conversations held out into OUT/eval/ (by a hash of the id: stable).  [default: 0]")
@click.option("--max-len", type=int, help="Drop rows (prompts, with regenerate) longer than this many tokens.  [default: the target's context; longer is an error]")
@click.option("--truncate/--no-truncate", default=None, help="Cut rows longer than --max-len instead of dropping them.  [default: off]")
@click.option("--dedup/--no-dedup", default=None, help="Drop conversations whose content (case and spacing folded) was seen before.  [default: on]")
@click.option("--drop-unanswered", is_flag=True, default=None, help="With --responses keep: drop (and count) conversations that end with a user turn instead of refusing the dataset.")
@click.option("--chunk-records", type=int, help="Conversations per part file, the unit of commit and resume.  [default: 4096]")
@click.option("--log-dir", help="Folder for the process log.  [default: OUT/logs]")
@click.option("--progress/--no-progress", default=None, help="Progress bar on the terminal.  [default: on]")
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
    from dflash_offline.config import PrepareConfig
    from dflash_offline.options import load_recipe, merge

    given = _given(ctx, **options)
    recipe = load_recipe(config_file, PrepareConfig) if config_file else {}
    from dflash_offline.prepare import launcher as stage

    stage.run(merge(PrepareConfig, recipe, given))


@main.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML recipe whose keys are these options (command-line values win).")
@click.option("--target", help="Hugging Face model folder (config.json + *.safetensors).")
@click.option("--data", multiple=True, help="Parquet file or folder of *.parquet with input_ids and loss_mask (or prompt_len), optional id; or a `generate`/`prepare` output folder. Repeat for several.")
@click.option("--cache", help="Cache location: a path (/dev/shm/..., NVMe) or an fsspec URL.")
@click.option("--devices", help="GPU indices like 0,1,2,3,4 (one worker process each), or cpu / cpu,cpu.  [default: cpu]")
@click.option("--layers", help="Target layer ids to capture, e.g. 1,9,17,25,33.  [default: the DFlash rule]")
@click.option("--num-layers", type=int, help="How many layers the DFlash rule picks.  [default: 5]")
@click.option("--topk", type=int, help="Top-k log-probabilities per token, at most the vocabulary; 0 = none (skips the LM head).  [default: 32]")
@click.option("--max-len", type=int, help="Truncate samples to this many tokens.  [default: 4096]")
@click.option("--batch-tokens", type=int, help="Token budget of one forward batch, padding included.  [default: 16384]")
@click.option("--shard-tokens", type=int, help="Tokens per shard, the unit of commit and resume.  [default: 65536]")
@click.option("--sort-window", type=int, help="Length-sort input rows within windows of this many rows.  [default: 8192]")
@click.option("--chunk-tokens", type=int, help="Zarr chunk length along tokens.  [default: 1024]")
@click.option("--logits-chunk-tokens", type=int, help="Tokens per LM-head chunk for top-k.  [default: 2048]")
@click.option("--writers", type=int, help="Shard writer processes per worker.  [default: 1]")
@click.option("--hidden-dtype", type=click.Choice(["bfloat16", "fp8", "float8_e4m3fn"]), help="Storage dtype of hidden states; fp8 = float8 e4m3fn with a scale per token and layer (half the bytes).  [default: bfloat16]")
@click.option("--compute-dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), help="Target dtype; auto = bf16 on GPU, fp32 on CPU.")
@click.option("--max-bytes", type=ByteSize(), help="Budget of the cache on storage (e.g. 64GB): workers pause while unreleased shards fill it; a budget below one shard is refused.")
@click.option("--passes", type=int, help="Produce the input N times, each pass in its own order (for train --follow --stream).  [default: 1]")
@click.option("--log-dir", help="Folder for process logs.  [default: CACHE/logs]")
@click.option("--progress/--no-progress", default=None, help="Progress bar on the terminal.  [default: on]")
@click.pass_context
def extract(ctx: click.Context, config_file, **options) -> None:
    """Stage one: write target hidden states into a committed, resumable Zarr cache.

    Running the same command again resumes: committed shards are kept, debris is removed. A cache
    made with another target, layer set, top-k, dtype, max length, shard plan or input is refused,
    naming the field.
    """
    from dflash_offline.config import ExtractConfig
    from dflash_offline.options import load_recipe, merge, parse_int_list

    given = _given(ctx, **options)
    if "layers" in given:
        given["layers"] = parse_int_list(given["layers"])
    recipe = load_recipe(config_file, ExtractConfig) if config_file else {}
    cfg = merge(ExtractConfig, recipe, given)
    from dflash_offline.extract import launcher as stage

    stage.run(cfg)


@main.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML recipe whose keys are these options (command-line values win).")
@click.option("--cache", help="The committed cache written by `extract`.")
@click.option("--target", help="The target's Hugging Face folder (widths, mask token, frozen embedding and LM head).")
@click.option("--out", help="Run folder: step-N/ checkpoints, metrics.jsonl, logs/, export/. Re-run to resume.")
@click.option("--devices", help="GPU indices like 5,6,7 (one DDP process each, NCCL), or cpu / cpu,cpu (gloo).  [default: cpu]")
@click.option("--num-layers", type=int, help="Drafter layers.  [default: 5]")
@click.option("--block-size", type=int, help="Draft block size.  [default: 16]")
@click.option("--gamma", type=float, help="Loss decay over slots, > 0: slot k weighs exp(-(k-1)/gamma).  [default: 7 for block 16, 5 for 10, 4 for 8]")
@click.option("--num-anchors", type=int, help="Blocks per row: the row's static capacity.  [default: 512]")
@click.option("--anchors-per-sample", type=int, help="Anchors each packed sample draws (the method's per-sequence budget), capped by --num-anchors per row; 0 = one draw per row.  [default: 512]")
@click.option("--layers", help="Target layer ids the drafter reads, a subset of the cache's, e.g. 1,3,5,6.  [default: all the cache holds]")
@click.option("--init-layers", help="Target layer ids whose weights start the drafter's layers, one per drafter layer, e.g. 0,1,2,3,4 (dense targets shaped like the drafter).  [default: random]")
@click.option("--kd-weight", type=float, help="Share of the target's top-k distribution (from the cache) in each slot's target, 0..1.  [default: 0 = data tokens]")
@click.option("--seq-len", type=int, help="Context tokens per packed row; more than --block-size (a row holds whole blocks).  [default: 4096]")
@click.option("--global-batch-tokens", type=int, help="Context tokens per optimizer step, all ranks.  [default: 131072]")
@click.option("--lr", type=float, help="Peak learning rate.  [default: 6e-4 x (4096 / hidden size)^0.8]")
@click.option("--eval-cache", help="Held-out cache: the walk estimate of decoding tau every --eval-every steps; the best drafter goes to OUT/best/.")
@click.option("--eval-every", type=int, help="Steps between held-out evaluations.  [default: --checkpoint-every]")
@click.option("--eval-samples", type=int, help="Held-out samples per evaluation.  [default: 200]")
@click.option("--profile-steps", type=int, help="Profile N optimizer steps (torch.profiler) after the first five: where a step's time goes, in OUT/profile/.  [default: 0, off]")
@click.option("--warmup-ratio", type=float, help="Warm-up share of all steps, in [0, 1).  [default: 0.04]")
@click.option("--weight-decay", type=float, help="AdamW weight decay, >= 0 (a negative one grows the weights).  [default: 0]")
@click.option("--epochs", type=int, help="Epochs.  [default: 6]")
@click.option("--clip", type=float, help="Gradient-norm clip, > 0 (0 makes no update, a negative one reverses it; inf = no clipping).  [default: 1.0]")
@click.option("--seed", type=int, help="Seed of sample order, anchors and initial weights, >= 0.  [default: 0]")
@click.option("--mask-token-id", type=int, help="Mask token id.  [default: the tokenizer's mask token]")
@click.option("--max-steps", type=int, help="Stop after this many steps (schedule still spans all epochs).")
@click.option("--checkpoint-every", type=int, help="Steps between checkpoints.  [default: 500]")
@click.option("--keep-checkpoints", type=int, help="Checkpoints kept.  [default: 3]")
@click.option("--log-every", type=int, help="Steps between log lines.  [default: 10]")
@click.option("--loader-workers", type=int, help="Background loader processes per rank; 0 = read in the training process.  [default: 2]")
@click.option("--prefetch", type=int, help="Rows each loader process reads ahead, >= 1.  [default: 4]")
@click.option("--attention", type=click.Choice(["auto", "sdpa"]), help="auto = compiled flex on GPU, SDPA + dense mask on CPU; sdpa = the dense baseline on GPU too.")
@click.option("--loss-chunk-tokens", type=int, help="Block tokens per LM-head chunk in the loss.  [default: 2^28 / vocabulary, at least 4096]")
@click.option("--compile-layers/--no-compile-layers", default=None, help="Compile the drafter layer for training (fuses its elementwise work).  [default: on GPU]")
@click.option("--loss-impl", type=click.Choice(["fused", "recompute"]), help="fused: the head's input gradient is made in the loss forward; recompute: checkpointed chunks.  [default: fused]")
@click.option("--precision", type=click.Choice(["auto", "bf16", "fp32"]), help="auto = bf16 autocast on GPU, fp32 on CPU.")
@click.option("--verify", type=click.Choice(["quick", "full"]), help="quick: shards exist and open; full: also checksums.  [default: quick]")
@click.option("--follow/--no-follow", default=None, help="Train while extract fills the cache: take shards as they are committed, wait when all are consumed (needs --epochs 1).")
@click.option("--stream/--no-stream", default=None, help="With --follow: delete each shard once a checkpoint is past its last use.")
@click.option("--follow-window", type=int, help="Shards shuffled and packed together with --follow.  [default: 4]")
@click.option("--progress/--no-progress", default=None, help="Progress bar.  [default: on]")
@click.pass_context
def train(ctx: click.Context, config_file, **options) -> None:
    """Stage two: train a DFlash drafter from a committed cache (resumes from OUT's last checkpoint)."""
    from dflash_offline.config import TrainConfig
    from dflash_offline.options import load_recipe, merge, parse_int_list

    given = _given(ctx, **options)
    for name in ("layers", "init_layers"):
        if name in given:
            given[name] = parse_int_list(given[name], option="--" + name.replace("_", "-"))
    recipe = load_recipe(config_file, TrainConfig) if config_file else {}
    cfg = merge(TrainConfig, recipe, given)
    from dflash_offline.train import launcher as stage

    stage.run(cfg)


@main.command()
@click.option("--run", "run_dir", required=True, help="A training run folder (OUT of `train`).")
@click.option("--step", type=int, help="Checkpoint step to export.  [default: the latest]")
@click.option("--to", "dest", help="Export folder.  [default: RUN/export]")
def export(run_dir: str, step: int | None, dest: str | None) -> None:
    """Write a checkpoint's drafter as config.json + model.safetensors in the reference DFlash layout.

    Checked here: the export loads into the reference implementation (PyPI dflash==0.1.0,
    dflash.model.DFlashDraftModel) and decodes as `eval` does; its config.json holds the keys
    vLLM's and SGLang's DFlash loaders read, but no serving engine was run (docs/serving.md)."""
    from dflash_offline import export as export_mod

    path = export_mod.export_checkpoint(run_dir, step, dest)
    click.echo(f"exported {path}")


@main.command(name="eval")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML whose keys are these options (command-line values win).")
@click.option("--target", help="The target's Hugging Face folder.")
@click.option("--drafter", "drafters", multiple=True,
              help="A drafter export folder or a step-N checkpoint; repeat to compare several.")
@click.option("--prompts", help="Parquet with input_ids: speculative decoding against the target, checked lossless.")
@click.option("--cache", help="A (held-out) cache: acceptance estimated from it, without running the target.")
@click.option("--device", help="One GPU index (e.g. 0) or cpu.  [default: cpu]")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Target and drafter dtype for decoding (float32: the lossless check is exact).  [default: float32]")
@click.option("--max-new-tokens", type=int, help="New tokens per prompt.  [default: 256]")
@click.option("--max-prompts", type=int, help="Use only the first N prompts.")
@click.option("--ignore-eos", is_flag=True, default=None, help="Always generate --max-new-tokens (do not stop at end-of-sequence).")
@click.option("--baseline/--no-baseline", default=None,
              help="Also decode with the target alone: the lossless reference and the speed baseline.  [default: on, off with --reference]")
@click.option("--reference", help="Parquet of the target's greedy completions of --prompts (id, input_ids, loss_mask; "
              "e.g. `generate --out X.parquet`): check the outputs against it instead of decoding with the target alone.")
@click.option("--seq-len", type=int, help="Cache estimate, random anchors: tokens per packed row.  [default: 2048]")
@click.option("--num-anchors", type=int, help="Cache estimate, random anchors: blocks per row.  [default: 256]")
@click.option("--max-rows", type=int, help="Cache estimate, random anchors: use at most this many rows.")
@click.option("--max-samples", type=int, help="Cache walk (decoding's blocks): use only the first N samples.  [default: all]")
@click.option("--walk-batch-rows", type=int, help="Cache walk: rows of up to 512 anchors per drafter forward.  [default: 4]")
@click.option("--parity", type=int, help="With --cache: on its first N samples compare the every-anchor estimate, the walk and real decoding; name the likely cause of a disagreement (exit 1).")
@click.option("--batch-size", type=int, help="Prompts decoded together: 1 = one at a time; N > 1 = N per target forward (static buffers; transformers: KV caches, hybrid targets' recurrent states rolled back per row, sliding-window targets' sequences re-run each round); the target-alone baseline is batched the same way. All exact.  [default: 64 on a GPU, 1 on CPU]")
@click.option("--show", type=int, help="After decoding, print the first N prompts and each drafter's outputs as text (the target's tokenizer.json), each verify round's accepted drafts in green on a terminal (NO_COLOR: off), else between {{ and }}; the token the target adds each round unmarked.  [default: 0 = off]")
@click.option("--temperature", type=float, help="0 = greedy (outputs checked equal to the target's); above 0, speculative sampling: output distributed as the target's own sampling.  [default: 0]")
@click.option("--top-p", type=float, help="Sampling: nucleus mass kept, in (0, 1].  [default: 1.0]")
@click.option("--top-k", type=int, help="Sampling: keep the k most likely tokens; 0 = all.  [default: 0]")
@click.option("--seed", type=int, help="Sampling: the noise of each prompt depends only on (seed, prompt id, output index).  [default: 0]")
@click.option("--decoder", type=click.Choice(["auto", "static", "transformers"]), help="static: the target's layers over preallocated buffers, CUDA graphs on a GPU (dense attention targets); transformers: transformers' forward and caches (any target); auto: static where possible (the report says which ran).  [default: auto]")
@click.option("--implied-for", help="Also print the speed-up this tau implies on a named target shape measured by benchmarks/decode_speed.py --ceiling (e.g. qwen3.6-27b).")
@click.option("--json", "json_path", help="Write the full report here as JSON.")
@click.option("--log-dir", help="Folder for the process log.  [default: RUN/logs for a drafter in a training run folder, else ./dflash-logs]")
@click.option("--progress/--no-progress", default=None, help="Progress bars.  [default: on]")
@click.pass_context
def eval_(ctx: click.Context, config_file, **options) -> None:
    """Acceptance length of drafters: speculative decoding against the target (tau, acceptance per
    slot, tokens/s vs the target alone, output checked equal to its greedy decode), and/or the
    estimate from a held-out cache."""
    from dflash_offline.config import EvalConfig
    from dflash_offline.options import load_recipe, merge

    given = _given(ctx, **options)
    recipe = load_recipe(config_file, EvalConfig) if config_file else {}
    from dflash_offline.evaluate import run as evaluate

    report = evaluate.run(merge(EvalConfig, recipe, given))
    # A check that failed (outputs not equal to the target's, estimates that disagree) fails the
    # command, after the report and its JSON: scripts and CI read the exit status.
    if any(d.get("lossless") is False or not d.get("parity", {}).get("agree", True) for d in report["drafters"]):
        ctx.exit(1)


@main.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML whose keys are these options; an extract recipe works too (its other keys are ignored; command-line values win).")
@click.option("--target", help="Hugging Face model folder (config.json + *.safetensors).")
@click.option("--data", multiple=True, help="Parquet file or folder of *.parquet; repeat for several.")
@click.option("--cache", help="Where the cache would go: its free space is the budget.")
@click.option("--max-bytes", type=ByteSize(), help="A budget for the cache (e.g. 64GB).")
@click.option("--layers", help="Target layer ids to capture.  [default: the DFlash rule]")
@click.option("--num-layers", type=int, help="How many layers the DFlash rule picks.  [default: extract's]")
@click.option("--topk", type=int, help="Top-k log-probabilities per token.  [default: extract's]")
@click.option("--max-len", type=int, help="Truncation length.  [default: extract's]")
@click.option("--extract-gpus", type=int, help="GPUs extracting, >= 1 (they divide the estimated hours).  [default: 5]")
@click.option("--train-gpus", type=int, help="GPUs training, >= 1 (they divide the estimated hours).  [default: 3]")
@click.option("--epochs", type=int, help="Training epochs.  [default: train's]")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.pass_context
def plan(ctx: click.Context, config_file, as_json: bool, **options) -> None:
    """Size a run before it starts: cache bytes per storage mode (bf16, fp8), whether they fit the
    budget, and estimated hours per stage. Reads config, headers and input rows; loads no weights.

    `--config stages/<deployment>/extract.toml` sizes what that recipe would extract."""
    import json as _json

    from dflash_offline.config import ExtractConfig, PlanConfig
    from dflash_offline.options import load_recipe, merge, parse_int_list
    from dflash_offline.sizing import make_plan, report

    given = _given(ctx, **options)
    if "layers" in given:
        given["layers"] = parse_int_list(given["layers"])
    # Extract's recipe names the same target, data, layers and cache; its other keys mean nothing here.
    recipe = load_recipe(config_file, PlanConfig, ignore=ExtractConfig) if config_file else {}
    p = make_plan(merge(PlanConfig, recipe, given))
    if as_json:
        click.echo(_json.dumps(p, indent=1))
    else:
        for line in report(p):
            click.echo(line)


@main.command()
@click.argument("cache")
def verify(cache: str) -> None:
    """Check every committed shard of CACHE against its checksum (reads the whole cache)."""
    from dflash_offline.inspect import verify_cache

    code = verify_cache(cache)
    if code:  # damaged shards: the exit status says so (after the report)
        sys.exit(code)


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
    from dflash_offline.inspect import inspect_command

    inspect_command(cache, sample_id, stats, max_tokens, as_text, tokenizer, color)


@main.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(path: str, as_json: bool) -> None:
    """What is done, running or failed, for a cache (extraction), a run folder (training) or a
    generate output; for a folder holding some of them (the demo's --out), for each of them."""
    from dflash_offline.status import show

    click.echo(show(path, as_json))


@main.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML recipe whose keys are these options (command-line values win).")
@click.option("--target", help="Hugging Face model folder: the model that writes the completions.")
@click.option("--prompts", multiple=True, help="Parquet file or folder with input_ids (and optional id); repeat for several.")
@click.option("--out", help="Output folder (Parquet parts + manifest.json), or a .parquet file (parts in OUT.parts/, merged at the end).")
@click.option("--devices", help="GPU indices like 0,1,2,3 (one worker process each), or cpu / cpu,cpu.  [default: cpu]")
@click.option("--max-new-tokens", type=int, help="New tokens per prompt at most.  [default: 2048]")
@click.option("--temperature", type=float, help="0 = greedy; above 0 (finite), sampling.  [default: 0]")
@click.option("--top-p", type=float, help="Sampling: nucleus mass kept, in (0, 1].  [default: 1.0]")
@click.option("--seed", type=int, help="Sampling: the noise of each prompt depends only on (seed, prompt id, step).  [default: 0]")
@click.option("--eos-token-ids", help="End-of-sequence ids, e.g. 0 or 151643,151645.  [default: the target's generation_config.json]")
@click.option("--ignore-eos", is_flag=True, default=None, help="Always generate --max-new-tokens.")
@click.option("--batch-tokens", type=int, help="Budget of one decoding batch: rows x (longest prompt + max new tokens).  [default: 262144]")
@click.option("--chunk-prompts", type=int, help="Prompts per part file, the unit of commit and resume.  [default: 2048]")
@click.option("--compute-dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), help="Target dtype; auto = bf16 on GPU, fp32 on CPU.")
@click.option("--compile/--no-compile", default=None, help="CUDA graphs for the one-token step (GPU only; measured slower at large batches).  [default: off]")
@click.option("--turns", type=click.Choice(["all", "last"]), help="Conversation prompts (a `prepare` output): regenerate every assistant turn in order, each from the target's own earlier replies, or only the last.  [default: all]")
@click.option("--reasoning", type=click.Choice(["keep", "strip"]), help="What rows keep of the target's thinking: keep (trained) or strip (the reply as history renders it, thinking removed).  [default: keep]")
@click.option("--log-dir", help="Folder for process logs.  [default: OUT/logs]")
@click.option("--progress/--no-progress", default=None, help="Progress bar on the terminal.  [default: on]")
@click.pass_context
def generate(ctx: click.Context, config_file, **options) -> None:
    """The target's own completions of prompts, ready for `extract --data OUT`.

    Rows follow the input contract: id (the prompt's), input_ids = prompt + completion, loss_mask
    0 on the prompt and 1 on the completion. Parts are committed in OUT/manifest.json; running the
    same command again resumes, and a different target or setting is refused, naming the field.
    """
    from dflash_offline.config import GenerateConfig
    from dflash_offline.options import load_recipe, merge, parse_int_list

    given = _given(ctx, **options)
    if "eos_token_ids" in given:
        given["eos_token_ids"] = parse_int_list(given["eos_token_ids"], option="--eos-token-ids")
    recipe = load_recipe(config_file, GenerateConfig) if config_file else {}
    from dflash_offline.generate import launcher as stage

    stage.run(merge(GenerateConfig, recipe, given))


@main.command()
@click.option("--out", default="runs/demo", show_default=True, help="Folder for the tiny target, data and cache.")
@click.option("--devices", default="cpu", show_default=True, help="Devices for the extract stage.")
@click.pass_context
def demo(ctx: click.Context, out: str, devices: str) -> None:
    """Run the main job end to end on an embedded default: a tiny target and data made on the fly."""
    from dflash_offline import demo as demo_mod

    report = demo_mod.run(out, devices)
    if not all(d.get("lossless", True) for d in report["drafters"]):  # as eval: a failed check fails the command
        ctx.exit(1)


def entry() -> None:
    from dflash_offline.runtime.logs import current_log, finish_heartbeat, record_failure
    from dflash_offline.runtime.signals import Stopped

    code = None
    try:
        # Outside standalone mode click returns ctx.exit()'s code instead of exiting with it.
        code = main(standalone_mode=False)
        finish_heartbeat("done")
    except UserError as e:
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
        # and the fix in one line; the traceback is in the process log.
        record_failure(e)
        log_path = current_log()
        click.echo(f"error: {e.filename if e.filename else e}: permission denied; give this user access to it, or "
                   "choose another path" + (f" (traceback in {log_path})" if log_path else ""), err=True)
        sys.exit(2)
    except Exception as e:
        # One line on the terminal; the traceback and the phase are in the process log.
        record_failure(e)
        what = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        log_path = current_log()
        click.echo(f"failed: {what}" + (f" (traceback in {log_path})" if log_path and
                                        not isinstance(e, RuntimeError) else ""), err=True)
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
