"""Bare target forward vs `extract` on the same batches, in one run, on one GPU.

The target is built from a config with random weights (no checkpoint needed): by default the
Qwen3.5-27B text shape (64 layers, 3 Gated DeltaNet : 1 attention, hidden 5120). Each variant runs
the same batches of random tokens:

  bare          decoder forward only (no hooks, no LM head): the ceiling
  extract-k0    the extract hot loop: 5 captured layers, async pinned copies, Zarr writes (topk 0)
  extract-k32   the same with chunked top-32 log-probabilities (needs the LM head)

and prints tokens/s for each, with the slowdown against bare. Results go to --out as JSON.

    python benchmarks/extract_throughput.py --shape qwen3.5-27b --batch 8x2048 --batches 12 \
        --cache /dev/shm/bench-cache --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

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
    "tiny-hybrid": dict(kind="qwen3_5", vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4),
}


def build(shape: str, device: str, dtype):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    cfg = (Qwen3_5TextConfig if kind == "qwen3_5" else Qwen3Config)(**spec, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.5-27b", choices=sorted(SHAPES))
    ap.add_argument("--batch", default="8x2048", help="ROWSxLEN of every batch")
    ap.add_argument("--batches", type=int, default=12, help="timed batches per variant (after 2 warm-up)")
    ap.add_argument("--cache", default="/dev/shm/dflash-bench-cache")
    ap.add_argument("--variants", default="bare,extract-k0,extract-k32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda:0" if os.environ.get("CUDA_VISIBLE_DEVICES", "0") != "" else "cpu")
    args = ap.parse_args()

    import numpy as np
    import torch

    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, new_manifest
    from dflash_offline.config import ExtractConfig
    from dflash_offline.extract import _Sink, make_pool, run_shards
    from dflash_offline.target import LayerCapture, default_layer_ids

    device = args.device if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    rows, length = (int(x) for x in args.batch.split("x"))
    t0 = time.time()
    model = build(args.shape, device, dtype)
    print(f"built {args.shape} on {device} in {time.time() - t0:.1f}s "
          f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params)", flush=True)
    L = model.config.num_hidden_layers
    layer_ids = default_layer_ids(L, 5)
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    n_total = args.batches + 2
    batches = [rng.integers(0, V, size=(rows, length)) for _ in range(n_total)]
    decoder = model.get_decoder()

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    results = {"shape": args.shape, "batch": args.batch, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
               "torch": torch.__version__, "layer_ids": layer_ids, "variants": {}}
    try:
        import fla  # noqa: F401

        results["fla"] = getattr(fla, "__version__", "yes")
    except ImportError:
        results["fla"] = None
    try:
        import causal_conv1d  # noqa: F401

        results["causal_conv1d"] = True
    except ImportError:
        results["causal_conv1d"] = False

    for variant in args.variants.split(","):
        if variant == "bare":
            mask = torch.ones(rows, length, dtype=torch.long, device=device)
            times = []
            with torch.inference_mode():
                for i, b in enumerate(batches):
                    x = torch.from_numpy(b).to(device)
                    sync()
                    t = time.perf_counter()
                    decoder(input_ids=x, attention_mask=mask, use_cache=False)
                    sync()
                    if i >= 2:
                        times.append(time.perf_counter() - t)
            dt = sum(times)
            tokens = rows * length * args.batches
            results["variants"][variant] = {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}
        else:
            topk = int(variant.split("-k")[1])
            shutil.rmtree(args.cache, ignore_errors=True)
            cfg = ExtractConfig(target="-", data=["-"], cache=args.cache, topk=topk, max_len=length,
                                batch_tokens=rows * length, shard_tokens=rows * length * 4, chunk_tokens=1024)
            loc = Location(args.cache)
            store = ManifestStore(loc)
            store.init_or_check(new_manifest(target={}, capture={}, source={},
                                             plan={"num_shards": 10**9, "shard_tokens": 0, "sort_window": 0}))
            loc.makedirs("shards")
            capture = LayerCapture(model, layer_ids)
            pool = make_pool(torch, cfg, len(layer_ids), model.config.hidden_size, device.startswith("cuda"))
            written = {"bytes": 0}
            sink = _Sink(loc, store, dict(num_layers=len(layer_ids), hidden_size=model.config.hidden_size, topk=topk,
                                          chunk_tokens=cfg.chunk_tokens, layer_ids=layer_ids, hidden_dtype="bfloat16"),
                         lambda t, nb: written.__setitem__("bytes", written["bytes"] + nb))
            mask_np = np.ones(length, np.uint8)

            def shards(bs, start):
                per = 4
                for s in range(0, len(bs), per):
                    part = bs[s:s + per]
                    yield start + s // per, [(int(i), b[r].astype(np.int32), mask_np)
                                             for i, b in enumerate(part) for r in range(rows)]

            # Warm-up shard (2 batches) through a throwaway sink run, then the timed run.
            run_shards(model, capture, cfg, shards(batches[:2], 0), sink, pool, device)
            sink = _Sink(loc, store, sink.layout_kw, sink.on_progress)
            written["bytes"] = 0
            sync()
            t = time.perf_counter()
            tokens = run_shards(model, capture, cfg, shards(batches[2:], 1000), sink, pool, device)
            sync()
            dt = time.perf_counter() - t
            capture.remove()
            results["variants"][variant] = {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt,
                                            "bytes_written": written["bytes"], "write_GB_per_s": written["bytes"] / dt / 1e9}
            shutil.rmtree(args.cache, ignore_errors=True)
        print(f"{variant}: {results['variants'][variant]['tokens_per_s']:.0f} tokens/s", flush=True)
        if device.startswith("cuda"):
            results["variants"][variant]["max_mem_GB"] = torch.cuda.max_memory_allocated() / 1e9

    bare = results["variants"].get("bare", {}).get("tokens_per_s")
    print("\n| variant | tokens/s | vs bare | GB/s written |")
    print("|---|---|---|---|")
    for name, v in results["variants"].items():
        rel = f"{v['tokens_per_s'] / bare:.3f}" if bare else "-"
        print(f"| {name} | {v['tokens_per_s']:.0f} | {rel} | {v.get('write_GB_per_s', 0):.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
