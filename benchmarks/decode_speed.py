"""Decoding speed: speculative decoding against the target alone, at batch 1 and batched.

Part 1, a real target and trained drafters (the pycode fixture by default), greedy, on one device:
  batch 1   the target alone (one prompt at a time, KV cache: `evaluate.greedy_decode`) against
            speculative decoding with each drafter (`evaluate.speculative_decode`, KV cache);
  batch N   the target alone batched, twice: `generate`'s decoder (`decoding.BatchDecoder`,
            StaticCache) and eval's KV-cache batches with block size 1 (`kv_batch.NoDrafts`),
            against batched speculative decoding (`eval --batch-size N`: `kv_batch`, KV caches;
            with --with-rerun also `batched`, whole sequences re-run per round, sliding-window targets' path).
  Reported: new tokens/s, the speed-up over the target alone at the same batch, tau (pooled),
  and how many outputs equal the target-alone decode (in bf16 a near-tie can flip).
Part 2 (--ceiling), a Qwen3.5-27B-shaped target with random weights and an oracle drafter that
  proposes the target's own greedy continuation (tau = block size): the speed-up ceiling of
  speculative decoding at batch 1 for each block size, without any drafter cost; no cache, no
  training needed. Reported twice: wall time (eager, launch-bound on most hosts) and kernel time
  only (torch.profiler: one forward of 1 token vs B tokens after the cached prompt), the ceiling a
  server that removes launch overhead (CUDA graphs) would see.

    python benchmarks/decode_speed.py --target ../shared/fixtures/pycode/target --drafter runs/pq/best \\
        --prompts ../shared/fixtures/pycode/prompts-eval.parquet --device 0 --out results/decode.json
    python benchmarks/decode_speed.py --ceiling --device 0 --out results/ceiling.json
    python benchmarks/decode_speed.py --tiny --out /tmp/decode.json      # CPU smoke run of the script
    python benchmarks/decode_speed.py --drafter runs/pq/best --device 0 --profile   # where a batched round's time goes
"""

from __future__ import annotations

import argparse
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


class Oracle:
    """Proposes the target's own greedy continuation of each prompt (known from a first decode)."""

    def __init__(self, full: list[int], block_size: int):
        self.full, self.block_size = full, block_size

    def start(self, prompt, features):
        pass

    def observe(self, features):
        pass

    def propose(self, tokens):
        return (self.full + [0] * self.block_size)[len(tokens):len(tokens) + self.block_size - 1]


def part1(args, device: str) -> dict:
    import torch

    from dflash_offline.evaluate.batched import BatchDFlashProposer, batched_speculative_decode
    from dflash_offline.evaluate.kv_batch import KVBatchDFlashProposer, NoDrafts, kv_batched_decode
    from dflash_offline.evaluate.run import load_drafter, read_prompts
    from dflash_offline.evaluate.speculative import (DFlashProposer, TargetSession, greedy_decode,
                                                     load_target_for_decoding, speculative_decode, summarize)
    from dflash_offline.generate.decoding import BatchDecoder, Sampling
    from dflash_offline.target.folder import eos_ids, read_target

    ids, prompts = read_prompts(args.prompts, read_target(args.target).vocab_size, args.max_prompts)
    model, _ = load_target_for_decoding(args.target, device, args.dtype)
    eos = set() if args.ignore_eos else eos_ids(args.target)
    new = args.max_new_tokens
    res: dict = {"prompts": len(prompts), "max_new_tokens": new, "dtype": args.dtype, "batch": args.batch_size}
    one = prompts[: args.batch1_prompts]
    session = TargetSession(model, [0])
    # Every timed phase runs once untimed first (kernels, allocator, lazy initialisation), so the
    # first measured phase does not pay for the ones after it.
    greedy_decode(session, one[0], 16, eos)
    alone1, t_alone1 = timed(device, lambda: [greedy_decode(session, p, new, eos) for p in one])
    tok1 = sum(len(r.tokens) for r in alone1)
    res["batch1_alone"] = {"prompts": len(one), "tokens": tok1, "seconds": t_alone1, "tokens_per_s": tok1 / t_alone1}
    dec = BatchDecoder(model, args.batch_size, max(len(p) for p in prompts), new, eos, Sampling())
    dec.decode(prompts[:args.batch_size], ids[:args.batch_size])
    alone_n, t_alone_n = timed(device, lambda: [r for k in range(0, len(prompts), args.batch_size)
                                                 for r in dec.decode(prompts[k:k + args.batch_size],
                                                                     ids[k:k + args.batch_size]).tokens])
    tok_n = sum(len(t) for t in alone_n)
    res["batched_alone"] = {"decoder": "generate (StaticCache)", "tokens": tok_n, "seconds": t_alone_n,
                            "tokens_per_s": tok_n / t_alone_n}
    # The target alone through eval's KV-cache batches (block size 1): eval's own baseline.
    kv_batched_decode(model, NoDrafts(), [], prompts[:2], 16, eos, 2)
    alone_kv, t_alone_kv = timed(device, lambda: kv_batched_decode(model, NoDrafts(), [], prompts, new, eos,
                                                                    args.batch_size))
    tok_kv = sum(len(r.tokens) for r in alone_kv)
    res["batched_alone_kv"] = {"decoder": "eval kv-cache, block 1", "tokens": tok_kv, "seconds": t_alone_kv,
                               "tokens_per_s": tok_kv / t_alone_kv,
                               "equal_to_generate": sum(a.tokens == b for a, b in zip(alone_kv, alone_n))}
    fastest_alone = max(res["batched_alone"]["tokens_per_s"], res["batched_alone_kv"]["tokens_per_s"])
    res["drafters"] = []
    for path in args.drafter:
        d = load_drafter(path, args.target)
        sess = TargetSession(model, d.cfg.target_layer_ids)
        prop = DFlashProposer(d, device, args.dtype)
        layers = d.cfg.target_layer_ids
        speculative_decode(sess, prop, one[0], 32, eos)
        kv_batched_decode(model, KVBatchDFlashProposer(d, device, args.dtype), layers, prompts[:2], 32, eos, 2)
        spec1, t1 = timed(device, lambda: [speculative_decode(sess, prop, p, new, eos) for p in one])
        specn, tn = timed(device, lambda: kv_batched_decode(
            model, KVBatchDFlashProposer(d, device, args.dtype), layers, prompts, new, eos, args.batch_size))
        s1, sn = summarize(spec1, d.cfg.block_size), summarize(specn, d.cfg.block_size)
        k1, kn = sum(len(r.tokens) for r in spec1), sum(len(r.tokens) for r in specn)
        row = {
            "path": str(path), "block_size": d.cfg.block_size,
            "batch1": {"tau": s1["tau"], "tokens_per_s": k1 / t1, "speedup": (k1 / t1) / res["batch1_alone"]["tokens_per_s"],
                       "equal_to_alone": sum(a.tokens == b.tokens for a, b in zip(spec1, alone1))},
            "batched_kv": {"tau": sn["tau"], "tokens_per_s": kn / tn, "seconds": tn,
                           "speedup_vs_kv_alone": (kn / tn) / res["batched_alone_kv"]["tokens_per_s"],
                           "speedup_vs_fastest_alone": (kn / tn) / fastest_alone,
                           "equal_to_alone": sum(a.tokens == b for a, b in zip(specn, alone_n))},
        }
        if args.with_rerun:
            batched_speculative_decode(model, BatchDFlashProposer(d, device, args.dtype), layers, prompts[:2], 32, eos, 2)
            specr, tr = timed(device, lambda: batched_speculative_decode(
                model, BatchDFlashProposer(d, device, args.dtype), layers, prompts, new, eos, args.batch_size))
            kr = sum(len(r.tokens) for r in specr)
            row["batched_rerun"] = {"tau": summarize(specr, d.cfg.block_size)["tau"], "tokens_per_s": kr / tr,
                                    "seconds": tr, "speedup_vs_fastest_alone": (kr / tr) / fastest_alone,
                                    "equal_to_alone": sum(a.tokens == b for a, b in zip(specr, alone_n))}
        res["drafters"].append(row)
        print(json.dumps(row), flush=True)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return res


def profile_batched(args, device: str) -> None:
    """--profile: torch.profiler over 32 new tokens of the batched target-alone decoders (generate's
    and eval's KV-cache one with block size 1), and of eval's with the first drafter; prints each
    one's top operators by device and host time, to see where a round's time goes."""
    from torch.profiler import ProfilerActivity, profile

    from dflash_offline.evaluate.kv_batch import KVBatchDFlashProposer, NoDrafts, kv_batched_decode
    from dflash_offline.evaluate.run import load_drafter, read_prompts
    from dflash_offline.evaluate.speculative import load_target_for_decoding
    from dflash_offline.generate.decoding import BatchDecoder, Sampling
    from dflash_offline.target.folder import read_target

    ids, prompts = read_prompts(args.prompts, read_target(args.target).vocab_size, args.max_prompts)
    ids, prompts = ids[:args.batch_size], prompts[:args.batch_size]
    model, _ = load_target_for_decoding(args.target, device, args.dtype)
    dec = BatchDecoder(model, len(prompts), max(len(p) for p in prompts), 32, set(), Sampling())
    runs = {"generate": lambda: dec.decode(prompts, ids),
            "kv, block 1": lambda: kv_batched_decode(model, NoDrafts(), [], prompts, 32, set(), len(prompts))}
    if args.drafter:
        d = load_drafter(args.drafter[0], args.target)
        runs["kv, drafter"] = lambda: kv_batched_decode(model, KVBatchDFlashProposer(d, device, args.dtype),
                                                        d.cfg.target_layer_ids, prompts, 32, set(), len(prompts))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    for name, fn in runs.items():
        fn()  # warm-up
        _, seconds = timed(device, fn)
        with profile(activities=acts) as prof:
            fn()
            sync(device)
        print(f"== {name}: {seconds:.3f}s for 32 new tokens x {len(prompts)} prompts", flush=True)
        key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=20), flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15), flush=True)


def part2(args, device: str) -> dict:
    """The 27B-shaped random target at batch 1 with an oracle drafter: speed-up per block size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_offline.evaluate.speculative import TargetSession, greedy_decode, speculative_decode, summarize

    shape = dict(QWEN35_27B)
    if args.tiny:
        shape.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16)
    L = shape["num_hidden_layers"]
    cfg = AutoConfig.for_model("qwen3_5_text", **shape,
                               layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(L)])
    torch.manual_seed(0)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    t0 = time.time()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    # Random weights make a chaotic 64-layer stack: bf16 rounding differences between a one-token
    # step and a block verify (about 1e-3 relative per layer, measured) flip the greedy token
    # wherever its margin is small, and a random LM head over 248K entries has small margins
    # everywhere: even an oracle would be refused. So every residual branch's output projection is
    # shrunk (the stream stays at its token's embedding) and the LM head is a permutation of the
    # embedding: the greedy next token is then perm(current token), chosen by a wide margin, and
    # the continuation walks a random permutation. Shapes, kernels and so the time per forward
    # are those of the real model.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                p.mul_(1e-3)
        perm = torch.randperm(shape["vocab_size"], generator=torch.Generator().manual_seed(2)).to(device)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight[perm])
    print(f"ceiling: target built in {time.time() - t0:.0f}s", flush=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, shape["vocab_size"], (args.ceiling_prompt_len,), generator=g).tolist()
               for _ in range(args.ceiling_prompts)]
    new = args.ceiling_new_tokens
    session = TargetSession(model, [0])
    t0 = time.time()
    greedy_decode(session, prompts[0], 8, set())  # warm-up (kernels, allocator)
    print(f"ceiling: warm-up {time.time() - t0:.0f}s", flush=True)
    alone, t_alone = timed(device, lambda: [greedy_decode(session, p, new, set()) for p in prompts])
    tok = sum(len(r.tokens) for r in alone)
    print(f"ceiling: target alone {tok} tokens in {t_alone:.1f}s", flush=True)
    res = {"shape": "tiny" if args.tiny else "qwen3.5-27b (random weights)", "dtype": str(dtype), "prompts": len(prompts),
           "prompt_len": args.ceiling_prompt_len, "new_tokens": new, "alone_tokens_per_s": tok / t_alone, "blocks": []}
    # Diagnostic: does a block verify (B tokens after the cached prompt) choose what one-token steps
    # chose? If not, no draft can be accepted, whatever the drafter (an oracle's tau would be 1).
    B = max(args.block_sizes)
    logits0, _ = session.start(prompts[0], features=False)
    verify, _ = session.forward(alone[0].tokens[:B], features=False)
    res["verify_check"] = {"steps": alone[0].tokens[1:B + 1], "verify": verify.argmax(-1).tolist()[:B],
                           "first_token_agrees": int(logits0[-1].argmax()) == alone[0].tokens[0]}
    print(f"ceiling: verify check {json.dumps(res['verify_check'])}", flush=True)
    # Kernel time of one forward after the cached prompt: 1 token (a step) and B tokens (a verify).
    def one_forward(n):
        session.start(prompts[0], features=False)
        return kernel_ms(device, lambda: session.forward(alone[0].tokens[:n], features=False, rollback=False))
    step_ms = one_forward(1)
    res["kernel_ms_step"] = step_ms
    for B in args.block_sizes:
        speculative_decode(session, Oracle(prompts[0] + alone[0].tokens, B), prompts[0], 2 * B, set())  # warm-up
        spec, t = timed(device, lambda: [speculative_decode(session, Oracle(p + r.tokens, B), p, new, set())
                                         for p, r in zip(prompts, alone)])
        s = summarize(spec, B)
        k = sum(len(r.tokens) for r in spec)
        verify_ms = one_forward(B)
        res["blocks"].append({"block_size": B, "tau": s["tau"], "tokens_per_s": k / t, "speedup": (k / t) / (tok / t_alone),
                              "equal_to_alone": sum(a.tokens == b.tokens for a, b in zip(spec, alone)),
                              # The same rounds if a forward cost only its kernels (no host overhead):
                              # tau tokens per verify against one token per step.
                              "kernel_ms_verify": verify_ms,
                              "kernel_bound_speedup": (s["tau"] * step_ms / verify_ms) if verify_ms else None})
        print(json.dumps(res["blocks"][-1]), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="../shared/fixtures/pycode/target")
    ap.add_argument("--drafter", action="append", default=[], help="drafter export or step-N (repeat)")
    ap.add_argument("--prompts", default="../shared/fixtures/pycode/prompts-eval.parquet")
    ap.add_argument("--device", default="0")
    ap.add_argument("--dtype", default="bfloat16", help="decode dtype (bfloat16 for speed; float32 for an exact check)")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--max-prompts", type=int, default=200)
    ap.add_argument("--batch1-prompts", type=int, default=20, help="prompts decoded one at a time (batch 1)")
    ap.add_argument("--batch-size", type=int, default=200)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--with-rerun", action="store_true", help="also the re-run batched decoder (sliding-window targets' path)")
    ap.add_argument("--profile", action="store_true", help="only profile the batched decoders (32 new tokens)")
    ap.add_argument("--ceiling", action="store_true", help="also part 2: the 27B-shaped oracle ceiling")
    ap.add_argument("--ceiling-prompts", type=int, default=4)
    ap.add_argument("--ceiling-prompt-len", type=int, default=512)
    ap.add_argument("--ceiling-new-tokens", type=int, default=256)
    ap.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny random targets and drafters")
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
        args.target = str(make_tiny_target(tmp / "target"))
        args.prompts = str(make_tiny_data(tmp / "prompts.parquet", rows=6, min_len=4, max_len=20))
        d = DFlashDrafter(DrafterConfig.from_target(args.target, [1, 3], block_size=4, num_layers=1, mask_token_id=1))
        args.drafter = [str(export_drafter(d, str(tmp / "drafter")))]
        args.dtype, args.max_new_tokens, args.batch1_prompts, args.batch_size = "float32", 12, 2, 4
        args.with_rerun = True
        args.ignore_eos, args.ceiling_prompts, args.ceiling_prompt_len, args.ceiling_new_tokens = True, 2, 8, 12
    if args.profile:
        profile_batched(args, device)
        return 0
    if args.drafter:
        out["pycode"] = part1(args, device)
    if args.ceiling:
        out["ceiling"] = part2(args, device)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
