"""`eval`'s typed configuration: every option, its default and its checks (see dflash_offline/config.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from dflash_offline.options import also, check_at_least, check_choices, check_positive, opt, where
from dflash_offline.runtime.errors import UserError
from dflash_offline.sampling import SamplingOptions


@dataclass
class EvalConfig(SamplingOptions):
    target: str = opt("", "The target's Hugging Face folder.")
    drafters: list[str] = opt(help="A drafter export folder or a step-N checkpoint; repeat to compare several.", factory=list, flag="--drafter")
    prompts: str | None = opt(None, "Parquet with input_ids: speculative decoding against the target, checked lossless.")
    cache: str | None = opt(None, "A (held-out) cache: acceptance estimated from it, without running the target.")
    # --devices as every other command spells it (eval runs on one of them: a list is refused).
    devices: str = opt("cpu", "One GPU index (e.g. 0) or cpu.", old=("device",))
    dtype: str = opt("float32", "Target and drafter dtype for decoding (float32: the lossless check is exact).", choices=('float32', 'bfloat16', 'float16'))
    max_new_tokens: int = opt(256, "New tokens per prompt.")
    max_prompts: int | None = opt(None, "Use only the first N prompts.")
    ignore_eos: bool = opt(False, "Always generate --max-new-tokens (do not stop at end-of-sequence).", is_flag=True)
    baseline: bool | None = opt(None, "Also decode with the target alone: the lossless reference and the speed baseline.", default_text="on, off with --reference")
    reference: str | None = opt(None, "Parquet of the target's greedy completions of --prompts (id, input_ids, loss_mask; e.g. `generate --out X.parquet`): check the outputs against it instead of decoding with the target alone.")
    seq_len: int = opt(2048, "Cache estimate, random anchors: tokens per packed row.")
    num_anchors: int = opt(256, "Cache estimate, random anchors: blocks per row.")
    max_rows: int | None = opt(None, "Cache estimate, random anchors: use at most this many rows.")
    max_samples: int | None = opt(None, "Cache walk (decoding's blocks): use only the first N samples.", default_text="all")
    walk_batch_rows: int = opt(4, "Cache walk: rows of up to 512 anchors per drafter forward.")
    # By the decoder --decoder picks: static buffers evaluate/graphed.py, KV caches evaluate/kv_batch.py,
    # sliding-window re-runs evaluate/batched.py. 64 on a GPU: one prompt at a time leaves it idle.
    batch_size: int | None = opt(None, "Prompts decoded together: 1 = one at a time; N > 1 = N per target forward (static buffers; transformers: KV caches, hybrid targets' recurrent states rolled back per row, sliding-window targets' sequences re-run each round); the target-alone baseline is batched the same way. All exact.", default_text="64 on a GPU, 1 on CPU")
    # The cache: held out, the target's own greedy completions. The disagreement is walk vs decoding
    # (evaluate/parity.py).
    parity: int | None = opt(None, "With --cache: on its first N samples compare the every-anchor estimate, the walk and real decoding; name the likely cause of a disagreement (exit 1).")
    show: int = opt(0, "After decoding, print the first N prompts and each drafter's outputs as text (the target's tokenizer.json), each verify round's accepted drafts in green on a terminal (NO_COLOR: off), else between {{ and }}; the token the target adds each round unmarked; 0 = off.")
    json_path: str | None = opt(None, "Write the full report here as JSON.", flag="--json")
    # The default looks at the first drafter (in export/, best/ or step-N/ of a run); never a folder beside
    # someone's model.
    log_dir: str | None = opt(None, "Folder for the process log.", default_text="RUN/logs for a drafter in a training run folder, else ./dflash-logs")
    progress: bool = opt(True, "Progress bars.")
    top_k: int = opt(0, "Sampling: keep the k most likely tokens; 0 = all.")
    # static: key/value buffers and per-row Gated DeltaNet states; one CUDA graph a round; runs Qwen3, Qwen2,
    # Llama, Mistral and the Qwen3.5/3.6 hybrids. transformers runs sliding windows too.
    decoder: str = opt("auto", "static: the target's layers over preallocated buffers, CUDA graphs on a GPU (full-attention and Gated DeltaNet hybrid targets); transformers: transformers' forward and caches (any target); auto: static where possible (the report says which ran).", choices=('auto', 'static', 'transformers'))
    implied_for: str | None = opt(None, "Also print the speed-up this tau implies on a named target shape measured by benchmarks/decode_speed.py --ceiling (e.g. qwen3.6-27b).")  # kernel times; evaluate/ceiling.py

    def validate(self) -> None:
        if not self.target:
            raise UserError("eval: --target is required")
        if not self.drafters:
            raise UserError("eval: give at least one --drafter (an export folder or a step-N checkpoint)")
        if not self.prompts and not self.cache:
            raise UserError("eval: give --prompts PARQUET (speculative decoding) and/or --cache CACHE (estimate)")
        if self.parity is not None and (self.parity <= 0 or not self.cache):
            raise UserError(f"eval: {where(self, 'parity')} {self.parity} needs N > 0 and --cache (a held-out cache "
                            "of the target's own greedy completions: their prompts are decoded and compared with the walk)")
        if self.reference and not self.prompts:
            raise UserError(f"eval: {where(self, 'reference')} checks the outputs of --prompts; give the prompts it "
                            "completes too")
        if self.show < 0 or (self.show and not self.prompts):
            raise UserError(f"eval: {where(self, 'show')} {self.show} prints the first N decoded prompts: give N >= 0 "
                            "(0 = off) and --prompts")
        check_at_least(self, "top_k", 0, "0 = the whole vocabulary")
        check_positive(self, "max_new_tokens", "seq_len", "num_anchors", "walk_batch_rows", "batch_size",
                       "max_prompts", "max_rows", "max_samples")
        self.check_sampling()
        if self.temperature > 0 and not self.prompts:
            raise UserError(f"eval: {where(self, 'temperature')} {self.temperature} samples the decoding of --prompts; "
                            "the --cache estimate is greedy: give --prompts, or leave the sampling options out")
        if self.temperature > 0 and self.reference:
            raise UserError("eval: --reference holds greedy completions, checked token for token; sampled outputs "
                            "(--temperature > 0) cannot be: drop one of them")
        check_choices(self)
        # As train's rule (anchors beyond a short row's positions are masked padding, up to the
        # default count): a typo would allocate (anchors x block) tables after all the decoding.
        if self.cache and self.num_anchors > max(self.seq_len, EvalConfig.num_anchors):
            raise UserError(f"{where(self, 'num_anchors')} {self.num_anchors} exceeds {also(self, 'seq_len')} "
                            f"{self.seq_len}: the cache estimate's anchors are distinct positions of a row; lower the first")


# How eval's messages name an option, for code below the command that gets values, not the config:
# `partial(where, cfg)` names the flag the user typed or the recipe key and file a value came from;
# AS_FLAGS, without a config, the flag (`drafters` -> --drafter).
Said = Callable[[str], str]
AS_FLAGS: Said = partial(where, EvalConfig)
