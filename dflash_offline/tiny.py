"""Tiny targets and inputs made on the fly: the demo's embedded default and the tests' fixtures.

The targets are real transformers models (dense Qwen3, hybrid Qwen3.5 with Gated DeltaNet layers)
built from a config with seeded random weights and saved as a normal Hugging Face folder.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from dflash_offline.runtime.launch import single_thread_compute

TINY_VOCAB = 512


def tiny_config(kind: str = "qwen3", num_target_layers: int = 8):
    from transformers import Qwen3Config

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_target_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if kind == "qwen3":
        return Qwen3Config(**common)
    if kind == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5TextConfig

        # 3 Gated DeltaNet layers : 1 attention layer, as in the Qwen3.5/3.6 family.
        return Qwen3_5TextConfig(**common, linear_num_key_heads=2, linear_num_value_heads=4,
                                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    raise ValueError(f"unknown tiny target kind {kind!r}; use qwen3 or qwen3_5")


def make_tiny_target(out: str | Path, kind: str = "qwen3", num_target_layers: int = 8, seed: int = 0) -> Path:
    """Save a seeded random tiny causal LM to `out` (config.json + model.safetensors).

    kind: `qwen3` (dense), `qwen3_5` (hybrid text model), or `qwen3_5_vl` (the hybrid text model
    inside Qwen3.5's multimodal wrapper, as the released Qwen3.5/3.6 checkpoints are saved: keys
    under `model.language_model.`, a vision tower beside it).
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    torch.manual_seed(seed)
    if kind == "qwen3_5_vl":
        from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        cfg = Qwen3_5Config(text_config=tiny_config("qwen3_5", num_target_layers).to_dict(), vision_config=vision,
                            tie_word_embeddings=False)
        model = Qwen3_5ForConditionalGeneration(cfg)
    else:
        model = AutoModelForCausalLM.from_config(tiny_config(kind, num_target_layers), dtype=torch.float32)
    # Random init gives tiny, near-uniform logits; scale the head so top-k has clear winners.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(out)
    return out


def make_tiny_data(path: str | Path, rows: int = 64, seed: int = 0, min_len: int = 8, max_len: int = 200,
                   vocab: int = TINY_VOCAB, mask_style: str = "loss_mask", with_id: bool = True,
                   id_offset: int = 0, row_group_size: int | None = None, pattern: str = "random") -> Path:
    """Prompt + response rows in the contract's Parquet layout: random tokens, or `arith` rows
    (learnable arithmetic progressions) for training runs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lens = rng.integers(min_len, max_len + 1, size=rows)
    if pattern == "random":
        ids = [rng.integers(2, vocab, size=int(n)).astype(np.int32) for n in lens]
    elif pattern == "arith":
        # Learnable text: each row counts from a random start by a stride of 1 or 2 around a
        # cycle of 32 tokens, so a drafter can predict the next tokens from the anchor (which
        # token) and its context (which stride) after a few hundred CPU steps.
        ids = []
        for n in lens:
            a, d = int(rng.integers(0, 32)), int(rng.integers(1, 3))
            ids.append(((a + d * np.arange(int(n))) % 32 + 2).astype(np.int32))
    else:
        raise ValueError(f"unknown pattern {pattern!r}; use random or arith")
    prompt = [int(rng.integers(1, max(2, n // 2))) for n in lens]
    cols = {"input_ids": pa.array([a.tolist() for a in ids], type=pa.list_(pa.int32()))}
    if mask_style == "loss_mask":
        masks = [np.r_[np.zeros(p, np.int8), np.ones(n - p, np.int8)] for p, n in zip(prompt, lens)]
        cols["loss_mask"] = pa.array([m.tolist() for m in masks], type=pa.list_(pa.int8()))
    else:
        cols["prompt_len"] = pa.array(prompt, type=pa.int64())
    if with_id:
        cols["id"] = pa.array(np.arange(id_offset, id_offset + rows), type=pa.int64())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)
    return path


# ----------------------------------------------------------------------------------------------
# The demo's target: a tiny model trained on the CPU for seconds, so that what it writes has
# structure a drafter can learn (a random-weight target's greedy output is noise to any drafter).

EOS = 0  # end of text / padding in the tiny vocabulary
CYCLE = 32  # progressions count around a cycle of 32 tokens (ids 2..33)
STRIDES = (1, 2, 3)


def progression(start: int, stride: int, n: int) -> list[int]:
    return (((start + stride * np.arange(n)) % CYCLE) + 2).tolist()


def progression_text(rng: np.random.Generator, length: int) -> list[int]:
    """Documents of 24..120 tokens, each an arithmetic progression (random start and stride 1-3)
    followed by the end-of-text token, back to back, cut to `length`."""
    out: list[int] = []
    while len(out) < length:
        n = int(rng.integers(24, 121))
        out += progression(int(rng.integers(0, CYCLE)), int(rng.choice(STRIDES)), n) + [EOS]
    return out[:length]


def train_tiny_target(folder: str | Path, steps: int = 120, batch: int = 16, seq_len: int = 96, lr: float = 3e-3,
                      seed: int = 0) -> dict:
    """Train the tiny target in `folder` in place (next-token loss on progression text, AdamW),
    mark token 0 as its end of sequence, and save it with a tokenizer (save_tiny_tokenizer).
    Returns {steps, loss, seconds}."""
    import torch
    from transformers import AutoModelForCausalLM

    # One thread, as every stage's compute: this model is far too small to gain from a second one,
    # and an OpenMP pool of two on a two-core machine that is doing anything else spins and waits
    # (measured 0.37 s a step with one thread, 6.7 s with two, on a busy 2-core machine).
    single_thread_compute()
    folder = Path(folder)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    t0 = time.time()
    loss = None
    for step in range(steps):
        x = torch.tensor([progression_text(rng, seq_len) for _ in range(batch)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = EOS
        cfg.pad_token_id = EOS
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return {"steps": steps, "loss": float(loss.detach()), "seconds": time.time() - t0}


def save_tiny_tokenizer(folder: str | Path) -> None:
    """A tokenizer for the tiny vocabulary, so that what reads text works on the demo's target
    (`inspect --text`, `eval --show`): `<eos>` (0), `<mask>` (1), the progression's tokens 2..33 as
    the numbers 0..31, and the unused rest as t34..t511. Each token carries its leading space
    (Metaspace, never prepended), so runs of tokens decoded apart still join with spaces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": EOS, "<mask>": 1}
    vocab.update({f"\u2581{k}": k + 2 for k in range(CYCLE)})
    vocab.update({f"\u2581t{i}": i for i in range(CYCLE + 2, TINY_VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<mask>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<mask>", special=True)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>",
                            mask_token="<mask>").save_pretrained(folder)


def make_progression_prompts(path: str | Path, rows: int, seed: int, min_len: int = 4, max_len: int = 20,
                             id_offset: int = 0) -> Path:
    """Prompts (`id`, `input_ids`): the first 4..20 tokens of random progressions."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    prompts = [progression(int(rng.integers(0, CYCLE)), int(rng.choice(STRIDES)), int(rng.integers(min_len, max_len + 1)))
               for _ in range(rows)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": pa.array(np.arange(id_offset, id_offset + rows), pa.int64()),
                             "input_ids": pa.array(prompts, pa.list_(pa.int32()))}), path)
    return path
