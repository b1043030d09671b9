"""Bare target forward vs `extract` on the same batches, in one run, on one GPU, and where the time goes.

The target is built from a config with random weights (no checkpoint needed): the Qwen3.5-27B text
shape (64 layers, 3 Gated DeltaNet : 1 attention, hidden 5120) and a dense Qwen3-8B shape. For each
shape and batch shape the variants run the same batches of random tokens:

  bare            decoder forward only (no hooks, no LM head; `logits_to_keep=1` in effect): the ceiling
  bare-head       the same plus the LM head over every token, as a plain forward of the model
                  computes it (what top-k needs); logits dropped
  forward-k0      `target.forward_batch`: 5 layers captured by hooks and gathered on the GPU, no copies
  forward-k32     the same plus the chunked top-32 log-probabilities
  extract-k0      the extract hot loop (`extract.run_shards`): forward-k0, async copies into shared
                  page-locked slots, writer processes writing Zarr shards with CRC32C, commits
  extract-k32     the same with top-32
  extract-k32-w2  the same with two writer processes
  copy-k32        extract-k32 with writers that return each slot unwritten: the pipeline without storage
  ragged-k32      extract-k32 on samples of random lengths (uniform in [len/8, len]) planned and
                  batched as the stage does: real tokens/s and the padding the stage reports (timed
                  on a second pass over the same plan, after every batch shape has been seen once)
  bare-torchconv  bare with transformers' PyTorch depthwise conv instead of causal-conv1d (only
                  when causal-conv1d is installed)

Prints one table per shape with tokens/s, the ratio to bare and to bare-head, the model FLOP/s of
the bare forward against the bf16 matmul peak, and the per-batch time each step adds.
Results go to --out as JSON, rewritten after every variant.

    python benchmarks/extract_throughput.py --shapes qwen3.5-27b,qwen3-8b --batch 8x2048 \
        --cache /dev/shm/bench-cache --out results.json
    python benchmarks/extract_throughput.py --smoke       # CPU, a tiny hybrid shape, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

PEAK = 774e12  # bf16 dense matmul, measured on an H200

SHAPES = {
    # Qwen3.5-27B text model (dflash-method.md).
    "qwen3.5-27b": dict(kind="qwen3_5", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4),
    # A 16-layer cut of the same shape: quick checks.
    "qwen3.5-27b-16l": dict(kind="qwen3_5", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                            num_hidden_layers=16, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                            linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4),
    # Dense Qwen3-8B.
    "qwen3-8b": dict(kind="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "tiny-hybrid": dict(kind="qwen3_5", vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4),
    "tiny-dense": dict(kind="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
ALL = ("bare,bare-head,forward-k0,forward-k32,copy-k32,extract-k0,extract-k32,extract-k32-w2,ragged-k32,"
       "bare-torchconv")


def build(shape: str, device: str, dtype):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    from dflash_offline.targets.model import route_cpu_tensors_to_torch_kernels

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    cfg = (Qwen3_5TextConfig if kind == "qwen3_5" else Qwen3Config)(**spec, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    if kind == "qwen3_5":
        route_cpu_tensors_to_torch_kernels(model)
    return model


def linear_flops_per_token(model) -> float:
    """2 x the decoder's matmul parameters (embedding excluded; attention scores not counted)."""
    dec = model.get_decoder()
    n = sum(p.numel() for name, p in dec.named_parameters() if p.dim() == 2 and "embed" not in name)
    return 2.0 * n


CONV_CALLS = {"n": 0}


def torch_conv(model, on: bool):
    """Route the Gated DeltaNet short conv to transformers' PyTorch fallback (on=True) or back.
    The fallback is wrapped with a counter, so the table can show that it really ran."""
    import sys as _sys

    mods = {_sys.modules[type(m).__module__] for m in model.modules() if "GatedDeltaNet" in type(m).__name__}
    for mod in mods:
        fn = getattr(mod, "causal_conv1d_fn", None)
        if on and fn is not None:
            mod._dflash_conv_saved = fn
            ref = fn
            while getattr(ref, "__wrapped__", None) is not None:  # our CPU router, then transformers' hub wrapper
                ref = ref.__wrapped__

            def counted(*a, _ref=ref, **kw):
                CONV_CALLS["n"] += 1
                return _ref(*a, **kw)

            mod.causal_conv1d_fn = counted
        elif not on and hasattr(mod, "_dflash_conv_saved"):
            mod.causal_conv1d_fn = mod._dflash_conv_saved
            del mod._dflash_conv_saved
    for m in model.modules():  # transformers versions that bind the kernel per layer
        if "GatedDeltaNet" in type(m).__name__ and hasattr(m, "causal_conv1d_fn"):
            if on:
                m._dflash_conv_saved = m.causal_conv1d_fn
                m.causal_conv1d_fn = None
            elif hasattr(m, "_dflash_conv_saved"):
                m.causal_conv1d_fn = m._dflash_conv_saved


def run_shape(args, shape: str, results: dict, save) -> None:
    import numpy as np
    import torch

    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, new_manifest
    from dflash_offline.config import ExtractConfig
    from dflash_offline.cache.shards import ShardShape
    from dflash_offline.extract.plan import make_batches, make_plan
    from dflash_offline.extract.worker import make_sink, run_shards
    from dflash_offline.targets.model import LayerCapture, default_layer_ids, forward_batch

    device = args.device
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.time()
    model = build(shape, device, dtype)
    flops_tok = linear_flops_per_token(model)
    print(f"built {shape} on {device} in {time.time() - t0:.1f}s "
          f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params)", flush=True)
    L, H, V = model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size
    layer_ids = default_layer_ids(L, 5)
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    try:
        import causal_conv1d  # noqa: F401

        has_conv = True
    except ImportError:
        has_conv = False
    is_hybrid = SHAPES[shape]["kind"] == "qwen3_5"
    shape_res = results["shapes"].setdefault(shape, {"params_B": sum(p.numel() for p in model.parameters()) / 1e9,
                                                     "layer_ids": layer_ids, "linear_flops_per_token": flops_tok,
                                                     "batches": {}})

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for batch_spec in args.batch.split(","):
        rows, length = (int(x) for x in batch_spec.split("x"))
        rng = np.random.default_rng(0)
        n_total = args.batches + args.warmup
        batches = [rng.integers(0, V, size=(rows, length)) for _ in range(n_total)]
        res = shape_res["batches"].setdefault(batch_spec, {})
        variants = args.variants.split(",") if batch_spec == args.batch.split(",")[0] else args.scaling_variants.split(",")
        for variant in variants:
            if variant == "bare-torchconv" and not (has_conv and is_hybrid):
                continue
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            out = {}
            if variant in ("bare", "bare-head", "bare-torchconv", "forward-k0", "forward-k32"):
                mask = torch.ones(rows, length, dtype=torch.long, device=device)
                index = torch.arange(rows * length, device=device)
                capture = LayerCapture(model, layer_ids) if variant.startswith("forward") else None
                if variant == "bare-torchconv":
                    CONV_CALLS["n"] = 0
                    torch_conv(model, True)
                times = []
                with torch.inference_mode():
                    for i, b in enumerate(batches):
                        x = torch.from_numpy(b).to(device)
                        sync()
                        t = time.perf_counter()
                        if capture is not None:
                            forward_batch(model, capture, x, mask, index, int(variant.split("-k")[1]),
                                          args.logits_chunk_tokens)
                        else:
                            h = decoder(input_ids=x, attention_mask=mask, use_cache=False).last_hidden_state
                            if variant == "bare-head":
                                for a in range(0, rows * length, args.logits_chunk_tokens):
                                    head(h.view(-1, H)[a:a + args.logits_chunk_tokens])
                        sync()
                        if i >= args.warmup:
                            times.append(time.perf_counter() - t)
                if variant == "bare-torchconv":
                    torch_conv(model, False)
                if capture is not None:
                    capture.remove()
                dt = sum(times)
                tokens = rows * length * args.batches
                out = {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt, "s_per_batch": dt / args.batches}
                if variant == "bare-torchconv":
                    out["fallback_conv_calls"] = CONV_CALLS["n"]
            else:
                ragged = variant.startswith("ragged")
                discard = variant.startswith("copy")
                topk = int(variant.split("-k")[1].split("-")[0])
                writers = 2 if variant.endswith("-w2") else 1
                shutil.rmtree(args.cache, ignore_errors=True)
                # Shards of 4 batches: a commit every 4 batches, as with the default 65,536-token shards.
                cfg = ExtractConfig(target="-", data=["-"], cache=args.cache, topk=topk, max_len=length,
                                    batch_tokens=rows * length, shard_tokens=rows * length * 4, chunk_tokens=1024,
                                    logits_chunk_tokens=args.logits_chunk_tokens, writers=writers)
                loc = Location(args.cache)
                store = ManifestStore(loc)
                store.init_or_check(new_manifest(target={}, capture={}, source={},
                                                 plan={"num_shards": 10**9, "shard_tokens": 0, "sort_window": 0}))
                loc.makedirs("shards")
                capture = LayerCapture(model, layer_ids)
                layout = ShardShape(cache_layers=len(layer_ids), hidden_size=H, topk=topk,
                                    chunk_tokens=cfg.chunk_tokens, layer_ids=layer_ids, hidden_dtype="bfloat16")
                written = {"bytes": 0}

                def on_progress(t, nb):
                    written["bytes"] += nb

                def sink():
                    return make_sink(cfg, layout, cuda, loc.path("logs"), f"bench-{variant}", on_progress, discard)

                if ragged:
                    # Random lengths, planned and batched as the stage does (longest first per window).
                    lr = np.random.default_rng(1)
                    lens = lr.integers(length // 8, length + 1, size=rows * n_total * 2)
                    lens = lens[: np.searchsorted(np.cumsum(lens), rows * length * n_total)]
                    plan = make_plan(lens, length, cfg.shard_tokens, 8192)
                    toks = [lr.integers(0, V, size=int(t)).astype(np.int32) for t in lens]
                    ones = [np.ones(int(t), np.uint8) for t in lens]
                    all_shards = [(j, [(int(r), toks[r], ones[r]) for r in rows_j]) for j, rows_j in enumerate(plan)]
                    # Warm-up: the whole plan once (every batch shape meets its kernels' autotuning
                    # once per process, as in a long run), then the same plan timed.
                    warm = [(10**6 + j, s) for j, s in all_shards]
                    timed = [(1000 + j, s) for j, s in all_shards]
                    n_batches = sum(len(make_batches([s[1].shape[0] for s in smp], cfg.batch_tokens)) for _, smp in timed)
                else:
                    mask_np = np.ones(length, np.uint8)

                    def shards(bs, start):
                        for s in range(0, len(bs), 4):
                            part = bs[s:s + 4]
                            yield start + s // 4, [(int(i), b[r].astype(np.int32), mask_np)
                                                   for i, b in enumerate(part) for r in range(rows)]
                    warm = list(shards(batches[:args.warmup], 0))
                    timed = list(shards(batches[args.warmup:], 1000))
                    n_batches = args.batches
                run_shards(model, capture, cfg, iter(warm), sink(), device)  # compiles nothing; warms the allocator
                s = sink()
                written["bytes"] = 0
                sync()
                t = time.perf_counter()
                stats = run_shards(model, capture, cfg, iter(timed), s, device)
                sync()
                dt = time.perf_counter() - t
                capture.remove()
                out = {"tokens": stats["tokens"], "forward_tokens": stats["forward_tokens"],
                       "padding_fraction": stats["padding_fraction"], "seconds": dt,
                       "tokens_per_s": stats["tokens"] / dt, "forward_tokens_per_s": stats["forward_tokens"] / dt,
                       "s_per_batch": dt / n_batches, "batches": n_batches, "writers": writers,
                       "bytes_written": written["bytes"], "write_GB_per_s": written["bytes"] / dt / 1e9,
                       "writer_busy_fraction": s.stats["writer_busy_s"] / (dt * writers), "sink": dict(s.stats),
                       # A worker closes its writers once per run: steady state leaves that out.
                       "tokens_per_s_with_close": stats["tokens"] / dt}
                out["seconds"] = dt - s.stats.get("close_s", 0.0)
                out["tokens_per_s"] = stats["tokens"] / out["seconds"]
                out["s_per_batch"] = out["seconds"] / n_batches
                shutil.rmtree(args.cache, ignore_errors=True)
            if cuda:
                out["max_mem_GB"] = torch.cuda.max_memory_allocated() / 1e9
            res[variant] = out
            print(f"{shape} {batch_spec} {variant}: {out['tokens_per_s']:.0f} tokens/s", flush=True)
            save()
        print_table(shape, batch_spec, res, flops_tok)
    del model
    if cuda:
        torch.cuda.empty_cache()


def print_table(shape: str, batch: str, res: dict, flops_tok: float) -> None:
    bare = res.get("bare", {}).get("tokens_per_s")
    bh = res.get("bare-head", {}).get("tokens_per_s")
    bare_s = res.get("bare", {}).get("s_per_batch")
    print(f"\n{shape}, batches of {batch}")
    print("| variant | tokens/s | vs bare | vs bare-head | ms/batch over bare | written GB/s | writer busy | padding |"
          " peak GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, v in res.items():
        rel = f"{v['tokens_per_s'] / bare:.3f}" if bare else "-"
        relh = f"{v['tokens_per_s'] / bh:.3f}" if bh else "-"
        extra = f"{(v['s_per_batch'] - bare_s) * 1e3:+.0f}" if bare_s and not name.startswith("ragged") else "-"
        wb = f"{100 * v['writer_busy_fraction']:.0f}%" if "writer_busy_fraction" in v else "-"
        pad = f"{100 * v['padding_fraction']:.1f}%" if "padding_fraction" in v else "-"
        print(f"| {name} | {v['tokens_per_s']:,.0f} | {rel} | {relh} | {extra} | {v.get('write_GB_per_s', 0):.2f} |"
              f" {wb} | {pad} | {v.get('max_mem_GB', 0):.1f} |")
    for name, v in res.items():
        if "sink" in v:
            st, nb = v["sink"], v["batches"]
            print(f"  {name}: per batch, the loop waited {1e3 * st['wait_slot_s'] / nb:.0f} ms for a free slot; writers spent "
                  f"{1e3 * st.get('write_s', 0) / nb:.0f} ms writing, {1e3 * st.get('hash_s', 0) / nb:.0f} ms hashing, "
                  f"{1e3 * st.get('stage_s', 0) / nb:.0f} ms staging, busy {1e3 * st['writer_busy_s'] / nb:.0f} ms; "
                  f"closing the writers took {1e3 * st.get('close_s', 0):.0f} ms once")
        if "fallback_conv_calls" in v:
            print(f"  {name}: the PyTorch conv ran {v['fallback_conv_calls']} times")
    if bare:
        print(f"bare forward: {bare * flops_tok / 1e12:.0f} TFLOP/s of matmuls = {100 * bare * flops_tok / PEAK:.1f}% "
              f"of the {PEAK / 1e12:.0f} TFLOP/s bf16 peak", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3.5-27b,qwen3-8b", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--batch", default="8x2048",
                    help="ROWSxLEN of every batch; a comma list runs --variants on the first, --scaling-variants on the rest")
    ap.add_argument("--batches", type=int, default=8, help="timed batches per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed batches before each variant")
    ap.add_argument("--cache", default="/dev/shm/dflash-bench-cache")
    ap.add_argument("--variants", default=ALL)
    ap.add_argument("--scaling-variants", default="bare,extract-k32")
    ap.add_argument("--logits-chunk-tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 2 batches: checks that the script runs")
    args = ap.parse_args()

    import torch

    if args.smoke:
        args.shapes, args.batch, args.batches, args.warmup = "tiny-hybrid", "2x64", 2, 1
        args.device = "cpu"
    args.device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    results = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "torch": torch.__version__, "batch": args.batch, "cpus": len(os.sched_getaffinity(0)),
               "shapes": {}}
    try:
        import transformers

        results["transformers"] = transformers.__version__
        import fla

        results["fla"] = getattr(fla, "__version__", "yes")
    except ImportError:
        results["fla"] = None
    try:
        import causal_conv1d

        results["causal_conv1d"] = getattr(causal_conv1d, "__version__", "yes")
    except ImportError:
        results["causal_conv1d"] = None
    print(json.dumps({k: v for k, v in results.items() if k != "shapes"}), flush=True)

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    results["writer_capacity"] = writer_capacity(args.cache, args.smoke)
    print("writer capacity:", json.dumps(results["writer_capacity"]), flush=True)
    save()
    for shape in args.shapes.split(","):
        run_shape(args, shape, results, save)
    save()


def writer_capacity(cache: str, smoke: bool) -> dict:
    """One ShardWriter in this process, writing batches of a 27B target's five layers from memory
    into `cache`: the GB/s one writer process sustains, and where its time goes."""
    import numpy as np

    from dflash_offline.cache.location import Location
    from dflash_offline.cache.writer import ShardLayout, ShardWriter

    n, H, k = (5, 5120, 32) if not smoke else (5, 64, 4)
    T = 16384 if not smoke else 256
    shutil.rmtree(cache, ignore_errors=True)
    loc = Location(cache)
    rng = np.random.default_rng(0)
    h = rng.integers(0, 1 << 16, size=(T, n, H), dtype=np.uint16)
    ti = rng.integers(0, 1 << 17, size=(T, k), dtype=np.int32)
    tl = rng.standard_normal((T, k)).astype(np.float16)
    out = {}
    for shards in (1, 3):
        t0 = time.perf_counter()
        timing = {}
        for j in range(shards):
            w = ShardWriter(loc, f"cap-{shards}-{j}.zarr", ShardLayout(tokens=4 * T, cache_layers=n, hidden_size=H, topk=k,
                                                                        chunk_tokens=1024, layer_ids=list(range(n))))
            for b in range(4):
                w.append_batch([(b * 8 + r, np.zeros(T // 8, np.int32), np.ones(T // 8, np.uint8)) for r in range(8)],
                               h, ti, tl)
            w.close(f"cap-{j}")
            for key, v in w.timing.items():
                timing[key] = timing.get(key, 0) + v
        dt = time.perf_counter() - t0
        out[f"{shards}_shards"] = {"GB_per_s": timing["bytes"] / dt / 1e9, "seconds": dt,
                                   **{key: v for key, v in timing.items() if key != "bytes"}, "bytes": timing["bytes"]}
    shutil.rmtree(cache, ignore_errors=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
