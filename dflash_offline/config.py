"""Typed configuration of each stage: every option, its default and its checks.

One source of truth per value: the dataclass field holds the default and, through `opt(...)`, its
command-line option (help, spelling, choices; cli.py builds every stage's options from these
fields), and a recipe (`stages/<deployment>/<stage>.toml`) uses the same names. Command-line
values win over the recipe, the recipe over the defaults (options.py reads and merges them).
This module holds extract's, generate's and prepare's; train's and eval's live in their packages
(train/config.py, evaluate/config.py) and plan's beside them in sizing_config.py, so a stage that
imports its config draws in no other stage's.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_offline.options import (Configured, Origins, also, check_at_least, check_choices, check_number, check_positive,
                                    opt, where)
from dflash_offline.runtime.errors import UserError
from dflash_offline.sampling import SamplingOptions

HIDDEN_DTYPE_ALIASES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}


@dataclass
class ExtractConfig(Configured):
    target: str = opt("", "Hugging Face model folder (config.json + *.safetensors).")
    # The input's columns: cache-contract.md, Input.
    data: list[str] = opt(help="Parquet file or folder of *.parquet with input_ids and loss_mask (or prompt_len), optional id; or a `generate`/`prepare` output folder. Repeat for several.", factory=list)
    cache: str = opt("", "Cache location: a path (/dev/shm/..., NVMe) or an fsspec URL.")
    devices: str = opt("cpu", "GPU indices like 0,1,2,3,4 (one worker process each), or cpu / cpu,cpu.")
    capture_layers: list[int] | None = opt(None, "Target layer ids to capture, e.g. 1,9,17,25,33.", default_text="the DFlash rule", old=("layers",))
    capture_count: int = opt(5, "How many layers the DFlash rule picks (without --capture-layers).", old=("num_layers",))
    topk: int = opt(32, "Top-k log-probabilities per token, at most the vocabulary; 0 = none (skips the LM head).")
    max_len: int = opt(4096, "Truncate samples to this many tokens.")  # a longer sample keeps its first max_len
    batch_tokens: int = opt(16384, "Token budget of one forward batch, padding included.")  # rows x longest row
    shard_tokens: int = opt(65536, "Tokens per shard, the unit of commit and resume.")
    sort_window: int = opt(8192, "Length-sort input rows within windows of this many rows.")  # keeps reads local
    chunk_tokens: int = opt(1024, "Zarr chunk length along tokens.")
    logits_chunk_tokens: int = opt(2048, "Tokens per LM-head chunk for top-k.")  # bounds the full-vocabulary logits
    # fp8 is an alias of float8_e4m3fn; its scales are float32; cache/fp8.py states the error bound.
    hidden_dtype: str = opt("bfloat16", "Storage dtype of hidden states; fp8 = float8 e4m3fn with a scale per token and layer (half the bytes).", choices=('bfloat16', 'fp8', 'float8_e4m3fn'))
    # One writer writes about 0.9 GB/s into /dev/shm; a 27B target's five layers need about 0.46 GB/s per H200.
    writers: int = opt(1, "Shard writer processes per worker.")
    compute_dtype: str = opt("auto", "Target dtype; auto = bf16 on GPU, fp32 on CPU.", choices=('auto', 'bfloat16', 'float16', 'float32'))
    # It counts committed shards a streaming trainer has not released plus shards being written; a worker
    # pauses (and says so) before a shard that would exceed it; "one shard" is the largest.
    max_bytes: int | None = opt(None, "Budget of the cache on storage (e.g. 64GB): workers pause while unreleased shards fill it; a budget below one shard is refused.", size=True)
    # Each pass's order is deterministic; multi-epoch training within a budget (train --follow --stream
    # consumes every pass once).
    passes: int = opt(1, "Produce the input N times, each pass in its own order (for train --follow --stream).")
    log_dir: str | None = opt(None, "Folder for process logs (./dflash-logs for a URL cache).", default_text="CACHE/logs")
    progress: bool = opt(True, "Progress bar on the terminal.")

    def __post_init__(self, origins: Origins | None = None) -> None:
        super().__post_init__(origins)
        # The short spellings (bf16, fp8) name the same storage: one value from here on, so
        # validate() only checks and the manifest records one name.
        self.hidden_dtype = HIDDEN_DTYPE_ALIASES.get(self.hidden_dtype, self.hidden_dtype)

    def validate(self) -> None:
        if not self.target:
            raise UserError("no target: pass --target DIR (a Hugging Face model folder) or set `target` in --config")
        if not self.data:
            raise UserError("no input: pass --data PATH (Parquet files or folders) or set `data` in --config")
        if not self.cache:
            raise UserError("no cache location: pass --cache PATH|URL or set `cache` in --config")
        check_positive(self, "max_len", "batch_tokens", "shard_tokens", "sort_window", "chunk_tokens",
                       "logits_chunk_tokens", "capture_count", "writers", "passes", "max_bytes")
        check_at_least(self, "topk", 0, "0 = store no top-k and skip the LM head")
        check_at_least(self, "max_len", 2, "a sample must hold a token and one to draft after it")
        if self.batch_tokens < self.max_len:
            raise UserError(
                f"{where(self, 'batch_tokens')} {self.batch_tokens} is smaller than {also(self, 'max_len')} "
                f"{self.max_len}: one batch must hold the longest sample; raise the first or lower the second"
            )
        check_choices(self)
        check_distinct_layers(self)


def check_distinct_layers(cfg) -> None:
    if cfg.capture_layers is not None and len(set(cfg.capture_layers)) != len(cfg.capture_layers):
        raise UserError(f"{where(cfg, 'capture_layers')} {cfg.capture_layers} lists a layer twice")


@dataclass
class GenerateConfig(SamplingOptions):
    target: str = opt("", "Hugging Face model folder: the model that writes the completions.")
    prompts: list[str] = opt(help="Parquet file or folder with input_ids (and optional id); repeat for several.", factory=list)
    out: str = opt("", "Output folder (Parquet parts + manifest.json), or a .parquet file (parts in OUT.parts/, merged at the end).")
    devices: str = opt("cpu", "GPU indices like 0,1,2,3 (one worker process each), or cpu / cpu,cpu.")
    # A row also ends after (and keeps) an EOS token. None: DEFAULT_NEW_TOKENS, or what the target's
    # context leaves after the longest prompt where that is less (resolved in generate's preflight).
    max_new_tokens: int | None = opt(None, "New tokens per prompt at most.",
                                     default_text="2048, or the target's context less the longest prompt where that is "
                                     "less; for conversations, that room shared by their replies")
    # None: the target folder's generation_config.json, or its config.json.
    eos_token_ids: list[int] | None = opt(None, "End-of-sequence ids, e.g. 0 or 151643,151645.", default_text="the target's generation_config.json")
    ignore_eos: bool = opt(False, "Always generate --max-new-tokens.", is_flag=True)
    # Sampling only because greedy copies would be equal. i x N + k keeps ids unique, as the cache contract
    # asks (N = 1: the prompt's own id), and the noise is keyed by the id.
    samples_per_prompt: int = opt(1, "Completions of each prompt (sampling only): row k of prompt id i has id i x N + k, and noise of its own.")
    batch_tokens: int = opt(262144, "Budget of one decoding batch: rows x (longest prompt + max new tokens).")  # cache positions
    # 64 on the CPU: a part of 2048 prompts would decode there for hours before its commit, and a batch
    # (at most a part) of 64 rows loses little speed.
    chunk_prompts: int | None = opt(None, "Rows per part file, the unit of commit and resume (prompts, each --samples-per-prompt times: 4 with 2 samples is 2 prompts).", default_text="2048 on GPUs, 64 on the CPU; a resumed output keeps its own")
    # float32 reproduces the target's fp32 greedy decode.
    compute_dtype: str = opt("auto", "Target dtype; auto = bf16 on GPU, fp32 on CPU.", choices=('auto', 'bfloat16', 'float16', 'float32'))
    # continuous: slots over the static decoder's buffers (generate/continuous.py); a conversation's next
    # turn is queued as its reply ends (one that outgrows the slots goes on in padded rounds); targets the
    # static decoder cannot run (sliding windows) decode padded, with a warning. padded: left-padded
    # (generate/decoding.py). In fp32 the same tokens either way (bf16: up to near-ties, as between batch sizes).
    batching: str = opt("continuous", "continuous: a row that ends takes the next prompt at once (the step a CUDA graph on GPUs); padded: batches of prompts decoded until their longest row ends.", choices=('continuous', 'padded'))
    # fused: targets/fused_step.py (about a dozen kernels a layer where the modules launch ~55); at the Qwen3.5-27B
    # shape on one H200 it took 20.0 ms a step at 32 rows against the plain step's 29.5 (docs/benchmarks.md).
    step: str = opt("fused", "Continuous batching's one-token step: fused (each layer's input projections one matrix, the parts around them compiled once on GPUs) or plain (the layers' own modules).", choices=('fused', 'plain'))
    # Static shapes: a fixed cache and filler rows. Off by default: on the H200 the eager step with the grouped
    # attention decoded the pycode target 4x faster at 2048-row batches (docs/benchmarks.md), and compiling a
    # 64-layer hybrid takes minutes.
    compile: bool = opt(False, "CUDA graphs for the one-token step (--batching padded, GPU only; measured slower at large batches).")
    turns: str = opt("all", "Conversation prompts (a `prepare` output): regenerate every assistant turn in order, each from the target's own earlier replies, or only the last.", choices=('all', 'last'))
    reasoning: str = opt("keep", "What rows keep of the target's thinking: keep (trained) or strip (the reply as history renders it, thinking removed).", choices=('keep', 'strip'))
    log_dir: str | None = opt(None, "Folder for process logs (OUT.parts/logs for a .parquet --out).", default_text="OUT/logs")
    progress: bool = opt(True, "Progress bar on the terminal.")

    def validate(self) -> None:
        check_choices(self)
        for name in ("target", "out"):
            if not getattr(self, name):
                raise UserError(f"generate: --{name} is required (or set `{name}` in --config)")
        if not self.prompts:
            raise UserError("generate: give --prompts PARQUET (files or folders with an input_ids column)")
        check_positive(self, "max_new_tokens", "batch_tokens", "chunk_prompts", "samples_per_prompt")
        self.check_sampling()
        if self.batching == "padded" and self.step != "fused":  # a setting that would be ignored: said
            raise UserError(f"{where(self, 'step')} {self.step} chooses continuous batching's step; "
                            f"{also(self, 'batching')} padded decodes with its own (--compile on GPUs): leave it "
                            "out, or use --batching continuous")
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise UserError(f"{where(self, 'samples_per_prompt')} {self.samples_per_prompt} needs sampling: greedy "
                            "completions of one prompt are all equal; give --temperature > 0, or leave the option out")
        if self.eos_token_ids is not None and any(i < 0 for i in self.eos_token_ids):
            raise UserError(f"{where(self, 'eos_token_ids')} {self.eos_token_ids}: token ids are >= 0; give the "
                            "target's end-of-sequence ids, or leave the option out to read them from the target")


@dataclass
class PrepareConfig(Configured):
    target: str = opt("", "Hugging Face model folder: its tokenizer, chat template and config.json (the weights are not read: a folder without them will do).")
    data: list[str] = opt(help="Conversation data: .jsonl/.json/.parquet files, folders, globs, or a `datasets` save_to_disk folder; repeat for several.", factory=list)
    out: str = opt("", "Output folder: OUT/train/ and OUT/eval/ (Parquet parts, each folder committed in its manifest.json).")
    format: str = opt("auto", "Record format: messages (OpenAI), sharegpt (conversations of from/value), pair (prompt + response, or Alpaca instruction/input/output), turns (user messages only), text (every token trained); auto: detected per file.", choices=('auto', 'messages', 'sharegpt', 'pair', 'turns', 'text'))
    # Counted before any record is dropped.
    max_records: int | None = opt(None, "Read only the first N records of the input (all --data in the order given); reading stops there.", default_text="all")
    chat_template: str | None = opt(None, "A Jinja chat template file to render with instead of the tokenizer's own.")
    thinking: str | None = opt(None, "enable_thinking for templates that read it (Qwen3 family).", choices=('on', 'off'), default_text="the template's default")
    system: str | None = opt(None, "A system prompt for conversations that have none.")
    # regenerate writes the conversations too (for generate --turns).
    responses: str = opt("regenerate", "regenerate: prompts for `generate` (the target writes the replies); keep: the dataset's replies become training rows for `extract`.", choices=('regenerate', 'keep'))
    train_turns: str = opt("all", "With --responses keep: train every assistant reply, or only the last of each conversation.", choices=('all', 'last'))
    eval_fraction: float = opt(0.0, "Share of conversations held out into OUT/eval/ (by a hash of the id: stable).")
    max_len: int | None = opt(None, "Drop rows (prompts, with regenerate) longer than this many tokens.", default_text="the target's context; longer is an error")
    truncate: bool = opt(False, "Cut rows longer than --max-len instead of dropping them.")
    dedup: bool = opt(True, "Drop conversations whose content (case and spacing folded) was seen before.")
    drop_unanswered: bool = opt(False, "With --responses keep: drop (and count) conversations that end with a user or tool turn instead of refusing the dataset.", is_flag=True)
    chunk_records: int = opt(4096, "Conversations per part file, the unit of commit and resume.")
    log_dir: str | None = opt(None, "Folder for the process log.", default_text="OUT/logs")
    progress: bool = opt(True, "Progress bar on the terminal.")

    def validate(self) -> None:
        for name in ("target", "out"):
            if not getattr(self, name):
                raise UserError(f"prepare: --{name} is required (or set `{name}` in --config)")
        if not self.data:
            raise UserError("prepare: give --data PATH (conversation files or folders)")
        check_choices(self)
        check_number(self, "eval_fraction", 0, 1, open_high=True, must="in [0, 1)")
        check_positive(self, "max_len", "chunk_records", "max_records")
        if self.truncate and self.max_len is None:
            raise UserError(f"{where(self, 'truncate')} cuts rows to {also(self, 'max_len')}: give that too")
        if self.responses != "keep" and self.train_turns != "all":  # a setting that would be ignored: said
            raise UserError(f"{where(self, 'train_turns')} {self.train_turns} chooses which of the dataset's replies "
                            f"are trained, with --responses keep; {also(self, 'responses')} {self.responses} writes "
                            "prompts whose replies the target writes: leave it out, or keep the replies")
