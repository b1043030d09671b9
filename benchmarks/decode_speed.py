"""Decoding speed: speculative decoding against the target alone, at batch 1 and batched.

Part 1, a real target and trained drafters (the pycode fixture by default), greedy, on one device,
both sides optimised the same way (`evaluate.graphed.StaticDecoder`: preallocated buffers, each
round a CUDA graph, rows compacted into smaller buckets as they finish; --compile, the default on
a GPU: Inductor first):
  batch 1   the target alone against speculative decoding with each drafter, one prompt at a time
            (--batch1-prompts, all by default);
  batch N   the same, N prompts per forward; beside the static target alone, generate's
            decoder (`decoding.BatchDecoder`, StaticCache) and eval's transformers KV batches
            with block size 1: the speed-up is also given over the fastest of them.
  Reported: new tokens/s, the speed-up, tau (the reference's count, pooled), how many outputs
  equal the target-alone decode (in bf16 a near-tie can flip), and with --reference (the
  target's greedy completions) how many float32 outputs equal them (every one must).
Part 2 (--ceiling), what a tau is worth on a big target: a named target shape (--ceiling-shape,
  qwen3.6-27b: Qwen3.5/3.6-27B's hybrid shape) with random weights and the drafter its recipe in
  stages/ trains, also random. Kernel time (torch.profiler device time: a forward without the
  host's launch overhead, which CUDA graphs remove) of one target forward over 1 and over B new
  tokens after a cached context of --ceiling-context tokens, and of one drafter forward drafting a
  block of B over it; written as the records `eval --implied-for NAME` reads
  (dflash_offline/evaluate/ceiling.py; copy them into its ceilings.json), with the speed-up they
  imply, tau * t_1 / (t_draft + t_B), at a few taus. On CPU (--tiny) wall times, labelled so.

    python benchmarks/decode_speed.py --target ../shared/fixtures/pycode/target --drafter runs/pq/best \\
        --prompts ../shared/fixtures/pycode/prompts-eval.parquet \\
        --reference ../shared/fixtures/pycode/completions-eval.parquet --device 0 --out results/decode.json
    python benchmarks/decode_speed.py --ceiling --device 0 --out results/ceiling.json   # 27B: about 2 min on an H200
    python benchmarks/decode_speed.py --tiny --out /tmp/decode.json      # CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN35_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                  max_position_embeddings=262144, rope_theta=10_000_000.0, linear_num_key_heads=16,
                  linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, tie_word_embeddings=False)
# --ceiling: name -> (target shape, the recipe in stages/ whose drafter it serves).
CEILING_SHAPES = {"qwen3.6-27b": (QWEN35_27B, "qwen3.6-27b")}


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def kernel_ms(device: str, fn) -> float | None:
    """Milliseconds the device spends in kernels during fn() (torch.profiler): a forward's cost
    without the host's launch overhead, which CUDA graphs remove; None off CUDA."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1000


def part1(args, device: str) -> dict:
    """Both sides optimised, side by side: the target alone and speculative decoding through the
    static decoder (preallocated buffers, each round one CUDA graph, `--compile`: Inductor first),
    at batch 1 and batched; beside them the other target-alone batched decoders (generate's
    StaticCache decoder, eval's transformers KV batches), the fastest of which is the batched bar."""
    import torch

    from dflash_offline.evaluate.graphed import StaticDecoder
    from dflash_offline.evaluate.inputs import read_reference
    from dflash_offline.evaluate.kv_batch import NoDrafts, kv_batched_decode
    from dflash_offline.evaluate.run import load_drafter, read_prompts
    from dflash_offline.evaluate.speculative import load_target_for_decoding, summarize
    from dflash_offline.generate.continuous import ContinuousDecoder
    from dflash_offline.generate.decoding import BatchDecoder
    from dflash_offline.sampling import Sampling
    from dflash_offline.targets.folder import eos_ids, read_target

    ids, prompts = read_prompts(args.prompts, read_target(args.target).vocab_size, args.max_prompts)
    eos = set() if args.ignore_eos else eos_ids(args.target)
    new, P = args.max_new_tokens, max(len(p) for p in prompts)
    one, rows = prompts[: args.batch1_prompts], min(args.batch_size, len(prompts))
    res: dict = {"prompts": len(prompts), "max_new_tokens": new, "dtype": args.dtype, "batch": rows,
                 "compile": args.compile, "batch1_prompts": len(one), "bucket_step": args.bucket_step}

    def run(dec, ps):
        """Untimed warm-up batch (kernels, graph capture), then the timed decode of every batch."""
        dec.decode(ps[: dec.rows])
        return timed(device, lambda: dec.decode_all(ps))

    def figures(runs, seconds):
        tokens = sum(len(r.tokens) for r in runs)
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}

    model, _ = load_target_for_decoding(args.target, device, args.dtype)
    t0 = time.perf_counter()
    alone1, s = run(StaticDecoder(model, None, 1, P, new, eos, compile=args.compile), one)
    res["batch1_alone"] = {"decoder": "static" + (", CUDA graphs" if device.startswith("cuda") else "")
                           + (", compiled" if args.compile else ""),
                           **figures(alone1, s), "setup_s": time.perf_counter() - t0 - s}
    t0 = time.perf_counter()
    alone_n, s = run(StaticDecoder(model, None, rows, P, new, eos, compile=args.compile, bucket_step=args.bucket_step),
                     prompts)
    res["batched_alone"] = {"static": {**figures(alone_n, s), "setup_s": time.perf_counter() - t0 - s}}
    # The other batched target-alone decoders: the bar is the fastest of them all.
    dec = BatchDecoder(model, rows, P, new, eos, Sampling())
    dec.decode(prompts[:rows], ids[:rows])
    gen, s = timed(device, lambda: [t for k in range(0, len(prompts), rows)
                                    for t in dec.decode(prompts[k:k + rows], ids[k:k + rows]).tokens])
    res["batched_alone"]["generate"] = {"tokens": sum(map(len, gen)), "seconds": s, "tokens_per_s": sum(map(len, gen)) / s}
    # generate's continuous batching (slots refilled as prompts end; the step a CUDA graph on GPUs)
    cont = ContinuousDecoder(model, rows, P, new, eos, Sampling())
    cont.decode_all(prompts[:rows], ids[:rows])
    got, s = timed(device, lambda: cont.decode_all(prompts, ids))
    made = sum(len(f.tokens) for f in got)
    res["batched_alone"]["generate_continuous"] = {"tokens": made, "seconds": s, "tokens_per_s": made / s}
    kv_batched_decode(model, NoDrafts(), [], prompts[:2], 16, eos, 2)
    kv, s = timed(device, lambda: kv_batched_decode(model, NoDrafts(), [], prompts, new, eos, rows))
    res["batched_alone"]["transformers_kv"] = figures(kv, s)
    fastest = max(res["batched_alone"].values(), key=lambda f: f["tokens_per_s"])
    res["drafters"] = []
    for path in args.drafter:
        d = load_drafter(path, args.target).to(device=device, dtype=getattr(torch, args.dtype)).eval()
        B = d.cfg.block_size
        row: dict = {"path": str(path), "block_size": B}
        t0 = time.perf_counter()
        spec1, s = run(StaticDecoder(model, d, 1, P, new, eos, compile=args.compile), one)
        row["batch1"] = {**figures(spec1, s), "tau": summarize(spec1, B).tau, "setup_s": time.perf_counter() - t0 - s,
                         "equal_to_alone": sum(a.tokens == b.tokens for a, b in zip(spec1, alone1))}
        row["batch1"]["speedup"] = row["batch1"]["tokens_per_s"] / res["batch1_alone"]["tokens_per_s"]
        t0 = time.perf_counter()
        specn, s = run(StaticDecoder(model, d, rows, P, new, eos, compile=args.compile, bucket_step=args.bucket_step),
                       prompts)
        row["batched"] = {**figures(specn, s), "tau": summarize(specn, B).tau, "setup_s": time.perf_counter() - t0 - s,
                          "equal_to_alone": sum(a.tokens == b.tokens for a, b in zip(specn, alone_n))}
        row["batched"]["speedup_vs_static_alone"] = row["batched"]["tokens_per_s"] / res["batched_alone"]["static"]["tokens_per_s"]
        row["batched"]["speedup_vs_fastest_alone"] = row["batched"]["tokens_per_s"] / fastest["tokens_per_s"]
        res["drafters"].append(row)
        print(json.dumps(row), flush=True)
    if args.reference:
        # Exactness: fp32, greedy, the target's own greedy completions: every output equal.
        model32, _ = load_target_for_decoding(args.target, device, "float32")
        want = read_reference(args.reference, ids, prompts, new, eos, vocab_size=read_target(args.target).vocab_size)
        for row, path in zip(res["drafters"], args.drafter):
            d = load_drafter(path, args.target).to(device=device, dtype=torch.float32).eval()
            got = StaticDecoder(model32, d, rows, P, new, eos).decode_all(prompts)
            row["fp32_equal_to_reference"] = sum(g.tokens == w for g, w in zip(got, want))
            row["fp32_tau"] = summarize(got, d.cfg.block_size).tau
    return res


def ceiling_recipe(name: str) -> dict:
    """The drafter the recipe stages/NAME trains: layers, block size, target layers it reads."""
    from dflash_offline.config import ExtractConfig
    from dflash_offline.train.config import TrainConfig
    from dflash_offline.options import load_recipe

    stages = Path(__file__).resolve().parents[1] / "stages" / name

    def read(f: str, cls: type):  # the recipe as the stage reads it (earlier key names too), over the defaults
        p = stages / f
        return cls(**(load_recipe(p, cls) if p.is_file() else {}))

    train, extract = read("train.toml", TrainConfig), read("extract.toml", ExtractConfig)
    layers = extract.capture_layers or list(range(extract.capture_count))
    return {"recipe": f"stages/{name}", "drafter_layers": train.drafter_layers,
            "block_size": train.block_size, "target_layer_ids": list(layers)}


def ceiling_ms(device: str, setup, fn, reps: int) -> float:
    """Median milliseconds of fn() over `reps` runs, each after setup() (not timed), after two
    untimed runs (kernel selection, Triton autotuning, allocator): kernel time on CUDA
    (`kernel_ms`), wall time elsewhere."""
    import statistics

    got = []
    for i in range(reps + 2):
        setup()
        if device.startswith("cuda"):
            ms = kernel_ms(device, fn)
        else:
            ms = timed(device, fn)[1] * 1000
        if i >= 2:
            got.append(ms)
    return statistics.median(got)


def ceiling_target_ms(shape: dict, layers: int, context: int, blocks: list[int], device: str, dtype, reps: int) -> dict:
    """{n: ms} of one forward of n new tokens (n = 1 and each block size) after a cached context of
    `context` random tokens, for `shape` with `layers` decoder layers and random weights (a forward's
    time does not depend on its weights' values)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_offline.evaluate.speculative import TargetSession

    cfg = AutoConfig.for_model("qwen3_5_text", **{**shape, "num_hidden_layers": layers},
                               layer_types=["linear_attention" if (i + 1) % 4 else "full_attention"
                                            for i in range(layers)])
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    print(f"ceiling: target with {layers} layers built in {time.time() - t0:.0f}s", flush=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab_size"], (context,), generator=g).tolist()
    new = torch.randint(0, shape["vocab_size"], (max(blocks),), generator=g).tolist()
    session = TargetSession(model, [0])
    # The verify forward runs with rollback=False: no state copy first, as an engine that keeps the
    # recurrent state per draft position needs none.
    out = {n: ceiling_ms(device, lambda: session.start(prompt, features=False),
                         lambda: session.forward(new[:n], features=False, rollback=False), reps)
           for n in sorted({1, *blocks})}
    print(f"ceiling: target with {layers} layers, ms per forward of n new tokens: {json.dumps(out)}", flush=True)
    return out


def ceiling_draft_ms(shape: dict, recipe: dict, context: int, blocks: list[int], device: str, dtype,
                     reps: int) -> dict:
    """{B: (ms of one drafter forward drafting a block of B over a cached context of `context`
    positions, LM head over its B - 1 drafts as eval's DFlashProposer; ms of the context update
    for B newly committed positions)} for the recipe's drafter on `shape`, random weights."""
    import torch

    from dflash_offline.drafter.config import DrafterConfig
    from dflash_offline.drafter.model import DFlashDrafter

    ids = recipe["target_layer_ids"]
    cfg = DrafterConfig(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                        num_hidden_layers=recipe["drafter_layers"], num_attention_heads=shape["num_attention_heads"],
                        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                        rms_norm_eps=shape["rms_norm_eps"], rope_theta=shape["rope_theta"],
                        vocab_size=shape["vocab_size"], max_position_embeddings=shape["max_position_embeddings"],
                        block_size=recipe["block_size"], target_layer_ids=ids, mask_token_id=1,
                        num_target_layers=shape["num_hidden_layers"])
    torch.manual_seed(0)
    with torch.device(device):
        d = DFlashDrafter(cfg).to(dtype).eval()
        hidden = torch.randn(1, context + max(blocks), len(ids) * cfg.hidden_size, dtype=dtype)
        positions = torch.arange(context + max(blocks))[None]
    kv = d.context_kv(hidden[:, :context], positions[:, :context])
    head = d.lm_head.weight

    def draft(B):
        block = torch.tensor([[7] + [cfg.mask_token_id] * (B - 1)], device=device)
        with torch.inference_mode():
            h = d.draft_hidden(kv, block, positions[:, context:context + B])
            return torch.nn.functional.linear(h[0, 1:], head.to(h.dtype)).float()

    out = {B: (ceiling_ms(device, lambda: None, lambda: draft(B), reps),
               ceiling_ms(device, lambda: None, lambda: d.context_kv(hidden[:, context:context + B],
                                                                     positions[:, context:context + B]), reps))
           for B in blocks}
    print(f"ceiling: drafter of {recipe['drafter_layers']} layer(s), ms per block of B (draft, context update): "
          f"{json.dumps(out)}", flush=True)
    return out


CEILING_TAUS = (4, 6, 8)


def part2(args, device: str) -> dict:
    """--ceiling: kernel times of the named target shape (random weights) and its recipe's drafter,
    one forward each: the target over 1 and over B new tokens after a cached context, the drafter
    drafting a block of B over it. Written as evaluate/ceiling.py's records (`shapes`), with the
    speed-up they imply at a few taus."""
    import gc
    import importlib.util
    import shlex

    import torch

    from dflash_offline.evaluate.ceiling import MeasuredShape, ceiling_speedup, extend_to_layers, implied_speedup

    target, recipe_name = CEILING_SHAPES[args.ceiling_shape]
    recipe = ceiling_recipe(recipe_name)
    shape, name, context, reps = dict(target), args.ceiling_shape, args.ceiling_context, args.ceiling_reps
    if args.tiny:  # CPU smoke run: a tiny hybrid target (8 layers) and a 1-layer drafter
        shape.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16)
        recipe.update(recipe="tiny", drafter_layers=1, block_size=4, target_layer_ids=[1, 3])
        name, context, reps = "tiny", min(context, 32), min(reps, 2)
    blocks = args.block_sizes or [recipe["block_size"]]
    L = shape["num_hidden_layers"]
    part = args.ceiling_layers
    if part is not None and not (part > 0 and part % 4 == 0 and 2 * part <= L):
        raise SystemExit(f"--ceiling-layers {part}: a multiple of 4 (the 3:1 hybrid pattern) with twice it at most {L}")
    if min(blocks) < 2 or context < 1 or reps < 1:
        raise SystemExit(f"--ceiling: block sizes {blocks} (at least 2 tokens each), context {context} and reps {reps} "
                         "(at least 1)")
    dtype = torch.float32 if args.tiny else getattr(torch, args.dtype)
    notes = []
    if device.startswith("cuda"):
        missing = [m for m in ("fla", "causal_conv1d") if importlib.util.find_spec(m) is None]
        if missing:
            notes.append(f"WITHOUT {' and '.join(missing)}: torch fallback kernels, slower than a server's")
            bar = "!" * 100
            print(f"{bar}\nceiling: {', '.join(missing)} not installed (pip install -e '.[gpu]'): the Gated DeltaNet "
                  f"layers run transformers' torch fallbacks,\nfar slower than flash-linear-attention's kernels; the "
                  f"target times below are NOT a server's.\n{bar}", file=sys.stderr, flush=True)
    print(f"ceiling: {name}, recipe {recipe}, context {context}, blocks {blocks}, {dtype}", flush=True)
    draft = ceiling_draft_ms(shape, recipe, context, blocks, device, dtype, reps)
    counts = [part, 2 * part] if part else [L]
    target_ms = {}
    for n in counts:
        gc.collect()  # the last model's memory, before the next one is built
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        target_ms[n] = ceiling_target_ms(shape, n, context, blocks, device, dtype, reps)
    if part:
        small, large = target_ms[part], target_ms[2 * part]
        full = {k: extend_to_layers(small[k], large[k], part, 2 * part, L) for k in small}
        notes.append(f"target times extended linearly from {part} and {2 * part} of its {L} layers")
    else:
        full = target_ms[L]
    timing = "kernel" if device.startswith("cuda") else "wall"
    hardware = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    argv = [Path(a).name if sys.argv[i - 1] == "--out" else a for i, a in enumerate(sys.argv[1:], 1)]
    command = "python benchmarks/decode_speed.py " + shlex.join(argv)  # --out FILE: its name alone
    desc = (f"{'tiny' if args.tiny else 'Qwen3.6-27B'}-shaped hybrid target ({L} layers, Gated DeltaNet 3:1 attention, "
            f"hidden {shape['hidden_size']}, vocab {shape['vocab_size']}), random weights; the {recipe['recipe']} "
            f"drafter ({recipe['drafter_layers']} layer{'s' * (recipe['drafter_layers'] != 1)}, features of "
            f"{len(recipe['target_layer_ids'])} target layers)")
    shapes = []
    for B in blocks:
        shapes.append(MeasuredShape(
            name=name if B == recipe["block_size"] else f"{name}-b{B}",
            description="; ".join([desc, *notes]), hardware=hardware, dtype=str(dtype).removeprefix("torch."),
            block_size=B, context=context, target_1_ms=full[1], target_block_ms=full[B], draft_ms=draft[B][0],
            timing=timing, command=command, draft_context_ms=draft[B][1],
            extrapolated_from_layers=counts if part else None))
    taus = [t for t in CEILING_TAUS if t <= max(blocks)]
    print(f"\n{timing} times ({hardware}, {dtype}, context {context}{'; ' if notes else ''}{'; '.join(notes)}):")
    print("| shape | B | t_1 ms | t_B ms | t_draft ms | context update ms | " + " | ".join(f"tau {t}" for t in taus)
          + " | ceiling (tau = B) |")
    print("|---|---|---|---|---|---|" + "---|" * (len(taus) + 1))
    for s in shapes:
        implied = " | ".join(f"{implied_speedup(t, s):.2f}x" if t <= s.block_size else "-" for t in taus)
        print(f"| {s.name} | {s.block_size} | {s.target_1_ms:.3f} | {s.target_block_ms:.3f} | {s.draft_ms:.3f} | "
              f"{s.draft_context_ms:.3f} | {implied} | {ceiling_speedup(s):.2f}x |")
    print("implied speed-up = tau * t_1 / (t_draft + t_B) (docs/evaluation.md, 'Implied speed-up on a big target')\n",
          flush=True)
    return {"shapes": [s.to_dict() for s in shapes],
            "target_ms_by_layers": {str(n): {str(k): v for k, v in ms.items()} for n, ms in target_ms.items()},
            "implied": {s.name: {str(t): implied_speedup(t, s) for t in taus if t <= s.block_size} for s in shapes}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="../shared/fixtures/pycode/target")
    ap.add_argument("--drafter", action="append", default=[], help="drafter export or step-N (repeat)")
    ap.add_argument("--prompts", default="../shared/fixtures/pycode/prompts-eval.parquet")
    ap.add_argument("--device", default="0")
    ap.add_argument("--dtype", default="bfloat16", help="decode dtype (bfloat16 for speed; float32 for an exact check)")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--max-prompts", type=int, default=200)
    ap.add_argument("--batch1-prompts", type=int, default=200, help="prompts decoded one at a time (batch 1)")
    ap.add_argument("--batch-size", type=int, default=200)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--bucket-step", type=int, default=None,
                    help="batched: row buckets at every multiple of N rows (then halving) instead of halving "
                         "only (evaluate/graphed.row_buckets)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="Inductor before the CUDA graphs, both sides (default: on a GPU)")
    ap.add_argument("--reference", help="the target's greedy completions (Parquet): float32 outputs checked against them")
    ap.add_argument("--ceiling", action="store_true",
                    help="also part 2: kernel times of a named target shape and its recipe's drafter (eval --implied-for)")
    ap.add_argument("--ceiling-shape", default="qwen3.6-27b", choices=sorted(CEILING_SHAPES))
    ap.add_argument("--ceiling-context", type=int, default=1024, help="tokens cached before the timed forwards")
    ap.add_argument("--ceiling-layers", type=int, default=None,
                    help="build the target with N and 2N layers only (N a multiple of 4) and extend its times "
                         "linearly to all layers (default: all layers; the 27B needs about 60 GB)")
    ap.add_argument("--ceiling-reps", type=int, default=5, help="timed runs per forward (the median is kept)")
    ap.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="--ceiling: block sizes to time (default: the recipe's)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny random targets and drafters")
    ap.add_argument("--tiny-kind", default="qwen3", choices=("qwen3", "qwen3_5"),
                    help="--tiny's target: dense Qwen3 or a Qwen3.5 hybrid (Gated DeltaNet)")
    ap.add_argument("--tiny-method", default="dflash", choices=("dflash", "dspark"),
                    help="--tiny's drafter: DFlash, or DSpark with its Markov and confidence heads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cpu" if args.tiny or args.device == "cpu" else f"cuda:{args.device}"
    out: dict = {"device": device, "argv": sys.argv[1:]}
    import torch

    out["torch"] = torch.__version__
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(device)
    if args.tiny:
        import tempfile

        from dflash_offline.drafter.config import DrafterConfig
        from dflash_offline.drafter.export import export_drafter
        from dflash_offline.drafter.model import DFlashDrafter
        from dflash_offline.tiny import make_tiny_data, make_tiny_target

        tmp = Path(tempfile.mkdtemp(prefix="decode-speed-"))
        args.target = str(make_tiny_target(tmp / "target", kind=args.tiny_kind))
        args.prompts = str(make_tiny_data(tmp / "prompts.parquet", rows=6, min_len=4, max_len=20))
        dcfg = DrafterConfig.from_target(args.target, [1, 3], block_size=4, drafter_layers=1, mask_token_id=1)
        if args.tiny_method == "dspark":  # the heads as DeepSpec's layout holds them, small
            dcfg = dataclasses.replace(dcfg, method="dspark", markov_rank=8, confidence_head=True)
        d = DFlashDrafter(dcfg)
        args.drafter = [str(export_drafter(d, str(tmp / "drafter")))]
        args.dtype, args.max_new_tokens, args.batch1_prompts, args.batch_size = "float32", 12, 2, 4
        args.ignore_eos = True
    if args.compile is None:
        args.compile = device.startswith("cuda")
    try:
        if args.drafter:
            out["pycode"] = part1(args, device)
        if args.ceiling:
            out["ceiling"] = part2(args, device)
    finally:
        if args.tiny:  # its tiny target and drafter: made here, removed here
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
