"""What the serving engines load of an export, as read in their released source (docs/serving.md
names each version and file): the one place that says which engine cannot take what was trained.

The facts behind each line (tests/test_engine_exports.py holds exports to them, and runs llama.cpp's
own converter):
- vLLM 0.33.0 (`qwen3_dspark.py`): a vanilla Markov head only (a gated head's `markov_head.gate_proj`
  has no parameter there: the load stops with a ValueError); the embedding and LM head are optional
  (the target's are lent when absent); the confidence head is optional.
- SGLang 0.5.23 (`models/dspark.py`): vanilla and gated heads; the checkpoint's embedding and LM
  head are skipped (the target's are attached); outside its default verify mode
  (`SGLANG_RAGGED_VERIFY_MODE=cap-accept` or `compact`) it builds the confidence head whatever the
  config says and refuses a checkpoint without its weights.
- llama.cpp (as vendored in llama-cpp-python 0.3.36; `conversion/qwen.py` DSparkModel,
  `src/models/dflash.cpp`): its converter refuses a Markov head other than vanilla, keeps
  `embed_tokens` as the draft's token table and drops `lm_head` of a full-vocabulary draft; the
  runtime then uses that token table as the LM head too (wrong for an untied target), and without
  either table uses the target's.
- DeepSpec (afdfa7c, `deepspec/modeling/dspark/qwen3/modeling.py`, `deepspec/eval/dspark/evaluator.py`):
  loads the draft with `from_pretrained`, so the embedding and LM head must be in the checkpoint
  (missing, they would start at random); its config must carry `num_anchors`.
"""

from __future__ import annotations

from dflash_offline.drafter.config import DrafterConfig

VLLM, SGLANG, LLAMA_CPP, DEEPSPEC = "vLLM 0.33.0", "SGLang 0.5.23", "llama.cpp (llama-cpp-python 0.3.36)", "DeepSpec"


def cannot_serve(cfg: DrafterConfig, tables: bool, tied: bool) -> list[str]:
    """'engine (why)' for each engine that cannot serve this export as it was trained: `tables`,
    whether the export carries the target's embedding and LM head; `tied`, whether those two are one
    table. A DFlash export loads in all of them."""
    if cfg.method != "dspark":
        return []
    out = []
    if cfg.markov_head_type != "vanilla":
        out += [f"{VLLM} (a {cfg.markov_head_type} Markov head has no parameters there: the load fails)",
                f"{LLAMA_CPP} (its converter takes the vanilla Markov head only)"]
    if not cfg.confidence_head:
        out.append(f"{SGLANG} outside its default static verify mode (it builds the confidence head there and refuses "
                   "a checkpoint without it)")
    if tables and not tied:
        out.append(f"{LLAMA_CPP} (its converter keeps embed_tokens and drops lm_head, so it drafts with the input "
                   "table as the LM head of this untied target: convert an export made without --target-tables)")
    return out


# Said (not warned) of every DSpark export without the tables: the one engine that needs them.
WITHOUT_TABLES = (f"the export leaves out the target's embedding and LM head (vLLM, SGLang and llama.cpp lend the "
                  f"target's); {DEEPSPEC}'s evaluator loads them from the checkpoint: export with --target-tables for it")
