"""Remake the hybrid pycode target: a *trained* Qwen3.5-style model (Gated DeltaNet + gated
attention, 3:1) on the pycode fixture's corpus and tokenizer, with its own greedy completions.

It is the pycode fixture (../shared/fixtures/pycode, its README.md) with the dense Qwen3 swapped for
transformers' Qwen3.5 text architecture at about the same size, so that drafter quality can be
measured on a trained hybrid target. Corpus, split, tokenizer (copied unchanged: the fixture's
prompt ids serve both targets), training recipe and completions follow that README.

Phases, one subcommand each (the corpus needs CPython 3.11.7's standard library, which the GPU
machine lacks; the rest wants a GPU):

    python benchmarks/hybrid_fixture.py corpus --out DIR      # stdlib -> DIR/corpus.npz (+ corpus.json)
    python benchmarks/hybrid_fixture.py train --out DIR --device cuda     # -> DIR/target/, DIR/train.json
    python benchmarks/hybrid_fixture.py complete --out DIR --device cuda  # -> DIR/completions-*.parquet
    python benchmarks/hybrid_fixture.py all --out DIR --device cuda       # the three (corpus if absent)
    python benchmarks/hybrid_fixture.py compare --out DIR                 # DIR against the committed fixture

The target every run decodes is committed (COMMITTED: `target/`, its `train.json`, its fp32 greedy
completions and `complete.json`), so a run needs no GPU-minutes to remake it and every run meets the
same near-ties; `all` remakes it and then says whether the remake matches the committed one (bit for
bit, or by how much each tensor, loss and completion differs: GPU kernels need not repeat themselves
across cards and software).

DIR then has the pycode fixture's layout and can be given as `--fixture` to pycode_quality.py (or as
its `--hybrid-fixture` with `--target-family hybrid`). The target:

- `Qwen3_5ForCausalLM` (`model_type` qwen3_5_text): vocab 8192, hidden 384, intermediate 1152,
  8 layers [linear, linear, linear, full] x 2, tied embeddings, RMSNorm eps 1e-6, max positions 2048.
  Full attention: 6 heads, 2 KV heads, head_dim 64, output gate, q/k norms, RoPE theta 10000 on
  the family's default 25% of each head (16 of 64 dims). Gated DeltaNet: 2 key heads and 4 value
  heads of 64 dims (value heads twice the key heads, as in Qwen3.5-9B), conv kernel 4; each such
  layer then has 398K token-mixer parameters against the dense fixture's 393K per attention layer,
  17,241,136 parameters in all (the dense target: 16,915,840).
- Loss and counts of each run land in OUT/train.json and OUT/complete.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # dflash_offline from this checkout

PYCODE = ROOT.parent / "shared" / "fixtures" / "pycode"
COMMITTED = ROOT / "benchmarks" / "fixtures" / "pycode-hybrid"  # the target every run decodes
COMMITTED_FILES = ("target", "train.json", "complete.json", "completions-train.parquet", "completions-eval.parquet")
DEFAULT_OUT = Path("~/.cache/dflash-offline/pycode-hybrid").expanduser()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOT = 0  # <|endoftext|>: eos, pad and document separator (<|MASK|> = 1 never occurs in the data)
SKIPPED = ("site-packages", "idlelib")  # top-level folders of the stdlib left out
SPLITS = ("train", "heldout", "heldout_a", "heldout_b")
# The pycode README's counts for CPython 3.11.7 (tokens include one separator per document).
EXPECTED = {"files": 1665, "not_utf8": 4, "train_files": 1505, "heldout_files": 156, "heldout_a_files": 82,
            "heldout_b_files": 74, "train_bytes": 27_403_123, "heldout_bytes": 2_860_899, "train_tokens": 7_637_094,
            "heldout_tokens": 804_281, "heldout_a_tokens": 437_007, "heldout_b_tokens": 367_274}


# ----------------------------------------------------------------------------------------------
# Corpus: the standard library, split by the md5 of each file's path, tokenized into streams


def split_of(rel: str) -> str:
    """The README's rule: HELD-OUT if md5(path) % 10 == 0, and its half by (md5 // 10) % 2."""
    h = int(hashlib.md5(rel.encode()).hexdigest(), 16)
    return "train" if h % 10 else ("heldout_a" if (h // 10) % 2 == 0 else "heldout_b")


def default_stdlib() -> Path:
    if sys.version_info[:3] != (3, 11, 7):
        raise SystemExit(f"corpus: this is Python {sys.version.split()[0]}, not 3.11.7; pass --stdlib DIR "
                         "(the lib/python3.11 folder of CPython 3.11.7)")
    return Path(sysconfig.get_paths()["stdlib"])


def corpus(args) -> dict:
    from tokenizers import Tokenizer

    stdlib = Path(args.stdlib) if args.stdlib else default_stdlib()
    out = Path(args.out)
    if (out / "corpus.npz").exists():
        raise SystemExit(f"corpus: {out / 'corpus.npz'} exists; remove it to make it again")
    if not (stdlib / "os.py").is_file():
        raise SystemExit(f"corpus: --stdlib {stdlib} has no os.py: give the lib/python3.11 folder itself")
    if not (Path(args.tokenizer) / "tokenizer.json").is_file():
        raise SystemExit(f"corpus: --tokenizer {args.tokenizer} has no tokenizer.json (the pycode fixture's target/)")
    tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    rels = sorted(p.relative_to(stdlib).as_posix() for p in stdlib.rglob("*.py") if p.is_file())
    rels = [r for r in rels if r.split("/")[0] not in SKIPPED]
    texts, sizes, not_utf8 = {}, {}, []
    for r in rels:
        raw = (stdlib / r).read_bytes()
        try:
            texts[r], sizes[r] = raw.decode("utf-8"), len(raw)
        except UnicodeDecodeError:  # 4 test files in other encodings: the README leaves them out
            not_utf8.append(r)
    names = list(texts)
    encoded = tok.encode_batch([texts[r] for r in names], add_special_tokens=False)
    # Each document is its tokens and one separator, in sorted path order; HELD-OUT is half A and B.
    docs: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    nbytes = dict.fromkeys(SPLITS, 0)
    for r, enc in zip(names, encoded):
        s = split_of(r)
        for key in (s,) if s == "train" else (s, "heldout"):
            docs[key].append(np.asarray(enc.ids + [EOT], dtype=np.uint16))
            nbytes[key] += sizes[r]
    streams = {s: np.concatenate(docs[s]) if docs[s] else np.zeros(0, np.uint16) for s in SPLITS}
    counts = {"files": len(rels), "not_utf8": len(not_utf8)}
    for s in SPLITS:
        counts.update({f"{s}_files": len(docs[s]), f"{s}_bytes": nbytes[s], f"{s}_tokens": len(streams[s])})
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "corpus.npz.tmp.npz", **streams)
    os.replace(out / "corpus.npz.tmp.npz", out / "corpus.npz")
    info = {"made_by": "benchmarks/hybrid_fixture.py corpus", "stdlib": str(stdlib), "counts": counts,
            "not_utf8": not_utf8, "heldout_files": {s: [r for r in names if split_of(r) == s]
                                                    for s in ("heldout_a", "heldout_b")},
            "tokenizer_sha256": hashlib.sha256((Path(args.tokenizer) / "tokenizer.json").read_bytes()).hexdigest()}
    (out / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
    for k, v in counts.items():
        warn = "" if EXPECTED.get(k, v) == v else f"   WARNING: the README says {EXPECTED[k]:,}"
        print(f"  {k:<17} {v:>11,}{warn}")
    print(f"corpus: {out / 'corpus.npz'} ({(out / 'corpus.npz').stat().st_size / 1e6:.1f} MB)", flush=True)
    return counts


# ----------------------------------------------------------------------------------------------
# The model


def hybrid_config():
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 2
    cfg = Qwen3_5TextConfig(vocab_size=8192, hidden_size=384, intermediate_size=1152, num_hidden_layers=8,
                            layer_types=layer_types, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                            linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=2048,
                            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=EOT, eos_token_id=EOT,
                            pad_token_id=EOT)
    # RoPE comes from the family's defaults (theta 10000, 25% of each head): check, not assume.
    rope = cfg.rope_parameters
    assert rope["rope_theta"] == 10000 and rope.get("partial_rotary_factor", 0.25) == 0.25, rope
    return cfg


def kernel_path(device) -> str:
    """Which Gated DeltaNet kernels run: transformers binds fla's (and causal-conv1d's) when they are
    importable and uses them for CUDA tensors; otherwise its PyTorch reference functions run (and
    transformers warns once that it is "falling back to its reference PyTorch implementation")."""
    import importlib.metadata
    import importlib.util

    if device.type != "cuda":
        return "Gated DeltaNet: PyTorch reference (CPU)"
    have = {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d")}
    try:
        version = importlib.metadata.version("flash-linear-attention")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    fla = f"fla {version}" if have["fla"] else "PyTorch reference (no fla)"
    conv = "causal-conv1d" if have["causal_conv1d"] else "PyTorch"
    return f"Gated DeltaNet: {fla}, short convolution: {conv}"


def fla_backward_refusal(model, autocast) -> str | None:
    """Why fla's gated-delta-rule backward cannot train `model` here (None: it can). fla 0.6 refuses
    it on Hopper GPUs with Triton >= 3.4 and < 3.7.1, whose results it knows to be wrong (fla issue
    640), and raises only once the first backward runs. A stand-alone call of fla's function did not
    find it out (the refusal depends on the path the model's call takes), so the probe is one forward
    and backward of the model itself on a short row, as training runs it; its gradients are dropped."""
    import torch

    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    x = torch.zeros(1, 128, dtype=torch.long, device=device)
    try:
        with autocast():
            loss = model(input_ids=x).logits.float().mean()
        loss.backward()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    finally:
        model.zero_grad(set_to_none=True)
    return None


def use_torch_chunk_rule(model) -> int:
    """Trains through transformers' PyTorch chunked gated delta rule instead of fla's. transformers
    binds fla in two ways across versions: a Gated DeltaNet layer's attribute, or a module-level
    function wrapped by a kernel dispatcher (its `__wrapped__` is the PyTorch function). Both are
    rebound to the PyTorch function; returns how many places were."""
    import sys

    n = 0
    for mod in {sys.modules[type(m).__module__] for m in model.modules()}:
        for name in ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"):
            ref = getattr(getattr(mod, name, None), "__wrapped__", None)
            if ref is not None:
                setattr(mod, name, ref)
                n += 1
    for m in model.modules():
        ref = getattr(sys.modules[type(m).__module__], "torch_chunk_gated_delta_rule", None)
        if ref is not None and hasattr(m, "chunk_gated_delta_rule"):
            m.chunk_gated_delta_rule = ref
            n += 1
    return n


def residual_dropout(model, p: float) -> list:
    """Dropout on each layer's token-mixer and MLP outputs before they join the residual stream,
    in training mode only (forward hooks: the saved model has no dropout). Returns the handles."""
    import torch.nn.functional as F

    def drop(module, args, out):
        if isinstance(out, tuple):  # attention returns (output, weights)
            return (F.dropout(out[0], p, module.training), *out[1:])
        return F.dropout(out, p, module.training)

    handles = []
    for layer in model.model.layers:
        mixers = [m for m in (getattr(layer, "linear_attn", None), getattr(layer, "self_attn", None)) if m is not None]
        assert len(mixers) == 1, "a Qwen3.5 layer has one token mixer"
        handles += [mixers[0].register_forward_hook(drop), layer.mlp.register_forward_hook(drop)]
    return handles


# ----------------------------------------------------------------------------------------------
# Training


class Schedule:
    """The learning rate of each step, and the early stop on held-out half A.

    Linear warmup to `peak`, then constant while the half-A loss improves. Once it has not improved
    for `patience` evaluations, training goes back to the checkpoint `back` steps before the best
    one and decays the lr to 0 over `decay` steps (a cosine); the run ends there."""

    def __init__(self, peak: float, warmup: int, patience: int, back: int, decay: int):
        self.peak, self.warmup, self.patience, self.back, self.decay = peak, warmup, patience, back, decay
        self.best, self.best_step, self.bad = math.inf, 0, 0
        self.decay_from: int | None = None

    def lr(self, step: int) -> float:
        """The lr of the step taken after `step` steps."""
        if self.decay_from is not None:
            return self.peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - self.decay_from) / self.decay)))
        return self.peak * min(1.0, (step + 1) / self.warmup)

    def evaluated(self, step: int, loss: float) -> int | None:
        """After the evaluation at `step` steps: the step to go back to when the constant phase ends."""
        if self.decay_from is not None:
            return None
        if loss < self.best:
            self.best, self.best_step, self.bad = loss, step, 0
            return None
        self.bad += 1
        if self.bad < self.patience:
            return None
        self.decay_from = max(0, self.best_step - self.back)
        return self.decay_from

    @property
    def end(self) -> int | None:
        return None if self.decay_from is None else self.decay_from + self.decay


def windows(stream, seq: int, limit: int | None = None):
    """Non-overlapping windows of `seq` tokens (the tail shorter than a window is left out), the
    first `limit` of them if given."""
    n = min(len(stream) // seq, limit or len(stream))
    return stream[: n * seq].reshape(n, seq)


def mean_loss(model, rows, autocast, batch: int = 64) -> float:
    """Mean next-token loss (nats, fp32 cross-entropy) over all predicted tokens of `rows` (N, T)."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            x = rows[i:i + batch]
            with autocast():
                logits = model(input_ids=x[:, :-1]).logits
            total += float(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
            count += x[:, 1:].numel()
    return total / max(count, 1)


def train(args) -> dict:
    import contextlib

    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoModelForCausalLM

    from dflash_offline.targets.model import route_cpu_tensors_to_torch_kernels

    t_start = time.time()
    out, corpus_dir = Path(args.out), Path(getattr(args, "corpus", None) or args.out)
    if (out / "target").exists():
        raise SystemExit(f"train: {out / 'target'} exists; remove it to train again")
    missing = [f for f in TOKENIZER_FILES if not (Path(args.tokenizer) / f).is_file()]
    if missing or not (corpus_dir / "corpus.npz").is_file():
        raise SystemExit(f"train: no {corpus_dir / 'corpus.npz'} (run the corpus phase)" if not missing else
                         f"train: --tokenizer {args.tokenizer} lacks {', '.join(missing)}")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a smoke run: OpenMP threads spinning on a shared machine are slower than one
    else:
        torch.backends.cuda.matmul.allow_tf32 = True  # training only; the final losses are fp32
    data = np.load(corpus_dir / "corpus.npz")
    streams = {s: torch.from_numpy(data[s].astype(np.int64)).to(device) for s in SPLITS}
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(hybrid_config(), dtype=torch.float32, attn_implementation="sdpa")
    model.to(device).train()
    if device.type == "cpu":  # fla's Triton kernels, where installed, fail on CPU tensors
        route_cpu_tensors_to_torch_kernels(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {n_params:,} parameters; {kernel_path(device)}", flush=True)
    hooks = residual_dropout(model, args.dropout)
    # Weight decay on matrices (the tied embedding, projections, the convolution's kernel), none on
    # norms, biases and the per-head Gated DeltaNet vectors (A_log, dt_bias): all 1-d.
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")

    def autocast():  # bf16 autocast over fp32 master weights on the GPU; the CPU smoke runs fp32
        return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    refusal = fla_backward_refusal(model, autocast)
    if refusal is not None:
        print(f"warning: fla cannot train here ({refusal}): the chunked gated delta rule runs transformers' "
              f"PyTorch function ({use_torch_chunk_rule(model)} places rebound; slower)", flush=True)
        refusal = fla_backward_refusal(model, autocast)
        if refusal is not None:
            raise SystemExit(f"train: the PyTorch gated delta rule fails as well: {refusal}")

    sched = Schedule(args.lr, args.warmup, args.patience, 2 * args.eval_every, args.decay_steps)
    half_a = windows(streams["heldout_a"], args.seq, args.eval_windows)
    rng = np.random.default_rng(args.seed)
    n_train = len(streams["train"])
    span = torch.arange(args.seq + 1, device=device)

    def snapshot():  # model and optimizer state, copied to host memory
        o = opt.state_dict()
        return ({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
                {"state": {k: {n: t.to("cpu", copy=True) if torch.is_tensor(t) else t for n, t in st.items()}
                           for k, st in o["state"].items()}, "param_groups": o["param_groups"]})

    snaps = {0: snapshot()}  # step -> (model, optimizer) state, kept while a restore may want it
    evals, losses, step, steps_run = [], [], 0, 0
    t_train = time.time()
    while sched.end is None or step < sched.end:
        if args.max_steps is not None and steps_run >= args.max_steps:
            print(f"stopped by --max-steps {args.max_steps}", flush=True)
            break
        # Windows at random offsets of the TRAIN stream: they cross document separators (no packing).
        offsets = torch.from_numpy(rng.integers(0, n_train - args.seq, size=args.batch)).to(device)
        x = streams["train"][offsets[:, None] + span]
        for g in opt.param_groups:
            g["lr"] = sched.lr(step)
        with autocast():
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, steps_run = step + 1, steps_run + 1
        losses.append(loss.detach())
        if step % args.eval_every:
            continue
        model.eval()
        a = mean_loss(model, half_a, autocast)
        model.train()
        back = sched.evaluated(step, a)
        evals.append({"step": step, "half_a": a, "train": float(torch.stack(losses).mean()), "lr": sched.lr(step - 1),
                      "s": time.time() - t_train})
        losses.clear()
        print(f"step {step:>5}: half-A loss {a:.4f} (best {sched.best:.4f} at {sched.best_step}), train loss "
              f"{evals[-1]['train']:.4f}, lr {evals[-1]['lr']:.2e}, {evals[-1]['s']:.0f}s", flush=True)
        if sched.decay_from is None:
            snaps[step] = snapshot()
            snaps = {s: v for s, v in snaps.items() if s >= sched.best_step - sched.back}
        elif back is not None:
            print(f"no better half-A loss for {args.patience} evaluations: back to step {back}, then the lr decays "
                  f"to 0 over {args.decay_steps} steps", flush=True)
            m, o = snaps[back]
            model.load_state_dict(m)
            opt.load_state_dict(o)
            snaps, step = {}, back
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_train
    for h in hooks:
        h.remove()

    # Save in bf16 (as the dense fixture), with the tokenizer files copied unchanged.
    model.eval().to(torch.bfloat16)
    model.generation_config.update(bos_token_id=EOT, eos_token_id=EOT, pad_token_id=EOT, do_sample=False)
    tmp = out / "target.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        shutil.copyfile(Path(args.tokenizer) / f, tmp / f)
    os.replace(tmp, out / "target")

    # Losses of the saved bf16 weights, computed in fp32 (TF32 off, also for the convolution's cuDNN path).
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    saved = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32).to(device).eval()
    if device.type == "cpu":
        route_cpu_tensors_to_torch_kernels(saved)
    fp32 = contextlib.nullcontext
    picks = np.random.default_rng([args.seed, 1]).integers(0, n_train - args.seq, size=args.train_windows)
    train_rows = streams["train"][torch.from_numpy(picks).to(device)[:, None] + span[:-1]]
    final = {s: mean_loss(saved, windows(streams[s], args.seq, args.eval_windows), fp32) for s in SPLITS[1:]}
    final["train_windows"] = mean_loss(saved, train_rows, fp32)
    final_steps = step
    report = {
        "made_by": "benchmarks/hybrid_fixture.py train", "options": recorded_options(args),
        "seed": args.seed, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "kernels": kernel_path(device), "parameters": n_params, "batch": args.batch, "seq": args.seq,
        "steps": final_steps, "steps_run": steps_run, "tokens_seen": final_steps * args.batch * args.seq,
        "epochs": final_steps * args.batch * args.seq / n_train, "best_half_a": {"step": sched.best_step,
                                                                              "loss": sched.best},
        "decay_from": sched.decay_from, "train_s": train_s, "s_per_step": train_s / max(steps_run, 1),
        "loss_fp32_of_saved_bf16": final, "evals": evals, "total_s": time.time() - t_start,
    }
    (out / "train.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"saved {out / 'target'}: {final_steps} steps ({steps_run} run), {train_s:.0f}s of training; fp32 losses "
          + ", ".join(f"{k} {v:.4f}" for k, v in final.items()), flush=True)
    return report


# ----------------------------------------------------------------------------------------------
# Completions: the project's own `generate`, greedy in fp32


def complete(args) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out, fixture, target = Path(args.out), Path(args.fixture), Path(args.target or Path(args.out) / "target")
    work = out / "generate"  # generate's own output folders: running the phase again resumes them
    work.mkdir(parents=True, exist_ok=True)
    devices = "cpu" if args.device == "cpu" else (args.device.split(":")[1] if ":" in args.device else "0")
    summary = {}
    for name, src in (("train", "completions-train.parquet"), ("eval", "prompts-eval.parquet")):
        final = out / f"completions-{name}.parquet"
        if final.exists():
            print(f"{final} exists: kept", flush=True)
            continue
        table = pq.read_table(fixture / src)
        table = table.slice(0, args.limit) if args.limit else table
        ids = table["id"].to_pylist()
        rows = table["input_ids"].to_pylist()
        if "loss_mask" in table.column_names:  # the prompt: the tokens before the first with loss_mask 1
            rows = [r[: m.index(1) if 1 in m else len(m)] for r, m in zip(rows, table["loss_mask"].to_pylist())]
        prompts = work / f"prompts-{name}.parquet"
        pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "input_ids": pa.array(rows, pa.list_(pa.int32()))}),
                       prompts)
        cmd = [sys.executable, "-m", "dflash_offline", "generate", "--target", str(target.absolute()),
               "--prompts", str(prompts.absolute()), "--out", str((work / f"{name}.parquet").absolute()),
               "--devices", devices, "--max-new-tokens", str(args.max_new_tokens), "--eos-token-ids", str(EOT),
               "--compute-dtype", "float32", "--no-progress"]
        if devices != "cpu":  # 2048 rows per batch: the small target leaves the GPU launch-bound below that
            cmd += ["--batch-tokens", str(2048 * (max(map(len, rows)) + args.max_new_tokens))]
        t0 = time.time()
        print(f"{name}: {len(rows)} prompts -> {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
        done = pq.read_table(work / f"{name}.parquet").sort_by("id")
        assert done["id"].to_pylist() == sorted(ids), f"{name}: generate's ids are not the prompts' ids"
        pq.write_table(done.select(["id", "input_ids", "loss_mask"]), final)
        new = [sum(m) for m in done["loss_mask"].to_pylist()]
        summary[name] = {"rows": len(new), "mean_completion": sum(new) / max(len(new), 1),
                         "ended_by_eot": done["finish_reason"].to_pylist().count("eos"), "seconds": time.time() - t0}
        print(f"{name}: {summary[name]}", flush=True)
    for f in ("prompts-eval.parquet", "prompts-train-40k.parquet"):  # target-independent: copied as they are
        if not (out / f).exists():
            shutil.copyfile(fixture / f, out / f)
    if summary:
        made = {"target": "OUT/target" if args.target is None else "TARGET", "max_new_tokens": args.max_new_tokens,
                "limit": args.limit, **summary}  # folders by role, as train.json records them
        (out / "complete.json").write_text(json.dumps(made, indent=1) + "\n")
    return summary


PATH_OPTIONS = {"out": "OUT", "corpus": "CORPUS", "tokenizer": "TOKENIZER", "stdlib": "STDLIB", "fixture": "FIXTURE",
                "target": "TARGET", "against": "AGAINST"}


def recorded_options(args) -> dict:
    """The options as train.json keeps them: folders by their role (OUT, CORPUS, ...), not by where
    they lay on the machine that made the fixture (the file is committed and compared across machines)."""
    return {k: (PATH_OPTIONS[k] if k in PATH_OPTIONS and v is not None else v)
            for k, v in vars(args).items() if k != "phase"}


# ----------------------------------------------------------------------------------------------
# Whether a remake matches the committed fixture


def compare(args) -> dict:
    """The remade fixture in OUT against --against (the committed one): every weight tensor bit for
    bit (else how many differ and the largest difference), the losses train.json records, and the
    completions row by row. Prints one line each and a verdict; returns the figures."""
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load_file

    out, ref = Path(args.out), Path(args.against)
    for d in (out, ref):
        if not (d / "target" / "model.safetensors").is_file():
            raise SystemExit(f"compare: {d / 'target' / 'model.safetensors'} does not exist")
    mine, theirs = load_file(str(out / "target" / "model.safetensors")), load_file(str(ref / "target" / "model.safetensors"))
    if mine.keys() != theirs.keys() or any(mine[k].shape != theirs[k].shape for k in mine):
        raise SystemExit(f"compare: {out / 'target'} and {ref / 'target'} hold other tensors or shapes")
    diffs = {k: float((mine[k].float() - theirs[k].float()).abs().max()) for k in sorted(mine)}
    differ = {k: v for k, v in diffs.items() if v > 0 or not torch.equal(mine[k], theirs[k])}
    report = {"tensors": len(diffs), "tensors_differ": len(differ),
              "largest_diff": max(differ.items(), key=lambda kv: kv[1]) if differ else None,
              "config_equal": (out / "target" / "config.json").read_bytes() == (ref / "target" / "config.json").read_bytes()}
    print(f"weights: {len(diffs) - len(differ)} of {len(diffs)} tensors equal bit for bit"
          + (f"; largest |difference| {report['largest_diff'][1]:.3g} in {report['largest_diff'][0]}" if differ else ""))
    losses = {}
    if (out / "train.json").is_file() and (ref / "train.json").is_file():
        a, b = (json.loads((d / "train.json").read_text())["loss_fp32_of_saved_bf16"] for d in (out, ref))
        losses = {k: (a[k], b[k]) for k in a if k in b}
        print("losses (fp32, remade / committed): " + ", ".join(f"{k} {x:.4f} / {y:.4f}" for k, (x, y) in losses.items()))
    report["losses"] = losses
    rows = {}
    for name in ("train", "eval"):
        f = f"completions-{name}.parquet"
        if (out / f).is_file() and (ref / f).is_file():
            x, y = (dict(zip(t["id"].to_pylist(), t["input_ids"].to_pylist())) for t in (pq.read_table(d / f) for d in (out, ref)))
            same = sum(x[i] == y.get(i) for i in x)
            rows[name] = {"rows": len(x), "equal": same, "ids_equal": x.keys() == y.keys()}
            print(f"completions {name}: {same} of {len(x)} rows equal token for token"
                  + ("" if x.keys() == y.keys() else " (the two files hold other ids)"))
    report["completions"] = rows
    report["matches"] = (not differ and report["config_equal"]
                         and all(r["equal"] == r["rows"] and r["ids_equal"] for r in rows.values()))
    print(f"the remake in {out} {'matches' if report['matches'] else 'does not match'} {ref}", flush=True)
    (out / "compare.json").write_text(json.dumps({"against": str(ref), **report}, indent=1) + "\n")
    return report


# ----------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="phase", required=True)
    phases = {p: sub.add_parser(p, help=h) for p, h in (
        ("corpus", "tokenize the 3.11.7 stdlib into OUT/corpus.npz (needs that stdlib, no GPU)"),
        ("train", "train the hybrid target into OUT/target (a GPU)"),
        ("complete", "its greedy completions of the fixture's prompts (a GPU)"),
        ("all", "corpus (if absent), train, complete; then compare with --against where it exists"),
        ("compare", "whether OUT's target and completions match --against's (the committed fixture)"))}
    for name, p in phases.items():
        p.add_argument("--out", default=str(DEFAULT_OUT), help="the hybrid fixture folder (default %(default)s)")
        if name in ("corpus", "train", "all"):
            p.add_argument("--tokenizer", default=str(PYCODE / "target"), help="folder of the tokenizer files")
        if name in ("corpus", "all"):
            p.add_argument("--stdlib", default=None, help="CPython 3.11.7's lib/python3.11 (default: this Python's)")
        if name in ("train", "complete", "all"):
            p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
        if name == "train":
            p.add_argument("--corpus", default=None, help="folder with corpus.npz (default: --out)")
        if name in ("train", "all"):
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--batch", type=int, default=64, help="sequences per step")
            p.add_argument("--seq", type=int, default=1024, help="tokens per sequence and per evaluation window")
            p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
            p.add_argument("--warmup", type=int, default=200)
            p.add_argument("--dropout", type=float, default=0.1, help="residual dropout (token mixer and MLP outputs)")
            p.add_argument("--eval-every", type=int, default=25, help="steps between half-A evaluations (the hybrid "
                                                                      "fixture was made with 25; the dense target's "
                                                                      "README: 50); the restore "
                                                                      "goes back two of them before the best")
            p.add_argument("--patience", type=int, default=6, help="evaluations without a better half-A loss")
            p.add_argument("--decay-steps", type=int, default=250)
            p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (a smoke run)")
            p.add_argument("--train-windows", type=int, default=256, help="random train windows in the final loss")
            p.add_argument("--eval-windows", type=int, default=None,
                           help="only the first N windows of each held-out set (a smoke run; default all)")
        if name in ("compare", "all"):
            p.add_argument("--against", default=str(COMMITTED), help="the fixture to compare with (default: the "
                                                                     "committed one, %(default)s)")
        if name in ("complete", "all"):
            p.add_argument("--fixture", default=str(PYCODE), help="the pycode fixture (its prompts)")
            p.add_argument("--target", default=None, help="the target folder (default OUT/target)")
            p.add_argument("--max-new-tokens", type=int, default=384)
            p.add_argument("--limit", type=int, default=None, help="the first N prompts of each set (a smoke run)")
    args = ap.parse_args()
    t0 = time.time()
    if args.phase == "corpus":
        corpus(args)
    elif args.phase == "train":
        train(args)
    elif args.phase == "complete":
        complete(args)
    elif args.phase == "compare":
        return 0 if compare(args)["matches"] else 1
    else:
        if not (Path(args.out) / "corpus.npz").exists():
            corpus(args)
        rep = train(args)
        done = complete(args)
        rows = [("train", f"{rep['steps']} steps ({rep['steps_run']} run), {rep['train_s']:.0f}s"),
                *[(f"loss {k}", f"{v:.4f} (fp32, saved bf16 weights)") for k, v in rep["loss_fp32_of_saved_bf16"].items()],
                *[(f"complete {k}", f"{d['rows']} rows, mean completion {d['mean_completion']:.1f}, "
                                    f"{d['ended_by_eot']} ended by token 0, {d['seconds']:.0f}s") for k, d in done.items()],
                ("all", f"{time.time() - t0:.0f}s")]
        print("\n" + "\n".join(f"{k:<22} {v}" for k, v in rows))
        if (Path(args.against) / "target" / "model.safetensors").is_file() and Path(args.against) != Path(args.out):
            compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
