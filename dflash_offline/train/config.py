"""`train`'s typed configuration: every option, its default, its checks, and which settings a resumed
run must share with its checkpoint (see dflash_offline/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_offline.options import (Configured, also, check_at_least, check_choices, check_number, check_positive, opt,
                                    where)
from dflash_offline.runtime.errors import UserError


@dataclass
class RunOptions:
    """What the run reads and writes, and where it runs."""

    cache: str = opt("", "The committed cache written by `extract` (a path or an fsspec URL).")
    target: str = opt("", "The target's Hugging Face folder (widths, mask token, frozen embedding and LM head).")
    out: str = opt("", "Run folder: step-N/ checkpoints, metrics.jsonl, logs/, export/. Re-run to resume.")  # also TensorBoard events
    devices: str = opt("cpu", "GPU indices like 5,6,7 (one DDP process each, NCCL), or cpu / cpu,cpu (gloo).")

    def check(self) -> None:
        for name in ("cache", "target", "out"):
            if not getattr(self, name):
                raise UserError(f"train: --{name} is required (or set `{name}` in --config)")


@dataclass
class DataOptions:
    """How the cache's samples become rows and steps: packing, anchors, order, the loader, and
    --follow's windows of a cache still being filled (train/sources.py)."""

    seq_len: int = opt(4096, "Context tokens per packed row; more than --block-size (a row holds whole blocks).", resume=True)
    # split: blocks/pieces.py; a piece's hidden states still carry the whole prefix, but its blocks see no
    # context before the piece. truncate: the rest is untrained.
    long_samples: str = opt("split", "Samples longer than --seq-len: split = into pieces of at most --seq-len tokens, each its own document, every trained token trained once; truncate = keep their first --seq-len tokens (earlier versions' rule).", choices=("split", "truncate"), resume=True)
    num_anchors: int = opt(512, "Blocks per row: the row's static capacity.", resume=True)  # unused ones are masked
    # A row's draws beyond num_anchors are subsampled uniformly; 0: one uniform draw of num_anchors over the
    # whole row, however many samples it packs.
    anchors_per_sample: int = opt(512, "Anchors each packed sample draws (the method's per-sequence budget), capped by --num-anchors per row; 0 = one draw per row.", resume=True)
    global_batch_tokens: int = opt(131072, "Context tokens per optimizer step, all ranks.", resume=True)  # accumulation fills it
    epochs: int = opt(6, "Epochs.", resume=True)
    seed: int = opt(0, "Seed of sample order, anchors and initial weights, >= 0.", resume=True)
    loader_workers: int = opt(2, "Background loader processes per rank; 0 = read in the training process.")
    prefetch: int = opt(4, "Rows each loader process reads ahead, >= 1.")
    verify: str = opt("quick", "quick: shards exist and open; full: also checksums.", choices=('quick', 'full'))  # full reads the whole cache
    # Shards are taken in plan order, follow_window at a time; the run ends when the plan's last shard is
    # consumed. Every committed shard is consumed once: `extract --passes N` makes N epochs.
    follow: bool = opt(False, "Train while extract fills the cache: take shards as they are committed, wait when all are consumed (needs --epochs 1).", resume=True)
    # The manifest records each deletion first; freeing shards lets a budgeted extraction (--max-bytes) go on.
    stream: bool = opt(False, "With --follow: delete each shard once a checkpoint is past its last use.")
    follow_window: int = opt(4, "Shards shuffled and packed together with --follow.", resume=True)  # the budget must hold a window's shards

    def check(self) -> None:
        check_positive(self, "num_anchors", "seq_len", "global_batch_tokens", "epochs", "follow_window", "prefetch")
        # A row's capacity beyond its positions is masked padding; beyond the default as well, a typo
        # that would allocate (anchors x block) tables of that size.
        if self.num_anchors > max(self.seq_len, DataOptions.num_anchors):
            raise UserError(f"{where(self, 'num_anchors')} {self.num_anchors} exceeds {also(self, 'seq_len')} "
                            f"{self.seq_len}: each anchor is a distinct position of a row; lower the first")
        check_at_least(self, "anchors_per_sample", 0, "0 = one draw per row")
        check_at_least(self, "loader_workers", 0, "0 = read in the training process")
        check_at_least(self, "seed", 0, "it seeds numpy's generators, which take no negative seed")
        if self.stream and not self.follow:
            raise UserError(f"{where(self, 'stream')} needs {also(self, 'follow')} (it releases shards of a cache that extraction is "
                            "still filling)")
        if self.follow and self.epochs != 1:
            raise UserError(f"{where(self, 'follow')} consumes every committed shard once, so {where(self, 'epochs')} "
                            f"must be 1 (got {self.epochs}); for several epochs extract with --passes N")


@dataclass
class DrafterOptions:
    """The drafter: its shape, the target layers it reads and starts from, its mask token, and the
    method (DFlash, or DSpark's Markov and confidence heads)."""

    drafter_layers: int = opt(5, "Drafter layers.", resume=True, old=("num_layers",))
    block_size: int = opt(16, "Draft block size.", resume=True)
    # Read in the cache's order. One extraction of a superset serves a whole layer ablation.
    target_layers: list[int] | None = opt(None, "Target layer ids the drafter reads, a subset of the cache's, e.g. 1,3,5,6.", default_text="all the cache holds", resume=True, old=("layers",))
    # None (random) is the method's own start; drafter/warm_start.py says what each kind of layer gives.
    init_layers: list[int] | None = opt(None, "Target layer ids whose weights start the drafter's layers, one per drafter layer, e.g. 0,1,2,3,4: every tensor of a dense target's layer; of a hybrid's, the MLP and norms, and a full-attention layer's attention (its output gate dropped).", default_text="random", resume=True)
    mask_token_id: int | None = opt(None, "Mask token id.", default_text="the tokenizer's mask token", resume=True)
    # dflash: dflash-method.md. dspark: DSpark, arXiv 2607.05147 (drafter/dspark.py, blocks/dspark_loss.py);
    # slot j predicts the token at anchor + 1 + j, the Markov head a low-rank bias from the previous token.
    method: str = opt("dflash", "dflash, or dspark: every block slot predicts the next token, with a Markov head and a confidence head, and the loss ce x CE + tv x L1(p_draft, p_target) + bce x BCE(confidence, 1 - TV) (p_target from the cache's top-k).", choices=("dflash", "dspark"), resume=True)
    markov_rank: int = opt(256, "With --method dspark: the Markov head's rank.", resume=True)
    markov_head: str = opt("vanilla", "With --method dspark: vanilla (the kind vLLM and SGLang load) or gated (a sigmoid gate from the slot's hidden state).", choices=("vanilla", "gated"), resume=True)
    confidence_head: bool = opt(True, "With --method dspark: train the confidence head (the probability each slot survives; engines use it to cut a block short).", resume=True)

    def check(self) -> None:
        check_positive(self, "drafter_layers", "block_size")
        if self.block_size < 2:
            raise UserError(f"{where(self, 'block_size')} must be at least 2 (slot 0 is the anchor, slots 1.. are "
                            f"drafted), got {self.block_size}")
        check_at_least(self, "mask_token_id", 0, "a token id of the target's vocabulary")
        if self.method == "dspark":
            check_positive(self, "markov_rank")
        ids = self.target_layers
        if ids is not None and (not ids or len(set(ids)) != len(ids)):
            raise UserError(f"{where(self, 'target_layers')} {ids}: give distinct layer ids the cache holds")


@dataclass
class LossOptions:
    """The loss: slot weights, distillation, DSpark's three terms, and how the LM head's chunks run."""

    gamma: float | None = opt(None, "Loss decay over slots, > 0: slot k weighs exp(-(k-1)/gamma).", default_text="7 for block 16, 5 for 10, 4 for 8", resume=True)
    # dpace: D-PACE (arXiv 2605.18810), slot k weighs sum_{m>=k} prod_{i<=m} ((1 - a) q_i + a), q_i the
    # drafter's detached probability of slot i's token: the gradient of the expected accepted length,
    # per block and step.
    loss_weights: str = opt("decay", "How a block's slots weigh in the loss: decay = exp(-(k-1)/gamma), the method's; dpace = D-PACE, each slot by the acceptance it can still unlock (from the drafter's own detached probabilities).", choices=("decay", "dpace"), resume=True)
    dpace_alpha: float = opt(0.5, "With --loss-weights dpace: the smoothing a in (1 - a) x q + a, in [0, 1] (1 = every scored slot to the end counts equally).", resume=True)
    # The cache's top-k log-probabilities, renormalised; 0 = hard labels.
    kd_weight: float = opt(0.0, "Share of the target's top-k distribution (from the cache) in each slot's target, 0..1; 0 = the data tokens alone.", resume=True)
    ce_weight: float | None = opt(None, "The weight of the cross-entropy term beside --tv-weight.", default_text="0.1 with --method dspark, 1 with dflash", resume=True)
    tv_weight: float | None = opt(None, "The weight of the L1 distance between the drafter's and the target's distributions (twice the total variation; p_target from the cache's top-k); with --method dflash above 0 it adds DSpark's distribution term to DFlash's loss.", default_text="0.9 with --method dspark, 0 with dflash", resume=True)
    bce_weight: float = opt(1.0, "With --method dspark: the weight of the confidence head's binary cross-entropy.", resume=True)
    # None = auto_loss_chunk(vocabulary): about 2^28 logits (1 GB in fp32) a chunk.
    loss_chunk_tokens: int | None = opt(None, "Block tokens per LM-head chunk in the loss.", default_text="2^28 / vocabulary, at least 4096", resume=True)
    # Head matmuls per token: fused two; recompute three (the backward recomputes the chunks' logits).
    loss_impl: str = opt("fused", "fused: the head's input gradient is made in the loss forward; recompute: checkpointed chunks.", choices=('fused', 'recompute'))
    # The passes: log-sum-exp, the label's logit, argmax, the gradient. Same numbers as eager up to float32
    # summation order (tests/test_loss.py, CPU and GPU). -8.8% measured on an H200 (stages/qwen3.6-27b turns
    # it on); off by default until its effect on the small pycode drafter's end-to-end run is measured.
    compile_loss: bool = opt(False, "Compile the loss's element-wise passes over each chunk's logits (fused kernels reading the matmul's dtype); -8.8% step time at the 27B drafter's shape. With the L1 term (DSpark, --tv-weight) each chunk of the three-term loss is one compiled graph.")

    def check(self) -> None:
        check_positive(self, "loss_chunk_tokens")
        check_number(self, "gamma", 0, open_low=True, must="positive",
                     why="slot k weighs exp(-(k-1)/gamma): 0 divides by zero, a negative value weighs the far slots most")
        check_number(self, "kd_weight", 0, 1, must="in [0, 1]", why="the top-k distribution's share of the target")
        check_number(self, "dpace_alpha", 0, 1, must="in [0, 1]", why="the smoothing a in (1 - a) x q + a")
        for name in ("ce_weight", "tv_weight", "bce_weight"):
            check_number(self, name, 0, open_high=True, must=">= 0 and finite", why="a weight of the loss's terms")


@dataclass
class OptimizerOptions:
    """The optimizer, its schedule, and the step's numerics and kernels."""

    # None = auto_lr(hidden size): 6e-4 is the published recipe's, tuned on 4096-wide drafters; 4.0e-3 at 384 wide.
    lr: float | None = opt(None, "Peak learning rate.", default_text="6e-4 x (4096 / hidden size)^0.8", resume=True)
    warmup_ratio: float = opt(0.04, "Warm-up share of all steps, in [0, 1).", resume=True)
    weight_decay: float = opt(0.0, "AdamW weight decay: 0 or more (a negative value is refused: it would grow the weights).", resume=True)
    clip: float = opt(1.0, "Gradient-norm clip: more than 0, inf = no clipping (0 and negative values are refused).", resume=True)
    precision: str = opt("auto", "auto = bf16 autocast on GPU, fp32 on CPU.", choices=('auto', 'bf16', 'fp32'), resume=True)  # fp32 master weights
    # Inductor fuses the elementwise work with the flex kernels; None = on GPU, off on CPU.
    compile_layers: bool | None = opt(None, "Compile the drafter layer for training (fuses its elementwise work).", default_text="on GPU")
    # flex_attention takes a BlockMask; the CPU has no flex backward; the dense mask costs O(Q x KV) memory.
    attention: str = opt("auto", "auto = compiled flex on GPU, SDPA + dense mask on CPU; sdpa = the dense baseline on GPU too.", choices=('auto', 'sdpa'))

    def check(self) -> None:
        check_number(self, "lr", 0, open_low=True, open_high=True, must="positive and finite")
        check_number(self, "clip", 0, open_low=True, must="positive (inf = no clipping)",
                     why="the largest gradient norm a step applies: 0 makes no update, a negative one reverses it")
        check_number(self, "warmup_ratio", 0, 1, open_high=True, must="in [0, 1)",
                     why="the share of all steps the learning rate warms up over")
        check_number(self, "weight_decay", 0, open_high=True, must=">= 0 and finite",
                     why="AdamW shrinks each weight by lr x weight decay per step; a negative one grows them")


@dataclass
class CheckpointOptions:
    """How long the run goes and what it keeps (runs/checkpoint.py owns the format)."""

    max_steps: int | None = opt(None, "Stop after this many steps (schedule still spans all epochs).")
    checkpoint_every: int = opt(500, "Steps between checkpoints.")
    keep_checkpoints: int = opt(3, "Checkpoints kept.")
    final_checkpoint: bool = True
    """Write a checkpoint and the export when the run ends (benchmarks turn it off)."""

    def check(self) -> None:
        check_positive(self, "checkpoint_every", "keep_checkpoints", "max_steps")


@dataclass
class HeldOutOptions:
    """The held-out estimate during training (train/heldout.py): the best drafter goes to OUT/best/."""

    # A cache of the target's own completions; rank 0 measures it.
    eval_cache: str | None = opt(None, "Held-out cache: the walk estimate of decoding tau every --eval-every steps; the best drafter goes to OUT/best/.")
    eval_every: int | None = opt(None, "Steps between held-out evaluations.", default_text="--checkpoint-every")
    eval_samples: int = opt(200, "Held-out samples per evaluation.")  # the cache's first ones

    def check(self) -> None:
        check_positive(self, "eval_every", "eval_samples")
        if self.eval_every is not None and not self.eval_cache:
            raise UserError(f"{where(self, 'eval_every')} sets how often --eval-cache is measured; give --eval-cache "
                            "CACHE (a held-out cache of the target's own completions) or leave it out")


@dataclass
class ReportOptions:
    """What the run shows as it goes."""

    log_every: int = opt(10, "Steps between log lines.")
    # Writes a trace and a table.
    profile_steps: int = opt(0, "Profile N optimizer steps (torch.profiler) after the first five: where a step's time goes, in OUT/profile/; 0 = off.")
    progress: bool = opt(True, "Progress bar.")

    def check(self) -> None:
        check_positive(self, "log_every")
        check_at_least(self, "profile_steps", 0, "0 = off")


# The components in their command-line order; TrainConfig.validate runs each one's checks.
PARTS = (RunOptions, DataOptions, DrafterOptions, LossOptions, OptimizerOptions, CheckpointOptions, HeldOutOptions,
         ReportOptions)


@dataclass
class TrainConfig(ReportOptions, HeldOutOptions, CheckpointOptions, OptimizerOptions, LossOptions, DrafterOptions,
                  DataOptions, RunOptions, Configured):
    """`train`'s options, one component each (a torchtitan-style config per part), composed as
    bases of one flat dataclass: the command line, the recipes and a checkpoint's saved settings
    keep their flat names (`--lr`, `lr = ...`, `config.lr`), and a part of the code that needs one
    component can take it alone. Field order (and so `--help`'s) is the components' order above
    (dataclasses take the bases last to first)."""

    def resolved_loss_chunk(self, vocab_size: int) -> int:
        return self.loss_chunk_tokens or auto_loss_chunk(vocab_size)

    def check(self) -> None:
        """All of them: without this, `check` would be the first base's (ReportOptions') alone."""
        self.validate()

    def validate(self) -> None:
        """Each component's own checks (`check`, called through its class: the bases share the
        name), then the checks that span components."""
        for part in PARTS:
            part.check(self)
        check_choices(self)
        if self.seq_len <= self.block_size:
            raise UserError(f"{where(self, 'seq_len')} must exceed {also(self, 'block_size')} ({self.block_size}), "
                            f"got {self.seq_len}: a row must hold an anchor and its drafted tokens; raise the first "
                            "or lower the second")
        if self.method != "dspark":  # a DSpark-only option set away from its default would be ignored: say so instead
            heads = [n for n in ("markov_rank", "markov_head", "confidence_head", "bce_weight")
                     if getattr(self, n) != getattr(TrainConfig, n)]
            if heads:
                raise UserError(f"{where(self, heads[0])} is an option of DSpark's heads; add {also(self, 'method')} "
                                "dspark, or leave it out")
        if self.ce_weight is not None and not self.distribution_loss:
            raise UserError(f"{where(self, 'ce_weight')} weighs the cross-entropy beside the L1 term; without "
                            f"{also(self, 'tv_weight')} (or --method dspark) the loss is DFlash's cross-entropy alone: "
                            "leave it out, or add --tv-weight")
        if self.method == "dspark" and not self.confidence_head and self.bce_weight != TrainConfig.bce_weight:
            raise UserError(f"{where(self, 'bce_weight')} weighs the confidence head's loss, and "
                            f"{also(self, 'confidence_head')} leaves the head out: leave one of them out")
        if self.distribution_loss and self.kd_weight:  # blocks/dspark_loss.py: the L1 term reads the top-k itself
            why = f"{also(self, 'method')} dspark" if self.method == "dspark" else f"{also(self, 'tv_weight')} above 0"
            raise UserError(f"{where(self, 'kd_weight')} mixes the top-k into the cross-entropy's target; the L1 "
                            f"term (--tv-weight) matches the top-k itself: leave it out with {why}")

    def resolved_lr(self, hidden_size: int) -> float:
        return self.lr if self.lr is not None else auto_lr(hidden_size)

    @property
    def resolved_ce_weight(self) -> float:
        return self.ce_weight if self.ce_weight is not None else (0.1 if self.method == "dspark" else 1.0)

    @property
    def resolved_tv_weight(self) -> float:
        return self.tv_weight if self.tv_weight is not None else (0.9 if self.method == "dspark" else 0.0)

    @property
    def distribution_loss(self) -> bool:
        """The three-term loss (blocks/dspark_loss.py): DSpark's, or DFlash's with --tv-weight."""
        return self.method == "dspark" or self.resolved_tv_weight > 0

    def resolved_gamma(self, block_size: int) -> float:
        """--gamma, else the method's for `block_size`: the drafter's (plan.drafter, its owner after
        preflight), not the command line's."""
        if self.gamma is not None:
            return float(self.gamma)
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, 7.0 * block_size / 16)


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
