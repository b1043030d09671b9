"""Typed configuration of each stage: every option, its default and its checks.

One source of truth per value: the dataclass field holds the default, the CLI option names the
same field, and a recipe (`stages/<deployment>/<stage>.toml`) uses the same names. Command-line
values win over the recipe, the recipe over the defaults (options.py reads and merges them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_offline.options import check_at_least, check_number, check_positive
from dflash_offline.runtime.errors import UserError
from dflash_offline.evaluate.config import EvalConfig  # noqa: F401  (one import place for every stage's config)

HIDDEN_DTYPES = ("bfloat16", "float8_e4m3fn")
HIDDEN_DTYPE_ALIASES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}


@dataclass
class ExtractConfig:
    target: str = ""
    """Local Hugging Face model folder (config.json + *.safetensors)."""
    data: list[str] = field(default_factory=list)
    """Parquet files or folders of *.parquet (cache-contract.md, Input)."""
    cache: str = ""
    """Cache location: a local path or an fsspec URL."""
    devices: str = "cpu"
    """`0,1,2,3,4` for one worker per GPU, `cpu` or `cpu,cpu` for CPU workers."""
    layers: list[int] | None = None
    """Target decoder layer ids to capture; None = the DFlash rule with `num_layers` layers."""
    num_layers: int = 5
    """How many layers the DFlash rule picks when `layers` is not given."""
    topk: int = 32
    """Top-k log-probabilities stored per token; 0 stores none and skips the LM head."""
    max_len: int = 4096
    """Samples longer than this are truncated to their first max_len tokens."""
    batch_tokens: int = 16384
    """Token budget of one forward batch, padding included (rows x longest row)."""
    shard_tokens: int = 65536
    """Tokens per shard (a shard is the unit of commit and of resume)."""
    sort_window: int = 8192
    """Rows are length-sorted within windows of this many input rows (keeps reads local)."""
    chunk_tokens: int = 1024
    """Zarr chunk length along the token axis."""
    logits_chunk_tokens: int = 2048
    """Tokens per LM-head chunk when computing top-k (bounds the full-vocabulary logits)."""
    hidden_dtype: str = "bfloat16"
    """Storage dtype of hidden states: bfloat16, or float8_e4m3fn (alias fp8: 8-bit values with a
    float32 scale per token and layer, 0.50x the bytes; cache/fp8.py states the error bound)."""
    writers: int = 1
    """Shard writer processes per extract worker (one writes about 0.9 GB/s into /dev/shm; a 27B
    target's five layers need about 0.46 GB/s per H200)."""
    compute_dtype: str = "auto"
    """Target weights/activations: auto = bfloat16 on GPU, float32 on CPU."""
    max_bytes: int | None = None
    """Budget of the cache on storage: committed shards not yet released by a streaming trainer
    plus shards being written. A worker pauses before a shard that would exceed it (and says so)
    until a consumer releases shards; a budget smaller than the largest shard is refused."""
    passes: int = 1
    """Produce the input this many times, each pass in its own deterministic order (multi-epoch
    training within a budget: `train --follow --stream` consumes every pass once)."""
    log_dir: str | None = None
    """Where process logs go; default CACHE/logs (a local folder `dflash-logs` for URL caches)."""
    progress: bool = True
    """Show a progress bar on the terminal."""

    def validate(self) -> None:
        if not self.target:
            raise UserError("no target: pass --target DIR (a Hugging Face model folder) or set `target` in --config")
        if not self.data:
            raise UserError("no input: pass --data PATH (Parquet files or folders) or set `data` in --config")
        if not self.cache:
            raise UserError("no cache location: pass --cache PATH|URL or set `cache` in --config")
        check_positive(self, "max_len", "batch_tokens", "shard_tokens", "sort_window", "chunk_tokens",
                       "logits_chunk_tokens", "num_layers", "writers", "passes", "max_bytes")
        check_at_least(self, "topk", 0, "0 = store no top-k and skip the LM head")
        if self.batch_tokens < self.max_len:
            raise UserError(
                f"--batch-tokens {self.batch_tokens} is smaller than --max-len {self.max_len}: "
                "one batch must hold the longest sample; raise --batch-tokens or lower --max-len"
            )
        self.hidden_dtype = HIDDEN_DTYPE_ALIASES.get(self.hidden_dtype, self.hidden_dtype)
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise UserError(f"--hidden-dtype {self.hidden_dtype!r} is not supported; choose one of {HIDDEN_DTYPES}")
        if self.compute_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise UserError(f"--compute-dtype {self.compute_dtype!r}: choose auto, bfloat16, float16 or float32")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise UserError(f"--layers {self.layers} lists a layer twice")


@dataclass
class TrainConfig:
    cache: str = ""
    """The committed cache written by `extract` (path or fsspec URL)."""
    target: str = ""
    """The target's Hugging Face folder: widths, tokenizer mask token, frozen embedding and LM head."""
    out: str = ""
    """Run folder: checkpoints step-N/, metrics.jsonl, TensorBoard events, logs/, export/."""
    devices: str = "cpu"
    """`5,6,7` for one DDP process per GPU (NCCL), `cpu` or `cpu,cpu` (gloo)."""
    num_layers: int = 5
    """Drafter decoder layers."""
    block_size: int = 16
    gamma: float | None = None
    """Loss decay over block slots; None = the method's value for the block size (16: 7, 10: 5, 8: 4)."""
    num_anchors: int = 512
    """Draft blocks per row: the row's static capacity (unused ones are masked)."""
    anchors_per_sample: int = 512
    """Anchors each sample (sequence) of a row draws, as the method defines the budget; a row's
    draws beyond `num_anchors` are subsampled uniformly. 0: one uniform draw of `num_anchors` over
    the whole row, however many samples it packs."""
    layers: list[int] | None = None
    """Target layer ids the drafter reads, a subset of those the cache holds (in the cache's order);
    None = all of them. One extraction of a superset serves a whole layer ablation."""
    init_layers: list[int] | None = None
    """Target layer ids whose weights start the drafter's layers (one per drafter layer), for targets
    whose decoder layers are shaped like the drafter's (dense Qwen3-like); None = random (the method)."""
    kd_weight: float = 0.0
    """Share of the target's top-k distribution in each slot's training target (the cache's
    top-k log-probabilities, renormalised); 0 = the data token alone (hard labels)."""
    seq_len: int = 4096
    """Context tokens per row; samples are packed into rows of exactly this length."""
    global_batch_tokens: int = 131072
    """Context tokens per optimizer step over all ranks (accumulation fills it)."""
    lr: float | None = None
    """Peak learning rate; None = `auto_lr(hidden size)`: 6e-4 (the published recipe, tuned on
    4096-wide drafters) x (4096 / hidden size) ** 0.8, e.g. 4.0e-3 for a 384-wide drafter."""
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    epochs: int = 6
    clip: float = 1.0
    seed: int = 0
    mask_token_id: int | None = None
    """Default: the tokenizer's mask token in the target folder."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (the schedule still spans all epochs)."""
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    log_every: int = 10
    loader_workers: int = 2
    """Background loader processes per rank (0 = read in the training process)."""
    prefetch: int = 4
    """Rows each loader process reads ahead."""
    loss_chunk_tokens: int | None = None
    """Block tokens per LM-head chunk in the loss; None = auto_loss_chunk(vocabulary): chunks of about
    2^28 logits (1 GB in fp32), at least 4096 tokens."""
    loss_impl: str = "fused"
    """fused: the frozen head's input gradient is made in the loss forward (two head matmuls per
    token); recompute: checkpointed chunks whose logits the backward recomputes (three)."""
    precision: str = "auto"
    """auto = bf16 autocast with fp32 master weights on GPU, fp32 on CPU."""
    compile_layers: bool | None = None
    """Compile the drafter's decoder layer for training (Inductor fuses its elementwise work with
    the flex kernels); None = on GPU, off on CPU."""
    attention: str = "auto"
    """auto = compiled flex_attention with a BlockMask on GPU, SDPA with a dense mask on CPU (no flex
    backward there); sdpa forces the dense path on GPU too (a baseline: O(Q x KV) mask memory)."""
    final_checkpoint: bool = True
    """Write a checkpoint and the export when the run ends (benchmarks turn it off)."""
    verify: str = "quick"
    """quick: every shard listed exists and opens; full: also every checksum (reads the whole cache)."""
    follow: bool = False
    """Train while `extract` fills the cache: start on what is committed, take shards as they are
    committed (in plan order, `follow_window` at a time), wait visibly when all are consumed, end
    when the plan's last shard is consumed. Every committed shard is consumed once (epochs = 1;
    `extract --passes N` makes N epochs)."""
    stream: bool = False
    """With follow: delete each shard once a checkpoint is past its last use (the manifest records
    it first), so a budgeted extraction (`--max-bytes`) can go on."""
    follow_window: int = 4
    """Shards per window with follow: samples are shuffled and packed within a window (the budget
    must hold a window's shards)."""
    eval_cache: str | None = None
    """A held-out cache (the target's own completions): every `eval_every` steps rank 0 measures the
    walk estimate of decoding tau on it and keeps the best drafter in OUT/best/."""
    eval_every: int | None = None
    """Steps between held-out evaluations; default: at every checkpoint."""
    eval_samples: int = 200
    """Held-out samples the walk estimate reads (the first ones of the cache)."""
    profile_steps: int = 0
    """Profile this many optimizer steps (torch.profiler), five steps after the run's first: a trace
    and a table of where a step's time goes in OUT/profile/. 0 = off."""
    progress: bool = True

    def resolved_loss_chunk(self, vocab_size: int) -> int:
        return self.loss_chunk_tokens or auto_loss_chunk(vocab_size)

    def validate(self) -> None:
        for name in ("cache", "target", "out"):
            if not getattr(self, name):
                raise UserError(f"train: --{name} is required (or set `{name}` in --config)")
        check_positive(self, "num_layers", "block_size", "num_anchors", "seq_len", "global_batch_tokens", "epochs",
                       "checkpoint_every", "keep_checkpoints", "log_every", "loss_chunk_tokens", "follow_window",
                       "prefetch", "max_steps", "eval_every", "eval_samples")
        if self.block_size < 2:
            raise UserError("--block-size must be at least 2 (slot 0 is the anchor, slots 1.. are drafted)")
        if self.seq_len <= self.block_size:
            raise UserError(f"--seq-len must exceed --block-size ({self.block_size}), got {self.seq_len}: a row must "
                            "hold an anchor and its drafted tokens; raise --seq-len or lower --block-size")
        # A row's capacity beyond its positions is masked padding; beyond the default as well, a typo
        # that would allocate (anchors x block) tables of that size.
        if self.num_anchors > max(self.seq_len, TrainConfig.num_anchors):
            raise UserError(f"--num-anchors {self.num_anchors} exceeds --seq-len {self.seq_len}: each anchor is a "
                            "distinct position of a row; lower --num-anchors")
        check_at_least(self, "anchors_per_sample", 0, "0 = one draw per row")
        check_at_least(self, "profile_steps", 0, "0 = off")
        check_at_least(self, "loader_workers", 0, "0 = read in the training process")
        check_at_least(self, "seed", 0, "it seeds numpy's generators, which take no negative seed")
        check_at_least(self, "mask_token_id", 0, "a token id of the target's vocabulary")
        check_number(self, "gamma", 0, open_low=True, must="positive",
                     why="slot k weighs exp(-(k-1)/gamma): 0 divides by zero, a negative value weighs the far slots most")
        check_number(self, "lr", 0, open_low=True, open_high=True, must="positive and finite")
        check_number(self, "clip", 0, open_low=True, must="positive (inf = no clipping)",
                     why="the largest gradient norm a step applies: 0 makes no update, a negative one reverses it")
        check_number(self, "warmup_ratio", 0, 1, open_high=True, must="in [0, 1)",
                     why="the share of all steps the learning rate warms up over")
        check_number(self, "weight_decay", 0, open_high=True, must=">= 0 and finite",
                     why="AdamW shrinks each weight by lr x weight decay per step; a negative one grows them")
        check_number(self, "kd_weight", 0, 1, must="in [0, 1]", why="the top-k distribution's share of the target")
        if self.verify not in ("quick", "full"):
            raise UserError(f"--verify {self.verify!r}: choose quick or full")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise UserError(f"--precision {self.precision!r}: choose auto, bf16 or fp32")
        if self.eval_every is not None and not self.eval_cache:
            raise UserError("--eval-every sets how often --eval-cache is measured; give --eval-cache CACHE (a held-out "
                            "cache of the target's own completions) or leave --eval-every out")
        if self.stream and not self.follow:
            raise UserError("--stream needs --follow (it releases shards of a cache that extraction is still filling)")
        if self.follow and self.epochs != 1:
            raise UserError(f"--follow consumes every committed shard once, so --epochs must be 1 (got {self.epochs}); "
                            "for several epochs extract with --passes N")
        if self.loss_impl not in ("fused", "recompute"):
            raise UserError(f"--loss-impl {self.loss_impl!r}: choose fused or recompute")
        if self.attention not in ("auto", "sdpa"):
            raise UserError(f"--attention {self.attention!r}: choose auto (flex on GPU) or sdpa (dense mask)")
        if self.layers is not None and (not self.layers or len(set(self.layers)) != len(self.layers)):
            raise UserError(f"--layers {self.layers}: give distinct layer ids the cache holds")

    def resolved_lr(self, hidden_size: int) -> float:
        return self.lr if self.lr is not None else auto_lr(hidden_size)

    @property
    def resolved_gamma(self) -> float:
        if self.gamma is not None:
            return float(self.gamma)
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, 7.0 * self.block_size / 16)


def auto_lr(hidden_size: int) -> float:
    """The published lr (6e-4, tuned on 4096-wide drafters) scaled by (4096 / width) ** 0.8: Adam
    moves every weight by about lr per step, and a narrower layer needs larger moves to change its
    output as much (muP's 1/width is the exponent 1). Measured on the 384-wide pycode drafter, the
    held-out tau rose with lr through 6e-4, 2e-3 and 4e-3 (docs/benchmarks.md, "Drafter quality");
    the exponent puts 384 at 4.0e-3, the best rate measured, and 5120 at 5.0e-4."""
    return 6e-4 * (4096 / hidden_size) ** 0.8


def auto_loss_chunk(vocab_size: int) -> int:
    """Block tokens per loss chunk: about 2^28 logits a chunk (1 GB in fp32) and at least 4096, so
    a large vocabulary keeps the bounded memory (248K: 4096 tokens) while a small one stops paying
    a launch-bound Python loop (8192: 32768 tokens, the loss 60-82 -> 28 ms a step on the pycode
    drafter, docs/benchmarks.md)."""
    return max(4096, (1 << 28) // max(1, vocab_size))


_E, _T = ExtractConfig(), TrainConfig()  # the stages' defaults: one source of truth for plan's


@dataclass
class PlanConfig:
    """`plan`: what extract would write (its target, data, layers, top-k, max length) and what
    training would read; the GPU counts only divide the estimated hours."""
    target: str = ""
    data: list[str] | None = None
    cache: str | None = None
    max_bytes: int | None = None
    layers: list[int] | None = None
    num_layers: int = _E.num_layers
    topk: int = _E.topk
    max_len: int = _E.max_len
    extract_gpus: int = 5
    train_gpus: int = 3
    epochs: int = _T.epochs
    drafter_layers: int = _T.num_layers
    seq_len: int = _T.seq_len
    num_anchors: int = _T.num_anchors
    block_size: int = _T.block_size

    def validate(self) -> None:
        if not self.target or not self.data:
            raise UserError("plan: --target and --data are required")
        check_positive(self, "max_bytes", "num_layers", "max_len", "extract_gpus", "train_gpus", "epochs",
                       "drafter_layers", "seq_len", "num_anchors", "block_size")
        check_at_least(self, "topk", 0, "0 = store no top-k")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise UserError(f"--layers {self.layers} lists a layer twice")


@dataclass
class GenerateConfig:
    target: str = ""
    """The target's Hugging Face folder: it writes the completions."""
    prompts: list[str] = field(default_factory=list)
    """Parquet files or folders with `input_ids` (the prompt tokens) and an optional `id`."""
    out: str = ""
    """Output: a folder of Parquet parts with a manifest, or a .parquet file (parts beside it in
    OUT.parts/, merged into the file at the end)."""
    devices: str = "cpu"
    """`0,1,2,3` for one worker process per GPU, `cpu` or `cpu,cpu` for CPU workers."""
    max_new_tokens: int = 2048
    """New tokens per prompt at most (a row also ends after an end-of-sequence token, kept)."""
    temperature: float = 0.0
    """0 = greedy (argmax); above 0, sampling at this temperature."""
    top_p: float = 1.0
    """Sampling: keep the smallest set of tokens whose probability reaches top_p."""
    seed: int = 0
    """Sampling: the noise for prompt id i and new token t depends only on (seed, i, t)."""
    eos_token_ids: list[int] | None = None
    """End-of-sequence ids; None = the target folder's generation_config.json / config.json."""
    ignore_eos: bool = False
    """Always generate max_new_tokens (no end-of-sequence stop)."""
    batch_tokens: int = 262144
    """Budget of one decoding batch: rows x (longest prompt + max_new_tokens) cache positions."""
    chunk_prompts: int = 2048
    """Prompts per part file (the unit of commit and of resume)."""
    compute_dtype: str = "auto"
    """auto = bfloat16 on GPU, float32 on CPU; float32 reproduces the target's fp32 greedy decode."""
    compile: bool = False
    """Compile the one-token decode step with CUDA graphs (static shapes: a fixed cache and filler
    rows). Off by default: on the H200 the eager step with the grouped attention decoded the pycode
    target 4x faster at 2048-row batches (docs/benchmarks.md), and compiling a 64-layer hybrid takes
    minutes."""
    turns: str = "all"
    """Conversation prompts (a `prepare` output): `all` regenerates every assistant turn in order,
    each from the conversation with the target's own earlier replies; `last` only the final one."""
    reasoning: str = "keep"
    """What rows keep of the target's <think> block: `keep` trains it; `strip` drops it (history's form)."""
    log_dir: str | None = None
    """Where process logs go; default OUT/logs (OUT.parts/logs for a .parquet output)."""
    progress: bool = True

    def validate(self) -> None:
        if self.turns not in ("all", "last"):
            raise UserError(f"--turns {self.turns!r}: choose all or last")
        if self.reasoning not in ("keep", "strip"):
            raise UserError(f"--reasoning {self.reasoning!r}: choose keep or strip")
        for name in ("target", "out"):
            if not getattr(self, name):
                raise UserError(f"generate: --{name} is required (or set `{name}` in --config)")
        if not self.prompts:
            raise UserError("generate: give --prompts PARQUET (files or folders with an input_ids column)")
        check_positive(self, "max_new_tokens", "batch_tokens", "chunk_prompts")
        check_number(self, "temperature", 0, open_high=True, must=">= 0 and finite", why="0 = greedy")
        check_number(self, "top_p", 0, 1, open_low=True, must="in (0, 1]",
                     why="the probability mass of the tokens sampling keeps")
        if self.top_p < 1 and self.temperature == 0:
            raise UserError(f"--top-p {self.top_p} applies to sampling, but --temperature is 0 (greedy); give "
                            "--temperature > 0 to sample, or leave --top-p out")
        if self.eos_token_ids is not None and any(i < 0 for i in self.eos_token_ids):
            raise UserError(f"--eos-token-ids {self.eos_token_ids}: token ids are >= 0")
        if self.compute_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise UserError(f"--compute-dtype {self.compute_dtype!r}: choose auto, bfloat16, float16 or float32")


@dataclass
class PrepareConfig:
    target: str = ""
    """The target's Hugging Face folder: its tokenizer, chat template, context length."""
    data: list[str] = field(default_factory=list)
    """Conversation files (.jsonl, .json, .parquet), folders, globs, `datasets` save_to_disk folders."""
    out: str = ""
    """Output folder: OUT/train/ and OUT/eval/, Parquet parts each committed in its manifest.json."""
    format: str = "auto"
    """auto (detected per file), messages, sharegpt, pair, turns or text."""
    chat_template: str | None = None
    """A Jinja chat template file to use instead of the tokenizer's own."""
    thinking: str | None = None
    """on / off: passed to templates that read `enable_thinking`; None = the template's default."""
    system: str | None = None
    """A system prompt added to conversations that have none."""
    responses: str = "regenerate"
    """regenerate: prompts (and conversations) for `generate`; keep: the dataset's replies as rows for `extract`."""
    train_turns: str = "all"
    """keep: train every assistant reply (`all`) or only each conversation's last (`last`)."""
    eval_fraction: float = 0.0
    """Share of conversations put into OUT/eval/ (chosen by a hash of the id: stable across runs)."""
    max_len: int | None = None
    """Rows (keep) or prompts (regenerate) longer than this are dropped (or cut: --truncate); None = the
    target's context, where a longer row is an error."""
    truncate: bool = False
    """Cut rows longer than --max-len to it instead of dropping them."""
    dedup: bool = True
    """Drop conversations whose normalised content (case and whitespace folded) was seen before."""
    drop_unanswered: bool = False
    """keep: drop (and count) conversations that end with a user or tool turn, instead of refusing them."""
    chunk_records: int = 4096
    """Conversations per part file (the unit of commit and of resume)."""
    log_dir: str | None = None
    """Where the process log goes; default OUT/logs."""
    progress: bool = True

    def validate(self) -> None:
        for name in ("target", "out"):
            if not getattr(self, name):
                raise UserError(f"prepare: --{name} is required (or set `{name}` in --config)")
        if not self.data:
            raise UserError("prepare: give --data PATH (conversation files or folders)")
        if self.format not in ("auto", "messages", "sharegpt", "pair", "turns", "text"):
            raise UserError(f"--format {self.format!r}: choose auto, messages, sharegpt, pair, turns or text")
        if self.thinking is not None and self.thinking not in ("on", "off"):
            raise UserError(f"--thinking {self.thinking!r}: choose on or off")
        if self.responses not in ("regenerate", "keep"):
            raise UserError(f"--responses {self.responses!r}: choose regenerate or keep")
        if self.train_turns not in ("all", "last"):
            raise UserError(f"--train-turns {self.train_turns!r}: choose all or last")
        check_number(self, "eval_fraction", 0, 1, open_high=True, must="in [0, 1)")
        check_positive(self, "max_len", "chunk_records")
        if self.truncate and self.max_len is None:
            raise UserError("--truncate cuts rows to --max-len: give --max-len too")
