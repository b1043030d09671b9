"""`dflash-offline eval`: how many tokens a drafter saves, measured two ways.

1. **Speculative decoding against the target** (`--prompts`): greedy, batch 1, per round
   (dflash-method.md, "Inference"): the drafter drafts one block from the last committed token
   over its cached context features; the target verifies the block in one forward; the agreeing
   prefix plus one target token is committed; both caches are cut back to the committed length.
   A hybrid target's Gated DeltaNet state cannot be cut back, so it is restored from a snapshot
   taken before the verify forward and advanced over the committed tokens by one more forward.
   Every output is checked against the target's own greedy decode of the same prompt (lossless),
   and decode speed is measured against that plain decode, prompt by prompt, in one run.
   With `--reference` the outputs are checked against given greedy completions instead (the
   target-alone decode costs as much as the speculative one), and no speed-up is measured.
2. **Acceptance from the cache** (`--cache`), without running the target, two ways. Both score a
   block by the leading run of draft slots whose argmax equals the data token (the training
   metrics' rule); with the target's own greedy completions the data tokens are its greedy tokens.
   - The *walk* (`walk_acceptance`): every candidate anchor of every sample is scored, then the
     blocks decoding would draft are picked out: the first at the first completion token, each
     next one where the last one's committed tokens end. This is the decoding tau without the
     target (exactly, for greedy self-generated completions; `walk_acceptance` says where not).
   - *Random anchors* (`cache_acceptance`): rows packed as in training, random blocks per row.
     It runs above the decoding tau (pycode: 2.27 against 1.69): random anchors weigh every
     position alike, while decoding starts each block where the last one ended, so it spends few
     blocks on easy stretches and many on hard ones. It ranks checkpoints like the walk.

tau = tokens committed per verify round = 1 + accepted drafts (dflash-method.md).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

from dflash_offline.config import EvalConfig
from pathlib import Path
from typing import Protocol

import numpy as np

from dflash_offline.target.folder import eos_ids
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.paths import REPORT_FORMAT, check_report_dest, require_kind

log = logging.getLogger("dflash.eval")


# ----------------------------------------------------------------------------------------------
# Inputs


def _read_table(option: str, path: str, columns: tuple[str, ...], fix: str):
    """A Parquet table with `columns`, or one line naming the option, the file and the fix."""
    import pyarrow.parquet as pq

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


def read_prompts(path: str, vocab_size: int, max_prompts: int | None = None) -> tuple[list[int], list[list[int]]]:
    """(ids, prompts) from a Parquet file with `input_ids` (and optional `id`); one line per problem."""
    table = _read_table("--prompts", path, ("input_ids",), "expected a Parquet file with an input_ids column")
    prompts = table.column("input_ids").to_pylist()
    ids = table.column("id").to_pylist() if "id" in table.column_names else list(range(len(prompts)))
    if max_prompts is not None:
        prompts, ids = prompts[:max_prompts], ids[:max_prompts]
    if not prompts:
        raise UserError(f"--prompts {path}: the file holds no rows; give at least one prompt")
    for row, toks in enumerate(prompts):
        if not toks:
            raise UserError(f"--prompts {path}: row {row} is empty; every prompt needs at least one token")
        if None in toks:
            raise UserError(f"--prompts {path}: row {row} of column input_ids holds a null element (position "
                            f"{toks.index(None)}); every entry must be a token id: fix or drop that row")
        bad = next((t for t in toks if not 0 <= int(t) < vocab_size), None)
        if bad is not None:
            raise UserError(f"--prompts {path}: row {row} holds token id {bad}, outside the target's vocabulary "
                            f"(0..{vocab_size - 1}); tokenize with the target's tokenizer")
    return [int(i) for i in ids], [[int(t) for t in toks] for toks in prompts]


def read_reference(path: str, ids: list[int], prompts: list[list[int]], max_new: int, eos: set[int]) -> list[list[int]]:
    """The output the target's greedy decode would give for each prompt, from a Parquet file of
    its greedy completions (input contract: `id`, `input_ids` = prompt + completion, `loss_mask`
    0 on the prompt and 1 on the completion; `dflash-offline generate` writes it): the completion
    cut where `greedy_decode` stops, after max_new tokens or at its first end-of-sequence token.
    Refused in one line, before anything decodes: a prompt id without a row, a row whose prompt
    part is not that prompt, a completion that ends before max_new tokens without an
    end-of-sequence token (the decode would go on where the reference has nothing to compare)."""
    fix = "give the target's greedy completions of these --prompts (dflash-offline generate)"
    table = _read_table("--reference", path, ("id", "input_ids", "loss_mask"), fix)
    rows: dict[int, tuple[list[int], list[int]]] = {}
    for rid, toks, mask in zip(table.column("id").to_pylist(), table.column("input_ids").to_pylist(),
                               table.column("loss_mask").to_pylist()):
        if rid in rows:
            raise UserError(f"--reference {path}: id {rid} occurs twice; ids must be unique")
        rows[rid] = (toks or [], mask or [])
    missing = [i for i in ids if i not in rows]
    if missing:
        raise UserError(f"--reference {path}: no row for prompt id(s) {missing[:10]} ({len(missing)} of {len(ids)}); {fix}")
    want = []
    for i, prompt in zip(ids, prompts):
        toks, mask = rows[i]
        n = next((k for k, v in enumerate(mask) if v), len(mask))
        if len(mask) != len(toks) or any(not v for v in mask[n:]):
            raise UserError(f"--reference {path}: id {i}: loss_mask is not 0 on a prompt then 1 on the completion "
                            f"({len(toks)} tokens, {len(mask)} mask entries); {fix}")
        if toks[:n] != prompt:
            k = next((k for k, (a, b) in enumerate(zip(toks[:n], prompt)) if a != b), min(n, len(prompt)))
            raise UserError(f"--reference {path}: id {i}: its prompt ({n} tokens) differs from the --prompts row "
                            f"({len(prompt)} tokens) from token {k} on; {fix}")
        completion = toks[n:]
        stop = next((k + 1 for k, t in enumerate(completion[:max_new]) if t in eos), max_new)
        if len(completion) < stop:
            raise UserError(f"--reference {path}: id {i}: its completion ends after {len(completion)} tokens without an "
                            f"end-of-sequence token, before --max-new-tokens {max_new}; lower --max-new-tokens or "
                            "generate the reference with at least as many new tokens")
        want.append([int(t) for t in completion[:stop]])
    return want


def load_drafter(path: str, target_dir: str):
    """A drafter from an export folder (config.json) or a training checkpoint (step-N/), with the
    target's frozen embedding and LM head; refuses a drafter made for another target shape."""
    from dflash_offline.drafter.model import EXPORT_WEIGHTS, load_exported
    from dflash_offline.train.checkpoint import checkpoint_damage, load_checkpoint
    from dflash_offline.target.folder import read_target

    root = Path(path)
    if root.is_file():
        raise UserError(f"--drafter {path}: a file, not a folder; give a drafter export folder (RUN/export, with "
                        "config.json + model.safetensors) or a checkpoint folder (RUN/step-N)")
    if (root / "state.json").is_file() and (root / "drafter.safetensors").is_file():
        drafter = load_checkpoint(str(root))
    elif (root / "config.json").is_file():
        what = checkpoint_damage(root, (EXPORT_WEIGHTS,))
        if what:
            raise UserError(f"{root}/{what}; the drafter export is damaged: export it again (dflash-offline export "
                            "--run RUN --to DIR) or restore the file from a copy")
        drafter = load_exported(str(root))
    else:
        raise UserError(f"--drafter {path}: neither a drafter export (config.json + model.safetensors) nor a "
                        "training checkpoint (step-N/ with state.json)")
    info = read_target(target_dir)
    cfg = drafter.cfg
    if (cfg.hidden_size, cfg.vocab_size) != (info.hidden_size, info.vocab_size) or max(cfg.target_layer_ids) >= info.num_layers:
        raise UserError(f"--drafter {path} was made for a target with hidden {cfg.hidden_size}, vocabulary "
                        f"{cfg.vocab_size} and layers {cfg.target_layer_ids}; --target {target_dir} has hidden "
                        f"{info.hidden_size}, vocabulary {info.vocab_size}, {info.num_layers} layers")
    trained_for = cfg.target or {}
    differs = [k for k in ("weights_fingerprint", "config_sha256") if trained_for.get(k) not in (None, getattr(info, k))]
    if differs:
        log.warning("--drafter %s was trained for target %r (%s differs from --target %s): its acceptance here "
                    "says little about the target it was made for", path, trained_for.get("name"), " and ".join(differs),
                    target_dir)
    drafter.load_frozen_from_target(target_dir)
    return drafter.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# The target, with a cache that can be cut back


class TargetSession:
    """One sequence (batch 1) through a transformers causal LM with its KV / recurrent cache.

    `forward` appends positions; `keep(n)` keeps only the first n of the positions the last
    forward appended. Attention layers are cropped; recurrent layers (Gated DeltaNet) are restored
    from the snapshot taken before that forward and run again over the kept tokens.
    """

    def __init__(self, model, layer_ids: list[int]):
        import torch

        self.torch = torch
        self.model = model
        self.layer_ids = list(layer_ids)
        self.device = next(model.parameters()).device
        from dflash_offline.generate.decoding import cache_argument

        self._cache_arg = cache_argument(model)
        # Any layer that is not softmax attention (Gated DeltaNet's "linear_attention", say) keeps
        # a state that cannot be cropped.
        layer_types = getattr(model.config, "layer_types", None) or []
        self.recurrent = any(t not in ("full_attention", "sliding_attention") for t in layer_types)
        self.cache = None
        self._pending: list[int] = []
        self._snapshot = None
        self.forwards = 0

    def start(self, prompt: list[int], features: bool = True):
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self._pending, self._snapshot = [], None
        return self._forward(prompt, features)

    def forward(self, tokens: list[int], features: bool = True):
        """-> (logits [T, V] float32, features [T, n*H] or None) for T new positions."""
        with self.torch.inference_mode():
            self._snapshot = _snapshot(self.cache) if self.recurrent else None
        self._pending = list(tokens)
        return self._forward(tokens, features)

    def keep(self, n: int) -> None:
        drop = len(self._pending) - n
        if drop < 0 or n < 1:
            raise ValueError(f"keep({n}) after a forward of {len(self._pending)} tokens")
        if drop == 0:
            return
        with self.torch.inference_mode():  # the cache holds inference tensors
            if not self.recurrent:
                self.cache.crop(-drop)
                return
            _restore(self.cache, self._snapshot)
        self._forward(self._pending[:n], features=False)

    def _forward(self, tokens: list[int], features: bool):
        torch = self.torch
        from dflash_offline.target.model import RawLayerOutputs

        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        # The layers' raw outputs, as extraction stores them (not `hidden_states`, whose last entry
        # is after the final norm).
        with torch.inference_mode(), RawLayerOutputs(self.model, self.layer_ids if features else []) as raw:
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: self.cache})
        self.forwards += 1
        logits = out.logits[0].float()
        return logits, (raw.features()[0] if features else None)


_STATE_ATTRS = ("conv_states", "recurrent_states")


def _snapshot(cache) -> list[dict]:
    """Copies of every recurrent layer's states and the length of every attention layer."""
    import torch

    snap, found = [], False
    for layer in cache.layers:
        entry: dict = {}
        for attr in _STATE_ATTRS:
            states = getattr(layer, attr, None)
            if isinstance(states, dict):
                entry[attr] = {k: (t.clone() if isinstance(t, torch.Tensor) else None) for k, t in states.items()}
                found = found or any(isinstance(t, torch.Tensor) for t in states.values())
        if isinstance(getattr(layer, "keys", None), torch.Tensor):
            entry["length"] = layer.get_seq_length()
        snap.append(entry)
    if not found:
        raise RuntimeError(f"{type(cache).__name__}: found no recurrent states to snapshot in a hybrid target's cache; "
                           "this transformers version stores them differently and rollback would be wrong")
    return snap


def _restore(cache, snap: list[dict]) -> None:
    import torch

    for layer, entry in zip(cache.layers, snap):
        for attr in _STATE_ATTRS:
            for k, saved in entry.get(attr, {}).items():
                states = getattr(layer, attr)
                cur = states.get(k)
                if isinstance(cur, torch.Tensor) and isinstance(saved, torch.Tensor) and cur.shape == saved.shape:
                    cur.copy_(saved)  # in place: transformers may hold this tensor's address (CUDA graphs)
                else:
                    states[k] = saved
        if "length" in entry:
            drop = layer.get_seq_length() - entry["length"]
            if drop > 0:
                layer.crop(-drop)


def load_target_for_decoding(target_dir: str, device: str, dtype: str):
    """The whole text model with its LM head, in eval mode; TF32 off so fp32 means fp32."""
    import torch

    from dflash_offline.target.folder import read_target
    from dflash_offline.target.model import load_target

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    info = read_target(target_dir)
    model = load_target(info, device, dtype, info.num_layers, need_head=True)
    return model, info


# ----------------------------------------------------------------------------------------------
# Proposers: who drafts the block


class Proposer(Protocol):
    block_size: int

    def start(self, prompt: list[int], features) -> None:
        """A new sequence: the prompt and the target's features at its positions."""

    def propose(self, tokens: list[int]) -> list[int]:
        """block_size - 1 draft tokens following `tokens` (committed so far; the last is the anchor)."""

    def observe(self, features) -> None:
        """Features of the newly committed positions (the anchor and the accepted drafts)."""


class DFlashProposer:
    """The trained drafter, with its context keys/values cached per committed position."""

    def __init__(self, drafter, device: str, dtype: str = "float32"):
        import torch

        self.torch = torch
        self.drafter = drafter.to(device=device, dtype=getattr(torch, dtype))
        self.device = device
        self.block_size = drafter.cfg.block_size
        self.mask_id = drafter.cfg.mask_token_id
        self.kv: list | None = None
        self.length = 0

    def start(self, prompt: list[int], features) -> None:
        self.kv, self.length = None, 0
        self.observe(features)

    def observe(self, features) -> None:
        torch = self.torch
        T = features.shape[0]
        pos = torch.arange(self.length, self.length + T, device=self.device)[None]
        new = self.drafter.context_kv(features[None].to(self.device), pos)
        self.kv = new if self.kv is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                               for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.length += T

    def propose(self, tokens: list[int]) -> list[int]:
        torch = self.torch
        B, anchor = self.block_size, len(tokens) - 1
        if anchor != self.length:
            raise RuntimeError(f"drafter context holds {self.length} positions but the anchor is at {anchor}")
        block = torch.tensor([[tokens[-1]] + [self.mask_id] * (B - 1)], device=self.device)
        pos = torch.arange(anchor, anchor + B, device=self.device)[None]
        h = self.drafter.draft_hidden(self.kv, block, pos)
        logits = self.torch.nn.functional.linear(h[0, 1:], self.drafter.lm_head.weight.to(h.dtype))
        return logits.argmax(-1).tolist()


# ----------------------------------------------------------------------------------------------
# Decoding


@dataclass
class Decoded:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted in each verify round
    seconds: float = 0.0
    target_forwards: int = 0


def _done(out: list[int], max_new: int, eos: set[int]) -> bool:
    return len(out) >= max_new or (bool(out) and out[-1] in eos)


def greedy_decode(target: TargetSession, prompt: list[int], max_new: int, eos: set[int]) -> Decoded:
    """The target alone, one token per forward: the reference output and the baseline speed."""
    t0 = time.perf_counter()
    target.forwards = 0
    logits, _ = target.start(prompt, features=False)
    out = [int(logits[-1].argmax())]
    while not _done(out, max_new, eos):
        logits, _ = target.forward([out[-1]], features=False)
        out.append(int(logits[-1].argmax()))
    return Decoded(out, seconds=time.perf_counter() - t0, target_forwards=target.forwards)


def speculative_decode(target: TargetSession, proposer, prompt: list[int], max_new: int, eos: set[int]) -> Decoded:
    """Greedy speculative decoding of one prompt (module docstring). Output = greedy_decode's."""
    t0 = time.perf_counter()
    target.forwards = 0
    logits, feats = target.start(prompt)
    proposer.start(prompt, feats)
    seq = list(prompt) + [int(logits[-1].argmax())]
    out = seq[len(prompt):]
    accepted = []
    while not _done(out, max_new, eos):
        draft = proposer.propose(seq)
        logits, feats = target.forward([seq[-1]] + draft)
        best = logits.argmax(-1).tolist()  # best[j]: the target's token after block position j
        a = 0
        while a < len(draft) and draft[a] == best[a]:
            a += 1
        accepted.append(a)
        target.keep(a + 1)
        proposer.observe(feats[: a + 1])
        for tok in draft[:a] + [best[a]]:
            seq.append(tok)
            out.append(tok)
            if _done(out, max_new, eos):
                break
    return Decoded(out, accepted, time.perf_counter() - t0, target.forwards)


def summarize(runs: list[Decoded], block_size: int) -> dict:
    acc = np.asarray([a for r in runs for a in r.accepted], np.int64)
    rounds = int(acc.shape[0])
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    # Each prompt's own tau (prompts decoded without a round, a first token that ends the output,
    # have none): the reference DFlash benchmark averages these, where `tau` pools all rounds.
    per_prompt = [float(np.mean(np.asarray(r.accepted) + 1)) for r in runs if r.accepted]
    return {
        "rounds": rounds, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
        "tau": float((acc + 1).mean()) if rounds else float("nan"),
        "tau_per_prompt_mean": float(np.mean(per_prompt)) if per_prompt else float("nan"),
        "tau_per_prompt": per_prompt,
        # Share of rounds in which draft slot j (1..B-1) was accepted.
        "accept_rate": [float((acc >= j).mean()) if rounds else 0.0 for j in range(1, block_size)],
        "target_forwards": sum(r.target_forwards for r in runs),
    }


# ----------------------------------------------------------------------------------------------
# Acceptance from the cache


def cache_layer_columns(manifest: dict, drafter_cfg, cache: str) -> list[int] | None:
    """Where the drafter's layers sit on the cache's layer axis (hidden is [tokens, n, H]), in the
    drafter's order (its fc reads them concatenated in that order); None when the drafter reads
    every captured layer in the cache's order. A drafter trained on a subset of the captured
    layers (`train --layers`) is scored on those columns; a layer the cache lacks is refused."""
    have = [int(i) for i in manifest["capture"]["layer_ids"]]
    want = [int(i) for i in drafter_cfg.target_layer_ids]
    missing = [i for i in want if i not in have]
    if missing:
        raise UserError(f"--cache {cache} holds layers {have} but the drafter reads {want} (no {missing}); "
                        "extract the held-out cache with the drafter's layers")
    t = manifest["target"]
    if (t["hidden_size"], t["vocab_size"]) != (drafter_cfg.hidden_size, drafter_cfg.vocab_size):
        raise UserError(f"--cache {cache} was made from a target of hidden {t['hidden_size']} and vocabulary "
                        f"{t['vocab_size']}; the drafter has {drafter_cfg.hidden_size} and {drafter_cfg.vocab_size}")
    return None if want == have else [have.index(i) for i in want]


def _select_layers(target_hidden, columns: list[int] | None, num_layers: int):
    """[R, S, n*H] with all captured layers -> [R, S, len(columns)*H] with the drafter's."""
    if columns is None:
        return target_hidden
    R, S, width = target_hidden.shape
    return target_hidden.view(R, S, num_layers, width // num_layers)[:, :, columns].reshape(R, S, -1)


def cache_acceptance(cache: str, drafter, device: str, seq_len: int, num_anchors: int,
                     max_rows: int | None = None, seed: int = 0, loss_chunk_tokens: int = 4096) -> dict:
    """tau and per-slot top-1 accuracy of `drafter` on a cache's samples, packed as in training
    (rows of seq_len, num_anchors random blocks per row, fixed seed), scored against the data."""
    import torch

    from dflash_offline.drafter import masks
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.train.loss import block_loss, block_metrics
    from dflash_offline.train.packing import epoch_order, pack_rows
    from dflash_offline.train.stream import RowStream, device_hidden, make_loader

    reader = CacheReader(cache)
    m = reader.manifest
    cfg = drafter.cfg
    columns = cache_layer_columns(m, cfg, cache)
    n_cached = len(m["capture"]["layer_ids"])
    refs, lengths = [], []
    for name in reader.shard_names:
        sh = reader.shard(name)
        lengths.extend((sh.offsets[1:] - sh.offsets[:-1]).tolist())
        refs.extend((name, k, int(sh.offsets[k])) for k in range(len(sh)))
    lengths = np.asarray(lengths, np.int64)
    rows = len(pack_rows(lengths, epoch_order(len(refs), seed, 0), seq_len))
    steps = rows if max_rows is None else min(rows, max_rows)
    B = cfg.block_size
    # The stream reads every captured layer (its rows are [S, n*H] of the cache's n); the
    # drafter's columns are picked on the device.
    spec = {"seed": seed, "seq_len": seq_len, "num_anchors": num_anchors, "block_size": B,
            "mask_token_id": cfg.mask_token_id, "gamma": 1.0, "hidden_size": cfg.hidden_size,
            "num_layers": n_cached, "hidden_dtype": m["capture"]["hidden_dtype"]}
    stream = RowStream(cache, refs, lengths, spec, 0, 0, 1, 1, 0, steps)
    drafter = drafter.to(device)
    cuda = str(device).startswith("cuda")
    total: dict | None = None
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.no_grad():
            build = masks.flex_block_mask if cuda else masks.dense_mask
            for mb in make_loader(stream, 0, 1, pin=False):
                mb = device_hidden({k: v.to(device) for k, v in mb.items()})
                hidden = _select_layers(mb["target_hidden"], columns, n_cached)
                mask = build(mb["doc_ids"], mb["anchors"], mb["anchor_valid"], B)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                    h = drafter(hidden, mb["block_ids"], mb["ctx_positions"], mb["block_positions"], mask)
                    _, correct = block_loss(h, drafter.lm_head.weight, mb["labels"], mb["weights"], loss_chunk_tokens)
                got = block_metrics(correct, mb["weights"], mb["anchor_valid"], B)
                total = got if total is None else {k: total[k] + got[k] for k in got}
    finally:
        drafter.train(was_training)
    if total is None or float(total["blocks"]) == 0:
        raise UserError(f"--cache {cache}: no valid draft block (no two consecutive loss-mask tokens)")
    cnt = total["slot_count"].cpu().numpy()
    acc = np.where(cnt > 0, total["slot_correct"].cpu().numpy() / np.maximum(cnt, 1), 0.0)
    return {"rows": steps, "blocks": int(total["blocks"]), "tau": float(total["tau_sum"] / total["blocks"]),
            "slot_accuracy": [float(a) for a in acc[1:]]}


# ----------------------------------------------------------------------------------------------
# The walk: decoding's blocks, picked out of every anchor's score


def walk_rounds(accepted, length: int) -> list[int]:
    """The accepted drafts of each round greedy speculative decoding makes over one completion.

    accepted[i]: how many drafts the block anchored at completion token i gets accepted (i = 0 is
    the first completion token, which the prompt's forward produces and the first block drafts
    from); needed for i < length - 1. length: the output length at which decoding stops
    (max_new_tokens, or 1 + the index of the first end-of-sequence token if that is smaller).
    Mirrors `speculative_decode` and `_done`: the output starts with one token; each round drafts
    from the last committed token, records its a and commits a + 1 tokens, and decoding stops as
    soon as the output holds `length` tokens, mid-round if need be (the round still records its
    whole a, as the decoder's `accepted` list does)."""
    if length > 1 and len(accepted) < length - 1:
        raise ValueError(f"walk_rounds: {len(accepted)} anchors for an output of {length} tokens "
                         f"(need {length - 1})")
    rounds, n = [], 1
    while n < length:
        a = int(accepted[n - 1])
        rounds.append(a)
        n += a + 1
    return rounds


@dataclass
class _ContextRow:
    """One packed row of whole samples and the acceptance of every candidate anchor in it."""

    spans: list[tuple[int, int, int]]  # (sample index, first row position, kept length)
    loss_mask: np.ndarray  # uint8 [S]
    accepted: np.ndarray  # int64 [S]: accepted drafts of the block anchored there (candidates only)


def walk_acceptance(cache: str, drafter, device, max_samples: int | None = None, max_new: int | None = None,
                    seq_len: int | None = None, anchors_per_row: int = 512, batch_rows: int = 4,
                    per_sample: bool = False, loss_chunk_tokens: int = 4096) -> dict:
    """Acceptance of `drafter` on a cache's samples as greedy speculative decoding would see it.

    For each sample (the first `max_samples` in manifest order): every candidate anchor p
    (loss_mask[p] and loss_mask[p + 1] set) is scored, accepted(p) = the leading run of slots
    j = 1..B-1 whose argmax equals the data token at p + j (a slot past the sample's end or on an
    unscored token is a miss). Then the walk (`walk_rounds`) from the first completion token p0:
    a = accepted(p), one round, p += a + 1, until the output reaches the completion length (the
    loss_mask-1 tokens from p0 on; capped at `max_new`).

    For the target's own greedy completions (fp32) this is the decoding tau of the same prompts
    with max_new_tokens = the completion length, without running the target, except in each
    sample's last round: decoding verifies all B-1 drafts even past max_new_tokens, where the data
    has no tokens, so a last round that would accept beyond the data's end scores lower here. With
    `max_new` at least B - 1 below the completion lengths that difference is gone. The drafter sees
    the cache's stored (bf16 or fp8) features where decoding gives it the target's own.

    -> {tau_pooled: sum of (a + 1) over all rounds / rounds (summarize's tau), tau_per_prompt_mean:
    the mean over samples of each one's own tau, rounds, samples (walked: at least one round),
    samples_skipped (completion of at most one token: no round), accept_rate[j-1] (share of
    rounds accepting slot j), anchors and tau_all_anchors (mean of 1 + accepted over every
    candidate anchor: the random-anchor estimate without sampling noise), slot_accuracy[j-1] over
    every anchor, seq_len, truncated_samples, seconds; with per_sample, per_sample: [{id,
    accepted}] in cache order}.

    Samples are packed into rows of `seq_len` (default: the longest sample; a longer one is cut,
    and counted in truncated_samples); a row's anchors go `anchors_per_row` at a time, `batch_rows`
    such blocks of anchors (each with its row's context) per forward. Shapes are the same for every
    forward of a call (flex compiles once). Runs in-process without grad; a drafter in train mode
    is switched to eval and back (the trainer can call this on a held-out cache)."""
    import torch

    from dflash_offline.drafter import masks
    from dflash_offline.cache.fp8 import DTYPE_NAME as FP8
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.train.loss import block_loss
    from dflash_offline.train.packing import build_row, loss_weights, pack_rows
    from dflash_offline.train.stream import device_hidden

    t0 = time.time()
    device = str(device)
    cuda = device.startswith("cuda")
    if anchors_per_row < 1 or batch_rows < 1:
        raise ValueError(f"walk_acceptance: anchors_per_row {anchors_per_row} and batch_rows {batch_rows} must be positive")
    reader = CacheReader(cache)
    m = reader.manifest
    cfg = drafter.cfg
    B = cfg.block_size
    columns = cache_layer_columns(m, cfg, cache)
    fp8 = m["capture"]["hidden_dtype"] == FP8
    refs: list[tuple[str, int, int, int]] = []  # (shard, first token, length, sample id)
    for name in reader.shard_names:
        sh = reader.shard(name)
        for k in range(len(sh)):
            refs.append((name, int(sh.offsets[k]), int(sh.offsets[k + 1] - sh.offsets[k]), int(sh.ids[k])))
    if max_samples is not None:
        refs = refs[:max_samples]
    if not refs:
        raise UserError(f"--cache {cache}: no samples to walk")
    lengths = np.asarray([r[2] for r in refs], np.int64)
    S = int(seq_len) if seq_len else int(lengths.max())
    A = max(1, min(anchors_per_row, S - 1))  # a row has at most S - 1 candidates
    # Every candidate of a row: build_row takes all of them, sorted, when asked for at least as
    # many blocks as the row has positions.
    weights = loss_weights(B, 1.0)
    rng = np.random.default_rng(0)

    def read(ref, keep):
        shard, a, _, sid = ref
        try:
            g = reader.shard(shard).group
            ids, lm, bits = g["input_ids"][a:a + keep], g["loss_mask"][a:a + keep], g["hidden"][a:a + keep]
            scale = g["hidden_scale"][a:a + keep] if fp8 else None
        except Exception as e:  # never score (or skip) unreadable data silently
            raise RuntimeError(f"cache {cache}: shard {shard}, sample id {sid} is unreadable "
                               f"({type(e).__name__}: {e}); check the cache with `dflash-offline verify`") from None
        if columns is not None:
            bits = bits[:, columns]
            scale = scale[:, columns] if fp8 else None
        return ids.astype(np.int64), lm, bits, scale

    ctx_rows: list[_ContextRow] = []
    pending: list[tuple[int, dict]] = []  # (context row, arrays of one block of anchors)
    slot_hit = np.zeros(B - 1, np.float64)
    slot_count = np.zeros(B - 1, np.float64)
    anchor_acc: list[np.ndarray] = []
    was_training = drafter.training
    drafter = drafter.to(device)
    drafter.eval()
    build = masks.flex_block_mask if cuda else masks.dense_mask

    def forward(batch: list[tuple[int, dict]]) -> None:
        # On CUDA the batch is padded with anchorless rows: one shape for every forward.
        R = batch_rows if cuda else len(batch)
        arr = {k: np.stack([b[k] for _, b in batch] + [np.zeros_like(batch[0][1][k])] * (R - len(batch)))
               for k in batch[0][1]}
        t = {k: torch.from_numpy(v) for k, v in arr.items()}
        if fp8:  # dequantised on the device, as in training
            t["target_hidden_bits"], t["target_hidden_scale"] = t.pop("bits"), t.pop("scale")
        else:
            t["target_hidden"] = t.pop("bits").view(torch.bfloat16)
        t = device_hidden({k: v.to(device) for k, v in t.items()})
        mask = build(t["doc_ids"], t["anchors"], t["anchor_valid"], B)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            h = drafter(t["target_hidden"], t["block_ids"], t["positions"], t["block_positions"], mask)
            _, correct = block_loss(h, drafter.lm_head.weight, t["labels"], t["weights"], loss_chunk_tokens)
        # block_metrics' rule: a slot counts when its argmax is the label and it is scored
        # (inside the sample, on a loss-mask token); an unscored slot ends the run.
        scored = (t["weights"] > 0).view(R, A, B)[:, :, 1:]
        hit = correct.view(R, A, B)[:, :, 1:] & scored
        acc = torch.cumprod(hit.to(torch.int32), dim=2).sum(dim=2).cpu().numpy()
        valid = t["anchor_valid"]
        slot_hit[:] += hit[valid].sum(0).double().cpu().numpy()
        slot_count[:] += scored[valid].sum(0).double().cpu().numpy()
        for i, (r, b) in enumerate(batch):
            v = b["anchor_valid"]
            ctx_rows[r].accepted[b["anchors"][v]] = acc[i][v]
            anchor_acc.append(acc[i][v])

    try:
        with torch.no_grad():
            n_layers = len(cfg.target_layer_ids)
            for packed in pack_rows(lengths, np.arange(len(refs)), S):
                bits = np.zeros((S, n_layers, cfg.hidden_size), np.uint8 if fp8 else np.uint16)
                scale = np.zeros((S, n_layers), np.float32) if fp8 else None
                ids, lms, spans, at = [], [], [], 0
                for s, keep in packed:
                    i, lm, hb, sc = read(refs[s], keep)
                    bits[at:at + keep] = hb
                    if fp8:
                        scale[at:at + keep] = sc
                    ids.append(i)
                    lms.append(lm)
                    spans.append((s, at, keep))
                    at += keep
                row = build_row(ids, lms, S, S, B, cfg.mask_token_id, weights, rng)
                r = len(ctx_rows)
                ctx_rows.append(_ContextRow(spans, row.loss_mask, np.zeros(S, np.int64)))
                n_cand = int(row.anchor_valid.sum())
                per_block = {k: getattr(row, k).reshape(S, B) for k in ("block_ids", "block_positions", "labels", "weights")}
                for lo in range(0, n_cand, A):
                    hi = min(lo + A, n_cand)
                    part = {"bits": bits.reshape(S, -1), "doc_ids": row.doc_ids, "positions": row.positions,
                            "anchors": _pad(row.anchors[lo:hi], A, 0), "anchor_valid": _pad(row.anchor_valid[lo:hi], A, False)}
                    if fp8:
                        part["scale"] = scale
                    for k, v in per_block.items():
                        part[k] = _pad(v[lo:hi], A, cfg.mask_token_id if k == "block_ids" else 0).reshape(-1)
                    pending.append((r, part))
                    if len(pending) == batch_rows:
                        forward(pending)
                        pending = []
            if pending:
                forward(pending)
    finally:
        drafter.train(was_training)

    rounds_of: list[tuple[int, list[int]]] = []
    skipped = 0
    for row in ctx_rows:
        for s, at, keep in row.spans:
            lm = row.loss_mask[at:at + keep]
            ones = np.flatnonzero(lm)
            if not ones.size:
                skipped += 1
                continue
            p0 = at + int(ones[0])
            length = int(lm[ones[0]:].sum())
            if max_new is not None:
                length = min(length, max_new)
            got = walk_rounds(row.accepted[p0:at + keep], length)
            if got:
                rounds_of.append((s, got))
            else:
                skipped += 1
    if not rounds_of:
        raise UserError(f"--cache {cache}: no sample with a completion of two tokens or more to walk")
    rounds_of.sort()
    flat = np.asarray([a for _, r in rounds_of for a in r], np.int64)
    every = np.concatenate(anchor_acc) if anchor_acc else np.zeros(0, np.int64)
    out = {
        "samples": len(rounds_of), "samples_skipped": skipped, "rounds": int(flat.size),
        "tau_pooled": float((flat + 1).mean()),
        "tau_per_prompt_mean": float(np.mean([np.mean(np.asarray(r) + 1) for _, r in rounds_of])),
        "accept_rate": [float((flat >= j).mean()) for j in range(1, B)],
        "anchors": int(every.size),
        "tau_all_anchors": float((every + 1).mean()) if every.size else float("nan"),
        "slot_accuracy": [float(h / c) if c else 0.0 for h, c in zip(slot_hit, slot_count)],
        "seq_len": S, "truncated_samples": int((lengths > S).sum()), "max_new": max_new,
        "seconds": time.time() - t0,
    }
    if per_sample:
        out["per_sample"] = [{"id": refs[s][3], "accepted": r} for s, r in rounds_of]
    return out


def _pad(x: np.ndarray, n: int, value) -> np.ndarray:
    """x padded along its first axis to n entries of `value`."""
    if x.shape[0] == n:
        return x
    pad = np.full((n - x.shape[0],) + x.shape[1:], value, x.dtype)
    return np.concatenate([x, pad])


# ----------------------------------------------------------------------------------------------
# The command


def _check_cache_target(cache: str, target: str) -> None:
    """--cache must hold the completions of --target, the model whose features it stores: another
    target's cache would score the drafter on features it never sees when serving."""
    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore
    from dflash_offline.target.folder import read_target

    try:
        m = ManifestStore(Location(cache)).read()
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"--cache {cache}: unreadable manifest ({type(e).__name__}: {e})") from None
    if m is None:
        raise UserError(f"--cache {cache}: no cache there (no manifest.json); extract the held-out completions into it")
    info = read_target(target)
    if m.get("target", {}).get("weights_fingerprint") != info.weights_fingerprint:
        raise UserError(f"--cache {cache} was extracted from another target than --target {target}; give the cache "
                        "of this target's completions (or the target the cache was made from)")


def run(cfg: EvalConfig) -> dict:
    from dflash_offline.runtime.launch import check_devices_exist, parse_devices
    from dflash_offline.runtime.logs import open_process_log

    cfg.validate()
    require_kind(cfg.cache, "--cache", True, "a cache folder (the one with manifest.json)")
    require_kind(cfg.prompts, "--prompts", False, "a Parquet file with an input_ids column")
    require_kind(cfg.reference, "--reference", False, "a Parquet file of the target's greedy completions")
    require_kind(cfg.json_path, "--json", False, "a file name for the JSON report")
    check_report_dest(cfg.json_path)
    if cfg.cache:
        _check_cache_target(cfg.cache, cfg.target)
    first = Path(cfg.drafters[0]).absolute()
    open_process_log(first.parent / "logs", "eval")
    devices = parse_devices(cfg.device)
    if len(devices) != 1:
        raise UserError(f"--device {cfg.device}: eval runs on one device (e.g. 0 or cpu)")
    device = devices[0]
    check_devices_exist(devices)
    import torch

    from dflash_offline.runtime.launch import single_thread_compute

    single_thread_compute()
    drafters = [(p, load_drafter(p, cfg.target)) for p in cfg.drafters]  # all refused before any decoding
    report: dict = {"format": REPORT_FORMAT, "target": str(Path(cfg.target).absolute()), "device": device, "dtype": cfg.dtype,
                    "torch": torch.__version__,
                    "drafters": [{"path": str(p), "block_size": d.cfg.block_size} for p, d in drafters]}
    if cfg.prompts:
        _decode_all(cfg, drafters, device, report)
    if cfg.cache:
        report["cache"] = str(cfg.cache)
        for i, (path, d) in enumerate(drafters):
            walk = walk_acceptance(cfg.cache, d, device, cfg.max_samples, batch_rows=cfg.walk_batch_rows)
            log.info("cache walk for %s: tau %.3f pooled, %.3f per-prompt mean, over %d rounds of %d samples (%.1fs)",
                     path, walk["tau_pooled"], walk["tau_per_prompt_mean"], walk["rounds"], walk["samples"],
                     walk["seconds"])
            report["drafters"][i]["cache_walk"] = walk
            t0 = time.time()
            est = cache_acceptance(cfg.cache, d, device, cfg.seq_len, cfg.num_anchors, cfg.max_rows)
            log.info("cache estimate for %s: tau %.3f over %d random blocks (%.1fs)", path, est["tau"], est["blocks"],
                     time.time() - t0)
            report["drafters"][i]["cache_estimate"] = est
            if cfg.parity:
                from dflash_offline.evaluate.parity import check_parity

                report["drafters"][i]["parity"] = check_parity(cfg.target, d, cfg.cache, cfg.parity, device, cfg.dtype)
    print(format_report(report), flush=True)
    if cfg.json_path:
        tmp = Path(f"{cfg.json_path}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, cfg.json_path)  # whole or not at all
        print(f"json: {cfg.json_path}")
    return report


def _decode_all(cfg: EvalConfig, drafters, device: str, report: dict) -> None:
    from tqdm import tqdm

    from dflash_offline.target.folder import read_target

    # Inputs are checked before the target loads: a bad prompt or reference file costs nothing.
    tinfo = read_target(cfg.target)
    ids, prompts = read_prompts(cfg.prompts, tinfo.vocab_size, cfg.max_prompts)
    longest = max(range(len(prompts)), key=lambda k: len(prompts[k]))
    if tinfo.max_positions is not None and len(prompts[longest]) + cfg.max_new_tokens > tinfo.max_positions:
        raise UserError(f"--prompts {cfg.prompts}: row {longest}: a prompt of {len(prompts[longest])} tokens + "
                        f"--max-new-tokens {cfg.max_new_tokens} exceeds the target's context ({tinfo.max_positions} "
                        "positions); lower --max-new-tokens or leave out the longest prompts")
    eos = set() if cfg.ignore_eos else eos_ids(cfg.target)
    reference = read_reference(cfg.reference, ids, prompts, cfg.max_new_tokens, eos) if cfg.reference else None
    # With a reference the target-alone decode (as long as the speculative one) is needed only for
    # the speed-up figure, so it runs only when asked for.
    baseline = cfg.baseline if cfg.baseline is not None else not cfg.reference
    model, info = load_target_for_decoding(cfg.target, device, cfg.dtype)
    log.info("decoding %d prompts, up to %d new tokens, eos %s, %s on %s", len(prompts), cfg.max_new_tokens,
             sorted(eos), cfg.dtype, device)
    report.update({"prompts": str(cfg.prompts), "num_prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
                   "eos": sorted(eos), "hybrid_target": info.hybrid,
                   "lossless_against": str(cfg.reference) if cfg.reference else ("baseline" if baseline else None)})
    layer_sets = {tuple(d.cfg.target_layer_ids) for _, d in drafters}
    sessions = {ls: TargetSession(model, list(ls)) for ls in layer_sets}
    any_session = next(iter(sessions.values()))
    # Also in the log, every tenth of the prompts: a long decode without a progress bar
    # (--no-progress, a batch job) still shows how far it got.
    every = max(1, len(prompts) // 10)
    if baseline:
        runs = []
        for k, p in enumerate(tqdm(prompts, desc="target alone", unit="prompt", disable=not cfg.progress), 1):
            runs.append(greedy_decode(any_session, p, cfg.max_new_tokens, eos))
            if k % every == 0 or k == len(prompts):
                log.info("target alone: %d/%d prompts, %.1f tokens/s", k, len(prompts),
                         sum(len(r.tokens) for r in runs) / max(sum(r.seconds for r in runs), 1e-9))
        report["baseline"] = {k: v for k, v in summarize(runs, 2).items() if k in ("tokens", "seconds", "tokens_per_s", "target_forwards")}
        if reference is None:
            reference = [r.tokens for r in runs]
        else:
            # Both given: a baseline that differs from the reference says the reference is not this
            # target's greedy decode in this dtype, rather than the drafter path being wrong.
            report["baseline"]["mismatched_reference_ids"] = [ids[k] for k, (r, ref) in enumerate(zip(runs, reference))
                                                              if r.tokens != ref]
    report["batch_size"] = cfg.batch_size
    for i, (path, drafter) in enumerate(drafters):
        bar = tqdm(total=len(prompts), desc=f"speculative {Path(path).name}", unit="prompt", disable=not cfg.progress)
        done: list[Decoded] = []

        def progress(new: list[Decoded]) -> None:
            done.extend(new)
            acc = [a for r in done for a in r.accepted]
            bar.update(len(new))
            bar.set_postfix_str(f"tau {1 + np.mean(acc):.2f}" if acc else "")
            if len(done) % every < len(new) or len(done) == len(prompts):
                log.info("speculative %s: %d/%d prompts, tau so far %.3f", path, len(done), len(prompts),
                         1 + np.mean(acc) if acc else float("nan"))

        if cfg.batch_size > 1:
            from dflash_offline.evaluate.batched import BatchDFlashProposer, batched_speculative_decode

            runs = batched_speculative_decode(model, BatchDFlashProposer(drafter, device, cfg.dtype),
                                              drafter.cfg.target_layer_ids, prompts, cfg.max_new_tokens, eos,
                                              cfg.batch_size, on_batch=progress)
        else:
            proposer = DFlashProposer(drafter, device, cfg.dtype)
            session = sessions[tuple(drafter.cfg.target_layer_ids)]
            runs = []
            for p in prompts:
                runs.append(speculative_decode(session, proposer, p, cfg.max_new_tokens, eos))
                progress(runs[-1:])
        bar.close()
        e = report["drafters"][i]
        e.update(summarize(runs, drafter.cfg.block_size))
        if reference is not None:
            bad = [ids[k] for k, (r, ref) in enumerate(zip(runs, reference)) if r.tokens != ref]
            e["lossless"] = not bad
            e["mismatched_prompt_ids"] = bad
            if "baseline" in report and cfg.batch_size == 1:  # batched tokens/s against one-prompt: no like for like
                e["speedup"] = e["tokens_per_s"] / report["baseline"]["tokens_per_s"]
            if bad:
                log.error("%s: %d of %d outputs differ from the target's greedy decode%s (ids %s)", path, len(bad),
                          len(runs), f" in {cfg.reference}" if cfg.reference else "", bad[:10])
        log.info("%s: tau %.3f over %d rounds, %.1f tokens/s", path, e["tau"], e["rounds"], e["tokens_per_s"])


def format_report(report: dict) -> str:
    lines = []
    if "num_prompts" in report:
        base, against = report.get("baseline"), report.get("lossless_against")
        checked = ("; no baseline (not checked)" if not against else "" if against == "baseline"
                   else f"; lossless (against {against})" + ("" if base else ", no baseline decode (no speed-up)"))
        lines.append(f"speculative decoding: {report['num_prompts']} prompts, up to {report['max_new_tokens']} new tokens, "
                     f"{report['dtype']} on {report['device']}"
                     + (f", {report['batch_size']} prompts per forward" if report.get("batch_size", 1) > 1 else "")
                     + (f"; target alone {base['tokens_per_s']:.1f} tokens/s" if base else "") + checked)
        lines.append(f"{'drafter':<40} {'block':>5} {'tau':>6} {'/prompt':>7} {'rounds':>7} {'tok/s':>8} {'speedup':>7} "
                     f"{'lossless':>8}")
        for e in report["drafters"]:
            if "tau" not in e:
                continue
            lossless = "-" if "lossless" not in e else ("yes" if e["lossless"] else f"NO ({len(e['mismatched_prompt_ids'])})")
            speed = f"{e['speedup']:.2f}x" if "speedup" in e else "-"
            lines.append(f"{_short(e['path']):<40} {e['block_size']:>5} {e['tau']:>6.3f} "
                         f"{e.get('tau_per_prompt_mean', float('nan')):>7.3f} {e['rounds']:>7} "
                         f"{e['tokens_per_s']:>8.1f} {speed:>7} {lossless:>8}")
            lines.append("  accepted per slot: " + " ".join(f"{a:.2f}" for a in e["accept_rate"]))
    if any("cache_walk" in e or "cache_estimate" in e for e in report["drafters"]):
        lines.append(f"estimate from the cache {report.get('cache')}:")
        lines.append("  walk: tau over the blocks decoding would draft, pooled over rounds (/sample: mean of the "
                     "samples' taus); every: over all anchors; random: over random anchors of packed rows")
        lines.append(f"{'drafter':<40} {'block':>5} {'walk':>6} {'/sample':>7} {'rounds':>7} {'every':>6} "
                     f"{'random':>6} {'blocks':>7}  slot accuracy")
        for e in report["drafters"]:
            walk, est = e.get("cache_walk") or {}, e.get("cache_estimate") or {}
            num = lambda d, k, f: format(d[k], f) if k in d else "-"  # noqa: E731
            lines.append(f"{_short(e['path']):<40} {e['block_size']:>5} {num(walk, 'tau_pooled', '6.3f'):>6} "
                         f"{num(walk, 'tau_per_prompt_mean', '7.3f'):>7} {num(walk, 'rounds', 'd'):>7} "
                         f"{num(walk, 'tau_all_anchors', '6.3f'):>6} {num(est, 'tau', '6.3f'):>6} "
                         f"{num(est, 'blocks', 'd'):>7}  "
                         + " ".join(f"{a:.2f}" for a in (walk or est).get("slot_accuracy", [])[:8]))
    for e in report["drafters"]:
        if "parity" in e:
            from dflash_offline.evaluate.parity import format_parity

            lines += format_parity(_short(e["path"]), e["parity"])
    return "\n".join(lines)


def _short(path: str, width: int = 40) -> str:
    return path if len(path) <= width else "..." + path[-(width - 3):]
