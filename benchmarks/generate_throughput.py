"""`generate` on one GPU: the pycode target end to end, and a Qwen3.5-27B-shaped target's decode rate.

pycode (the trained fixture target, runs of the real command, each its own process):
  1. continuous batching (the default) against padded batches, eager and compiled (CUDA graphs),
     on the same first N prompts of prompts-train-40k.parquet, fp32, greedy, 384 new tokens (the
     rows must be equal);
  2. exactness: fp32 completions of the fixture's 4000 training and 200 held-out prompts against
     the fixture's own completions (made by its authors' fp32 KV-cache greedy loop);
  3. all 39,051 prompts of prompts-train-40k.parquet x 384 new tokens, fp32 (continuous and
     padded) and bf16: wall time of
     the command (start-up, model load and compile included) and the decode rate; then how often
     bf16 rows equal fp32 rows and where they part.

qwen3.5-27b (in this process, random bf16 weights built on the GPU, flash-linear-attention on):
`decoding.BatchDecoder` at several batch sizes, prompt 128 tokens + N new: new tokens/s of the
decode steps, and their share of the memory-bandwidth bound (each step reads every weight and the
attention cache, reads and writes the Gated DeltaNet states; 4.26 TB/s, the device copy rate
measured on the H200).

    python benchmarks/generate_throughput.py pycode --fixture .fixtures/pycode --work /dev/shm/gen --results out/
    python benchmarks/generate_throughput.py shape27b --batches 1,32,128 --new 64 --results out/

`--smoke` runs either on the CPU with a tiny target, to check the script.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY_BW = 4.26e12  # bytes/s, device-to-device copy on the H200 (gpu-machine.md)


def generate(args: list, log: Path) -> dict:
    """Run `dflash-offline generate`; -> wall time, totals, the worker's decode rate."""
    t0 = time.time()
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "dflash_offline", "generate", *map(str, args), "--no-progress"],
                           stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.time() - t0
    out = Path(args[args.index("--out") + 1])
    if r.returncode != 0:
        logs = "".join(p.read_text() for p in sorted((out / "logs").glob("*.log")))
        raise SystemExit(f"generate failed ({r.returncode}):\n" + "".join(log.read_text().splitlines(True)[-10:])
                         + "".join(logs.splitlines(True)[-60:]))
    m = json.loads((out / "manifest.json").read_text())
    logs = "\n".join(p.read_text() for p in (out / "logs").glob("*.log"))
    done = re.findall(r"worker \d+: (\d+) prompts, (\d+) new tokens in ([\d.]+)s", logs)
    loaded = re.findall(r"loaded target in ([\d.]+)s", logs)
    decode_s = max(float(d[2]) for d in done)
    # Steady state: the batches after the first (which also pays for compilation).
    # (padded: one line per batch; continuous: one line per part)
    batches = [(int(n), float(sec)) for n, sec in re.findall(r"batch of \d+ prompts: (\d+) new tokens in ([\d.]+)s", logs)]
    batches += [(int(n), float(sec)) for n, sec in re.findall(r"\d+ prompts, (\d+) new tokens in ([\d.]+)s \(\d+ steps", logs)]
    later = batches[1:] or batches
    return {"wall_s": wall, "rows": m["totals"]["rows"], "new_tokens": m["totals"]["new_tokens"],
            "ended_by_eos": m["totals"]["ended_by_eos"], "decode_s": decode_s,
            "load_s": max(float(x) for x in loaded) if loaded else None,
            "new_tokens_per_s_wall": m["totals"]["new_tokens"] / wall,
            "new_tokens_per_s_decode": m["totals"]["new_tokens"] / decode_s,
            "first_batch_s": batches[0][1] if batches else None,
            "new_tokens_per_s_steady": sum(n for n, _ in later) / max(sum(t for _, t in later), 1e-9)}


def rows_of(path: Path) -> dict[int, list[int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.is_dir():
        m = json.loads((path / "manifest.json").read_text())
        t = pa.concat_tables([pq.read_table(path / p["file"], columns=["id", "input_ids"]) for p in m["parts"]])
    else:
        t = pq.read_table(path, columns=["id", "input_ids"])
    return dict(zip(t.column("id").to_pylist(), t.column("input_ids").to_pylist()))


def agreement(a: dict[int, list[int]], b: dict[int, list[int]], prompt_len: int) -> dict:
    """Rows equal over their whole length, and the completion position where the others part."""
    same, parts = 0, []
    for k, x in a.items():
        y = b[k]
        if x == y:
            same += 1
            continue
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        parts.append(n - prompt_len)
    parts.sort()
    return {"rows": len(a), "identical": same, "share": same / max(len(a), 1),
            "first_difference_median": parts[len(parts) // 2] if parts else None,
            "first_difference_min": parts[0] if parts else None}


def save_to(args):
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    return lambda res: (out / f"generate-{args.what}.json").write_text(json.dumps(res, indent=1))


def pycode(args) -> dict:
    save = save_to(args)
    import pyarrow as pa
    import pyarrow.parquet as pq

    fx, work = Path(args.fixture), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"new_tokens": args.new}
    prompts40k = fx / "prompts-train-40k.parquet"
    n_all = pq.read_metadata(prompts40k).num_rows
    if args.limit:
        t = pq.read_table(prompts40k).slice(0, args.limit)
        prompts40k = work / "prompts-limited.parquet"
        pq.write_table(t, prompts40k)
        n_all = t.num_rows
    # The fixture's own prompts (first 128 tokens of its completions); held-out ids moved past the training ones.
    fixture_rows = {}
    tables = []
    for name, off in (("completions-train.parquet", 0), ("completions-eval.parquet", 1_000_000)):
        t = pq.read_table(fx / name)
        if args.limit:
            t = t.slice(0, max(1, args.limit // 8))
        ids = [i + off for i in t.column("id").to_pylist()]
        seqs = t.column("input_ids").to_pylist()
        fixture_rows.update(zip(ids, seqs))
        tables.append(pa.table({"id": pa.array(ids, pa.int64()),
                                "input_ids": pa.array([s[:128] for s in seqs], pa.list_(pa.int32()))}))
    fixture_prompts = work / "fixture-prompts.parquet"
    pq.write_table(pa.concat_tables(tables), fixture_prompts)
    subset = work / "subset.parquet"
    pq.write_table(pq.read_table(prompts40k).slice(0, args.subset), subset)

    base = ["--target", fx / "target", "--devices", args.device, "--max-new-tokens", args.new,
            "--batch-tokens", args.batch_tokens, "--chunk-prompts", args.chunk_prompts]
    runs = res["runs"] = {}

    def go(name, prompts, *extra):
        out = work / name
        runs[name] = generate([*base, "--prompts", prompts, "--out", out, *extra], work / f"{name}.log")
        print(f"{name}: {json.dumps(runs[name])}", flush=True)
        save(res)  # after every run: a run cut short by a time limit keeps what it measured
        return out

    parts = set(args.parts.split(","))
    if parts - {"subset", "fixture", "full"}:
        raise SystemExit(f"--parts {args.parts}: choose from subset, fixture, full")
    if "subset" in parts:
        subset_runs(go, subset, res, args.smoke)
    if "fixture" in parts:
        fx_out = go("fixture-fp32", fixture_prompts, "--compute-dtype", "float32")
        res["fixture_vs_ours_fp32"] = agreement(fixture_rows, rows_of(fx_out), 128)
        save(res)
        print(f"fixture completions reproduced: {json.dumps(res['fixture_vs_ours_fp32'])}", flush=True)
    if "full" in parts and not args.skip_full:
        a = go("all-fp32", prompts40k, "--compute-dtype", "float32")
        p = go("all-fp32-padded", prompts40k, "--compute-dtype", "float32", "--batching", "padded")
        res["continuous_vs_padded_fp32_all"] = agreement(rows_of(p), rows_of(a), 128)
        b = go("all-bf16", prompts40k, "--compute-dtype", "bfloat16")
        res["bf16_vs_fp32"] = agreement(rows_of(a), rows_of(b), 128)
        print(f"bf16 against fp32: {json.dumps(res['bf16_vs_fp32'])}", flush=True)
    res["prompts_all"] = n_all
    return res


def subset_runs(go, subset: Path, res: dict, smoke: bool) -> None:
    """Continuous batching (the default) against padded batches, eager and (GPU) compiled, same prompts."""
    c = go("subset-fp32-continuous", subset, "--compute-dtype", "float32", "--batching", "continuous")
    e = go("subset-fp32-padded", subset, "--compute-dtype", "float32", "--batching", "padded")
    if not smoke:
        go("subset-fp32-padded-compiled", subset, "--compute-dtype", "float32", "--batching", "padded", "--compile")
    res["continuous_vs_padded_fp32"] = agreement(rows_of(e), rows_of(c), 128)


def shape27b(args) -> dict:
    import torch

    save = save_to(args)
    sys.path.insert(0, str(ROOT))
    from dflash_offline.generate.decoding import BatchDecoder
    from dflash_offline.sampling import Sampling
    from dflash_offline.targets.model import route_cpu_tensors_to_torch_kernels

    if args.smoke:
        from transformers import AutoModelForCausalLM

        from dflash_offline.tiny import tiny_config

        device = "cpu"
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(tiny_config("qwen3_5", 4), dtype=torch.float32)
    else:
        from transformers.models.qwen3_5 import Qwen3_5TextConfig
        from transformers import AutoModelForCausalLM

        device = "cuda"
        cfg = Qwen3_5TextConfig(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                                linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                                linear_conv_kernel_dim=4, max_position_embeddings=32768, tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        t0 = time.time()
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        print(f"built 27B-shaped target in {time.time() - t0:.0f}s", flush=True)
    model.eval().requires_grad_(False)
    route_cpu_tensors_to_torch_kernels(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    res = {"params": sum(p.numel() for p in model.parameters()), "weight_bytes": weight_bytes, "runs": []}
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    if args.continuous:
        continuous_steps(model, args, weight_bytes, res, save, device)
    for compile in ([False] if args.padded else []) + ([True] if args.compile else []):
        for B in [int(b) for b in args.batches.split(",")]:
            prompts = torch.randint(2, vocab, (B, args.prompt), generator=g).tolist()
            try:
                dec = BatchDecoder(model, B, args.prompt, args.new, set(), Sampling(), compile=compile)
                dec.decode(prompts, list(range(B)))  # warm-up (and compile)
                r = dec.decode(prompts, list(range(B)))
            except Exception as e:  # noqa: BLE001 - recorded: a variant that fails must not hide the others
                res["runs"].append({"batch": B, "compiled": compile, "error": f"{type(e).__name__}: {e}"[:500]})
                save(res)
                print(f"B={B} compiled={compile}: FAILED {e}", flush=True)
                continue
            cache = dec.cache if compile else None
            state = kv = 0
            if cache is None:  # the eager batch's own cache is gone: rebuild one to measure its bytes
                from transformers import StaticCache

                cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.new)
                with torch.inference_mode():
                    model(input_ids=torch.tensor(prompts[:B], device=device), use_cache=True, logits_to_keep=1,
                          **{dec.cache_arg: cache})
            for layer in cache.layers:
                for attr in ("conv_states", "recurrent_states"):
                    v = getattr(layer, attr, None)
                    for t in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else []):
                        if isinstance(t, torch.Tensor):
                            state += t.numel() * t.element_size()
                for attr in ("keys", "values"):
                    t = getattr(layer, attr, None)
                    if isinstance(t, torch.Tensor):
                        kv += t.numel() * t.element_size()
            del cache
            step_s = (r.seconds - r.prefill_s) / max(r.steps, 1)
            bound_s = (weight_bytes + 2 * state + kv) / COPY_BW
            row = {"batch": B, "compiled": compile, "prompt": args.prompt, "new": args.new, "steps": r.steps,
                   "prefill_s": r.prefill_s, "step_ms": 1e3 * step_s, "new_tokens_per_s": B / step_s,
                   "state_bytes": state, "kv_bytes": kv, "bound_step_ms": 1e3 * bound_s,
                   "share_of_bandwidth_bound": bound_s / step_s,
                   "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None}
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
            save(res)
            del dec
            if device == "cuda":
                torch.cuda.empty_cache()
    return res


def continuous_steps(model, args, weight_bytes: int, res: dict, save, device: str) -> None:
    """generate's continuous decoder (static buffers, the step one CUDA graph): every slot admitted,
    then --new steps timed, for each state tile x SDPA backend x step in --steps (fused: targets/fused_step.py's
    compiled pieces; plain: the layers' own modules); the bound counts the weights, the attention buffers
    and the Gated DeltaNet states and windows read and written once per step."""
    import torch

    from dflash_offline.targets import attention, recurrent

    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    for B in [int(b) for b in args.batches.split(",")]:
        prompts = [torch.randint(2, vocab, (args.prompt,), generator=g).tolist() for _ in range(B)]
        for tile, sdpa, step in itertools.product(args.state_tiles, args.sdpa, args.steps.split(",")):
            # Both are read when the step's CUDA graph is captured (continuous_run captures anew).
            recurrent.IN_PLACE_TILE = recurrent.StateTile.parse(tile)
            attention.ONE_TOKEN_SDPA = sdpa
            row = continuous_run(model, args, B, prompts, step, weight_bytes, device)
            res["runs"].append({**row, "state_tile": tile, "sdpa": sdpa})
            print(json.dumps(res["runs"][-1]), flush=True)
            save(res)


def listed(pattern: str, what: str):
    """An argparse type: a comma list whose items each match `pattern`, refused at parsing (before the
    target is built) otherwise."""
    def parse(value: str) -> list[str]:
        items = value.split(",")
        bad = [x for x in items if not re.fullmatch(pattern, x)]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)}: {what}")
        return items
    return parse


def continuous_run(model, args, B: int, prompts: list, step: str, weight_bytes: int, device: str) -> dict:
    """One batch size and step kind: the timed steps (and, with --profile, where a step's time goes)."""
    import torch

    from dflash_offline.generate.continuous import ContinuousDecoder, Request
    from dflash_offline.sampling import Sampling

    try:
        gc.collect()  # the previous decoder's buffers and CUDA graph pool go before this one's are made
        torch.cuda.empty_cache() if device == "cuda" else None
        dec = ContinuousDecoder(model, B, args.prompt, args.new + 1, set(), Sampling(), check_every=args.new,
                                stage_rows=min(B, 64), fused_step=step == "fused")
        t0 = time.perf_counter()
        if dec.graphs:
            with torch.inference_mode():
                dec._capture()  # (the fused step compiles here, in the warm-up steps before the capture)
        capture_s = time.perf_counter() - t0
        requests = [Request(i, p) for i, p in enumerate(prompts)]
        with torch.inference_mode():
            for a in range(0, B, dec.stage.rows):
                dec._admit(list(range(a, min(B, a + dec.stage.rows))), requests[a:a + dec.stage.rows])
            for _ in range(3):  # warm-up steps
                dec._run_step()
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.new - 3):
                dec._run_step()
            if device == "cuda":
                torch.cuda.synchronize()
            step_s = (time.perf_counter() - t0) / (args.new - 3)
            first = dec.out[:, :4].tolist()  # the first new tokens: the steps must agree on them
            profile = profile_step(dec, device) if B in args.profile_batches else None
    except Exception as e:  # noqa: BLE001 - recorded: a variant that fails must not hide the others
        print(f"continuous B={B} step={step}: FAILED {e}", flush=True)
        return {"batch": B, "decoder": "continuous", "step": step, "error": f"{type(e).__name__}: {e}"[:500]}
    state = sum(t.numel() * t.element_size() for m in dec.target.recurrent for t in m.buffers())
    kv = sum(t.numel() * t.element_size() for t in dec.target.buffers()) - state
    bound_s = (weight_bytes + 2 * state + kv) / COPY_BW
    row = {"batch": B, "decoder": "continuous", "step": step, "graphs": dec.graphs, "capture_s": capture_s,
           "prompt": args.prompt, "new": args.new, "step_ms": 1e3 * step_s, "new_tokens_per_s": B / step_s,
           "state_bytes": state, "kv_bytes": kv, "bound_step_ms": 1e3 * bound_s,
           "share_of_bandwidth_bound": bound_s / step_s, "first_tokens": first,
           "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None}
    if profile is not None:
        row["profile"] = profile
    del dec
    return row


def profile_step(dec, device: str) -> dict:
    """Kernels of one step, unrolled (the eager step: each kernel launched from Python) and replayed
    (the CUDA graph): how many, the GPU's busy time, and the ten costliest by name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = {}
    if device != "cuda":
        return out
    for name, run in (("eager", dec._step), ("graph", dec._run_step)):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict[str, list] = {}
        for e in kernels:
            t = by_name.setdefault(e.name[:90], [0, 0.0])
            t[0] += 1
            t[1] += e.device_time / 1e3
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:10]
        out[name] = {"kernels_per_step": len(kernels) / 3, "busy_ms_per_step": sum(t for _, t in by_name.values()) / 3,
                     "top": [{"kernel": k, "per_step": n / 3, "ms_per_step": t / 3} for k, (n, t) in top]}
    return out


def main() -> None:
    from dflash_offline.targets.attention import ONE_TOKEN_SDPA, SDPA_BACKENDS
    from dflash_offline.targets.recurrent import IN_PLACE_TILE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("pycode")
    p.add_argument("--fixture", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--device", default="0")
    p.add_argument("--new", type=int, default=384)
    p.add_argument("--batch-tokens", type=int, default=2048 * 512)
    p.add_argument("--chunk-prompts", type=int, default=4096)
    p.add_argument("--subset", type=int, default=4096, help="prompts of the eager/compiled comparison")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts of the 40k file")
    p.add_argument("--skip-full", action="store_true")
    p.add_argument("--parts", default="subset,fixture,full",
                   help="which runs: subset (continuous/padded/compiled on --subset prompts), fixture (exactness "
                        "against the fixture's completions), full (all 40K prompts: fp32 continuous and padded, bf16)")
    p = sub.add_parser("shape27b")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--compile", action="store_true", help="also the CUDA-graph step")
    p.add_argument("--continuous", action=argparse.BooleanOptionalAction, default=True,
                   help="also generate's continuous decoder (static buffers, a CUDA-graph step)")
    p.add_argument("--padded", action=argparse.BooleanOptionalAction, default=True,
                   help="also generate's padded decoder (transformers' StaticCache)")
    p.add_argument("--steps", default="fused,plain",
                   help="the continuous decoder's steps, side by side: fused (targets/fused_step.py's compiled pieces) "
                        "and plain (the layers' own modules: generate's step)")
    p.add_argument("--state-tiles", default=str(IN_PLACE_TILE), type=listed(r"[1-9]\d*x[1-9]\d*", "a tile is COLUMNSxWARPS, e.g. 32x4"),
                   help="the Gated DeltaNet in-place kernel's state tiles, side by side: d_v columns x warps per program "
                        "(the product's: %(default)s)")
    p.add_argument("--sdpa", default=ONE_TOKEN_SDPA, type=listed("|".join(SDPA_BACKENDS), f"one of {', '.join(SDPA_BACKENDS)}"),
                   help="the one-token attention kernels under the continuous step, side by side: default (SDPA's "
                        "own choice), cudnn, efficient, math (the product's: %(default)s)")
    p.add_argument("--profile-batches", type=lambda v: [int(b) for b in v.split(",") if b], default=[],
                   help="batch sizes whose continuous steps are also profiled (kernels per step, GPU busy time)")
    for p in sub.choices.values():
        p.add_argument("--results", required=True)
        p.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    res = pycode(args) if args.what == "pycode" else shape27b(args)
    import torch

    res["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  "python": sys.version.split()[0]}
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"generate-{args.what}.json").write_text(json.dumps(res, indent=1))
    print(f"results: {out / f'generate-{args.what}.json'}")


if __name__ == "__main__":
    main()
