"""`dflash-offline eval`: how many tokens a drafter saves, measured two ways.

1. **Speculative decoding against the target** (`--prompts`): greedy, batch 1, per round
   (dflash-method.md, "Inference"): the drafter drafts one block from the last committed token
   over its cached context features; the target verifies the block in one forward; the agreeing
   prefix plus one target token is committed; both caches are cut back to the committed length.
   A hybrid target's Gated DeltaNet state cannot be cut back, so it is restored from a snapshot
   taken before the verify forward and advanced over the committed tokens by one more forward.
   Every output is checked against the target's own greedy decode of the same prompt (lossless),
   and decode speed is measured against that plain decode, prompt by prompt, in one run.
2. **Acceptance from the cache** (`--cache`): the same leading-correct-slots rule as the training
   metrics, on held-out cache samples, without running the target: quick comparison of
   checkpoints. With self-generated completions the data tokens are the target's greedy tokens.
   It runs above the decoding tau (pycode: 2.27 against 1.69): random anchors weigh every position
   alike, while decoding starts each block where the last one ended, so it spends few blocks on
   easy stretches and many on hard ones. Use it to rank checkpoints, not as the decoding figure.

tau = tokens committed per verify round = 1 + accepted drafts (dflash-method.md).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from .config import EvalConfig
from pathlib import Path
from typing import Protocol

import numpy as np

from .model_folder import eos_ids
from .runtime import UserError

log = logging.getLogger("dflash.eval")


# ----------------------------------------------------------------------------------------------
# Inputs


def read_prompts(path: str, vocab_size: int, max_prompts: int | None = None) -> tuple[list[int], list[list[int]]]:
    """(ids, prompts) from a Parquet file with `input_ids` (and optional `id`); one line per problem."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--prompts {path}: no such file (expected a Parquet file with an input_ids column)")
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise UserError(f"--prompts {path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    if "input_ids" not in table.column_names:
        raise UserError(f"--prompts {path}: no input_ids column (columns: {', '.join(table.column_names)})")
    prompts = table.column("input_ids").to_pylist()
    ids = table.column("id").to_pylist() if "id" in table.column_names else list(range(len(prompts)))
    if max_prompts is not None:
        prompts, ids = prompts[:max_prompts], ids[:max_prompts]
    for row, toks in enumerate(prompts):
        if not toks:
            raise UserError(f"--prompts {path}: row {row} is empty; every prompt needs at least one token")
        bad = next((t for t in toks if not 0 <= int(t) < vocab_size), None)
        if bad is not None:
            raise UserError(f"--prompts {path}: row {row} holds token id {bad}, outside the target's vocabulary "
                            f"(0..{vocab_size - 1}); tokenize with the target's tokenizer")
    return [int(i) for i in ids], [[int(t) for t in toks] for toks in prompts]


def load_drafter(path: str, target_dir: str):
    """A drafter from an export folder (config.json) or a training checkpoint (step-N/), with the
    target's frozen embedding and LM head; refuses a drafter made for another target shape."""
    from .drafter import load_checkpoint, load_exported
    from .model_folder import read_target

    root = Path(path)
    if (root / "state.json").is_file() and (root / "drafter.safetensors").is_file():
        drafter = load_checkpoint(str(root))
    elif (root / "config.json").is_file():
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
        from .decoding import cache_argument

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
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, output_hidden_states=features, **{self._cache_arg: self.cache})
        self.forwards += 1
        logits = out.logits[0].float()
        feats = None
        if features:
            # Output of decoder layer i is hidden_states[i + 1] (index 0 is the embedding).
            feats = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        return logits, feats


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

    from .model_folder import read_target
    from .target import load_target

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
    return {
        "rounds": rounds, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
        "tau": float((acc + 1).mean()) if rounds else float("nan"),
        # Share of rounds in which draft slot j (1..B-1) was accepted.
        "accept_rate": [float((acc >= j).mean()) if rounds else 0.0 for j in range(1, block_size)],
        "target_forwards": sum(r.target_forwards for r in runs),
    }


# ----------------------------------------------------------------------------------------------
# Acceptance from the cache


def cache_acceptance(cache: str, drafter, device: str, seq_len: int, num_anchors: int,
                     max_rows: int | None = None, seed: int = 0, loss_chunk_tokens: int = 4096) -> dict:
    """tau and per-slot top-1 accuracy of `drafter` on a cache's samples, packed as in training
    (rows of seq_len, num_anchors random blocks per row, fixed seed), scored against the data."""
    import torch

    from . import masks
    from .cache.reader import CacheReader
    from .loss import block_loss, block_metrics
    from .packing import epoch_order, pack_rows
    from .stream import RowStream, device_hidden, make_loader

    reader = CacheReader(cache)
    m = reader.manifest
    cfg = drafter.cfg
    if m["capture"]["layer_ids"] != cfg.target_layer_ids:
        raise UserError(f"--cache {cache} holds layers {m['capture']['layer_ids']} but the drafter reads "
                        f"{cfg.target_layer_ids}; extract the held-out cache with the drafter's layers")
    if (m["target"]["hidden_size"], m["target"]["vocab_size"]) != (cfg.hidden_size, cfg.vocab_size):
        raise UserError(f"--cache {cache} was made from a target of hidden {m['target']['hidden_size']} and vocabulary "
                        f"{m['target']['vocab_size']}; the drafter has {cfg.hidden_size} and {cfg.vocab_size}")
    refs, lengths = [], []
    for name in reader.shard_names:
        sh = reader.shard(name)
        lengths.extend((sh.offsets[1:] - sh.offsets[:-1]).tolist())
        refs.extend((name, k, int(sh.offsets[k])) for k in range(len(sh)))
    lengths = np.asarray(lengths, np.int64)
    rows = len(pack_rows(lengths, epoch_order(len(refs), seed, 0), seq_len))
    steps = rows if max_rows is None else min(rows, max_rows)
    B = cfg.block_size
    spec = {"seed": seed, "seq_len": seq_len, "num_anchors": num_anchors, "block_size": B,
            "mask_token_id": cfg.mask_token_id, "gamma": 1.0, "hidden_size": cfg.hidden_size,
            "num_layers": len(cfg.target_layer_ids), "hidden_dtype": m["capture"]["hidden_dtype"]}
    stream = RowStream(cache, refs, lengths, spec, 0, 0, 1, 1, 0, steps)
    drafter = drafter.to(device)
    cuda = device.startswith("cuda")
    total: dict | None = None
    with torch.no_grad():
        build = masks.flex_block_mask if cuda else masks.dense_mask
        for mb in make_loader(stream, 0, 1, pin=False):
            mb = device_hidden({k: v.to(device) for k, v in mb.items()})
            mask = build(mb["doc_ids"], mb["anchors"], mb["anchor_valid"], B)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                h = drafter(mb["target_hidden"], mb["block_ids"], mb["ctx_positions"], mb["block_positions"], mask)
                _, correct = block_loss(h, drafter.lm_head.weight, mb["labels"], mb["weights"], loss_chunk_tokens)
            got = block_metrics(correct, mb["weights"], mb["anchor_valid"], B)
            total = got if total is None else {k: total[k] + got[k] for k in got}
    if total is None or float(total["blocks"]) == 0:
        raise UserError(f"--cache {cache}: no valid draft block (no two consecutive loss-mask tokens)")
    cnt = total["slot_count"].cpu().numpy()
    acc = np.where(cnt > 0, total["slot_correct"].cpu().numpy() / np.maximum(cnt, 1), 0.0)
    return {"rows": steps, "blocks": int(total["blocks"]), "tau": float(total["tau_sum"] / total["blocks"]),
            "slot_accuracy": [float(a) for a in acc[1:]]}


# ----------------------------------------------------------------------------------------------
# The command


def run(cfg: EvalConfig) -> dict:
    from .runtime import check_devices_exist, open_process_log, parse_devices

    cfg.validate()
    first = Path(cfg.drafters[0]).absolute()
    open_process_log(first.parent / "logs", "eval")
    devices = parse_devices(cfg.device)
    if len(devices) != 1:
        raise UserError(f"--device {cfg.device}: eval runs on one device (e.g. 0 or cpu)")
    device = devices[0]
    check_devices_exist(devices)
    import torch

    from .runtime import single_thread_compute

    single_thread_compute()
    drafters = [(p, load_drafter(p, cfg.target)) for p in cfg.drafters]  # all refused before any decoding
    report: dict = {"target": str(Path(cfg.target).absolute()), "device": device, "dtype": cfg.dtype,
                    "torch": torch.__version__,
                    "drafters": [{"path": str(p), "block_size": d.cfg.block_size} for p, d in drafters]}
    if cfg.prompts:
        _decode_all(cfg, drafters, device, report)
    if cfg.cache:
        report["cache"] = str(cfg.cache)
        for i, (path, d) in enumerate(drafters):
            t0 = time.time()
            est = cache_acceptance(cfg.cache, d, device, cfg.seq_len, cfg.num_anchors, cfg.max_rows)
            log.info("cache estimate for %s: tau %.3f over %d blocks (%.1fs)", path, est["tau"], est["blocks"], time.time() - t0)
            report["drafters"][i]["cache_estimate"] = est
    print(format_report(report), flush=True)
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(report, indent=1) + "\n")
        print(f"json: {cfg.json_path}")
    return report


def _decode_all(cfg: EvalConfig, drafters, device: str, report: dict) -> None:
    from tqdm import tqdm

    model, info = load_target_for_decoding(cfg.target, device, cfg.dtype)
    ids, prompts = read_prompts(cfg.prompts, info.vocab_size, cfg.max_prompts)
    eos = set() if cfg.ignore_eos else eos_ids(cfg.target)
    log.info("decoding %d prompts, up to %d new tokens, eos %s, %s on %s", len(prompts), cfg.max_new_tokens,
             sorted(eos), cfg.dtype, device)
    report.update({"prompts": str(cfg.prompts), "num_prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
                   "eos": sorted(eos), "hybrid_target": info.hybrid})
    layer_sets = {tuple(d.cfg.target_layer_ids) for _, d in drafters}
    sessions = {ls: TargetSession(model, list(ls)) for ls in layer_sets}
    any_session = next(iter(sessions.values()))
    reference = None
    # Also in the log, every tenth of the prompts: a long decode without a progress bar
    # (--no-progress, a batch job) still shows how far it got.
    every = max(1, len(prompts) // 10)
    if cfg.baseline:
        runs = []
        for k, p in enumerate(tqdm(prompts, desc="target alone", unit="prompt", disable=not cfg.progress), 1):
            runs.append(greedy_decode(any_session, p, cfg.max_new_tokens, eos))
            if k % every == 0 or k == len(prompts):
                log.info("target alone: %d/%d prompts, %.1f tokens/s", k, len(prompts),
                         sum(len(r.tokens) for r in runs) / max(sum(r.seconds for r in runs), 1e-9))
        reference = [r.tokens for r in runs]
        report["baseline"] = {k: v for k, v in summarize(runs, 2).items() if k in ("tokens", "seconds", "tokens_per_s", "target_forwards")}
    for i, (path, drafter) in enumerate(drafters):
        proposer = DFlashProposer(drafter, device, cfg.dtype)
        session = sessions[tuple(drafter.cfg.target_layer_ids)]
        runs = []
        bar = tqdm(prompts, desc=f"speculative {Path(path).name}", unit="prompt", disable=not cfg.progress)
        for k, p in enumerate(bar, 1):
            runs.append(speculative_decode(session, proposer, p, cfg.max_new_tokens, eos))
            acc = [a for r in runs for a in r.accepted]
            bar.set_postfix_str(f"tau {1 + np.mean(acc):.2f}" if acc else "")
            if k % every == 0 or k == len(prompts):
                log.info("speculative %s: %d/%d prompts, tau so far %.3f", path, k, len(prompts),
                         1 + np.mean(acc) if acc else float("nan"))
        e = report["drafters"][i]
        e.update(summarize(runs, drafter.cfg.block_size))
        if reference is not None:
            bad = [ids[k] for k, (r, ref) in enumerate(zip(runs, reference)) if r.tokens != ref]
            e["lossless"] = not bad
            e["mismatched_prompt_ids"] = bad
            e["speedup"] = e["tokens_per_s"] / report["baseline"]["tokens_per_s"]
            if bad:
                log.error("%s: %d of %d outputs differ from the target's greedy decode (ids %s)", path, len(bad),
                          len(runs), bad[:10])
        log.info("%s: tau %.3f over %d rounds, %.1f tokens/s", path, e["tau"], e["rounds"], e["tokens_per_s"])


def format_report(report: dict) -> str:
    lines = []
    if "num_prompts" in report:
        base = report.get("baseline")
        lines.append(f"speculative decoding: {report['num_prompts']} prompts, up to {report['max_new_tokens']} new tokens, "
                     f"{report['dtype']} on {report['device']}"
                     + (f"; target alone {base['tokens_per_s']:.1f} tokens/s" if base else "; no baseline (not checked)"))
        lines.append(f"{'drafter':<40} {'block':>5} {'tau':>6} {'rounds':>7} {'tok/s':>8} {'speedup':>7} {'lossless':>8}")
        for e in report["drafters"]:
            if "tau" not in e:
                continue
            lossless = "-" if "lossless" not in e else ("yes" if e["lossless"] else f"NO ({len(e['mismatched_prompt_ids'])})")
            speed = f"{e['speedup']:.2f}x" if "speedup" in e else "-"
            lines.append(f"{_short(e['path']):<40} {e['block_size']:>5} {e['tau']:>6.3f} {e['rounds']:>7} "
                         f"{e['tokens_per_s']:>8.1f} {speed:>7} {lossless:>8}")
            lines.append("  accepted per slot: " + " ".join(f"{a:.2f}" for a in e["accept_rate"]))
    if any("cache_estimate" in e for e in report["drafters"]):
        lines.append(f"estimate from the cache {report.get('cache')}:")
        lines.append(f"{'drafter':<40} {'block':>5} {'tau':>6} {'blocks':>8}  slot accuracy")
        for e in report["drafters"]:
            est = e.get("cache_estimate")
            if est:
                lines.append(f"{_short(e['path']):<40} {e['block_size']:>5} {est['tau']:>6.3f} {est['blocks']:>8}  "
                             + " ".join(f"{a:.2f}" for a in est["slot_accuracy"][:8]))
    return "\n".join(lines)


def _short(path: str, width: int = 40) -> str:
    return path if len(path) <= width else "..." + path[-(width - 3):]
