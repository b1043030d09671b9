"""The real trainer on a drafter shaped for a Qwen3.5/3.6-27B target, from a synthetic cache.

Builds, in --workdir (use /dev/shm):
  target/   config.json of the 27B text model + a safetensors file holding only the embedding and
            LM head (random bf16, 248,320 x 5120): all the trainer reads from a target;
  cache/    a committed cache (manifest + Zarr shards written with the project's ShardWriter) of
            random bf16 hidden states for the 5 layers [1, 16, 31, 46, 61], random lengths;
then runs `train.run` (the code path of `dflash-offline train`) on one GPU: compiled flex
attention, bf16 autocast, fp32 master weights, loader processes, and reads its metrics.jsonl.

    python benchmarks/train_throughput.py --workdir /dev/shm/bench-train --steps 50 --out results.json

Reports: tokens/s (context tokens and block tokens), model FLOP/s from an analytic count (matmuls
only: drafter layers fwd+bwd, fc, LM head fwd + input-grad bwd; attention counted separately,
the head's recomputed logits of `--loss-impl recompute` not counted) as a share of the bf16 matmul peak measured on an H200 (774 TFLOP/s),
peak GPU memory, data-wait fraction, recompiles after the first step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

SHAPE = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
             num_attention_heads=24, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
             max_position_embeddings=262144, rope_theta=10_000_000.0)
LAYERS = [1, 16, 31, 46, 61]
PEAK = 774e12


def make_target(root: Path, dev: str) -> None:
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    L = SHAPE["num_hidden_layers"]
    cfg = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **SHAPE,
           "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
           "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(L)]}
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator(device=dev).manual_seed(0)
    V, H = SHAPE["vocab_size"], SHAPE["hidden_size"]
    t = {"model.embed_tokens.weight": (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16().cpu(),
         "lm_head.weight": (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16().cpu()}
    save_file(t, str(root / "model.safetensors"))


def make_cache(root: Path, target: Path, rows: int, seq_len: int, dev: str) -> None:
    import numpy as np
    import torch

    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, new_manifest
    from dflash_offline.cache.shards import publish_shard, shard_name, tmp_shard_rel
    from dflash_offline.cache.writer import ShardLayout, ShardWriter
    from dflash_offline.targets.folder import read_target

    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < rows * seq_len * 0.9:
        lengths.append(int(rng.integers(seq_len // 12, seq_len * 3 // 4)))
    per_shard = 16
    shards = [lengths[i:i + per_shard] for i in range(0, len(lengths), per_shard)]
    loc = Location(str(root))
    info = read_target(str(target))
    store = ManifestStore(loc)
    store.init_or_check(new_manifest(
        target=info.manifest_entry(),
        capture={"layer_ids": LAYERS, "topk": 0, "hidden_dtype": "bfloat16", "max_len": seq_len},
        source={"files": [], "rows": len(lengths)},
        plan={"shard_tokens": 0, "sort_window": 0, "num_shards": len(shards)}))
    loc.makedirs("shards")
    H, n, sid = SHAPE["hidden_size"], len(LAYERS), 0
    for j, lens in enumerate(shards):
        name = shard_name(j)
        w = ShardWriter(loc, tmp_shard_rel(name), ShardLayout(tokens=sum(lens), cache_layers=n, hidden_size=H, topk=0,
                                                              chunk_tokens=1024, layer_ids=LAYERS))
        for t in lens:
            h = torch.randn(t, n, H, device=dev).bfloat16().view(torch.uint16).cpu().numpy()
            ids = rng.integers(0, SHAPE["vocab_size"], size=t).astype(np.int32)
            mask = np.ones(t, np.uint8)
            mask[: t // 4] = 0
            w.append(sid, ids, mask, h, None, None)
            sid += 1
        publish_shard(store, w.close(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/dev/shm/dflash-bench-train")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rows", type=int, default=32, help="cache size in rows of --seq-len tokens")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--rows-per-step", type=int, default=4)
    ap.add_argument("--loader-workers", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape, for a CPU smoke run of this script")
    ap.add_argument("--attention", default="auto", choices=["auto", "sdpa"],
                    help="auto = compiled flex (the trainer's GPU path); sdpa = SDPA with a dense mask (the baseline)")
    ap.add_argument("--loss-impl", default="fused", choices=["fused", "recompute"],
                    help="fused: the head's input gradient made in the loss forward (the default); recompute: "
                    "checkpointed loss chunks, the head's logits recomputed in the backward")
    ap.add_argument("--compile-layers", default="off", choices=["on", "off"],
                    help="the compiled decoder layer (train's default on GPU); off = the eager layer, as the "
                    "Qwen3.6-27B recipe sets until the compiled one is measured at this shape")
    ap.add_argument("--compile-loss", default="off", choices=["on", "off"],
                    help="train --compile-loss: the loss's element-wise passes as compiled kernels")
    ap.add_argument("--keep", action="store_true", help="reuse --workdir's target and cache if they exist")
    ap.add_argument("--metrics", default=None, help="only recompute the figures from this metrics.jsonl of an "
                    "earlier run with the same shape options (no training)")
    args = ap.parse_args()
    if args.tiny:
        global LAYERS
        SHAPE.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        LAYERS = [1, 2, 3, 4, 5]
    if args.metrics:
        recs = [json.loads(line) for line in Path(args.metrics).read_text().splitlines()]
        print(json.dumps(figures(recs, args), indent=1))
        return 0

    import torch

    from dflash_offline.train import launcher as train
    from dflash_offline.train.config import TrainConfig

    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    work = Path(args.workdir)
    t0 = time.time()
    if not (args.keep and (work / "cache" / "manifest.json").exists()):
        shutil.rmtree(work, ignore_errors=True)
        make_target(work / "target", dev)
        make_cache(work / "cache", work / "target", args.rows, args.seq_len, dev)
        print(f"synthetic target and cache in {time.time() - t0:.1f}s", flush=True)
    shutil.rmtree(work / "run", ignore_errors=True)
    args.attention_pairs_per_row = attention_pairs_per_row(work / "cache", args)
    spe_rows = args.rows_per_step
    cfg = TrainConfig(cache=str(work / "cache"), target=str(work / "target"), out=str(work / "run"),
                      devices="0" if dev.startswith("cuda") else "cpu", seq_len=args.seq_len,
                      num_anchors=args.num_anchors, block_size=16, global_batch_tokens=args.seq_len * spe_rows,
                      epochs=100, max_steps=args.steps, mask_token_id=1 if args.tiny else 248070, loader_workers=args.loader_workers,
                      checkpoint_every=10**9, final_checkpoint=False, progress=False, log_every=1,
                      attention=args.attention, loss_impl=args.loss_impl, compile_layers=args.compile_layers == "on",
                      compile_loss=args.compile_loss == "on")
    interrupted = False
    try:
        train.run(cfg)
    except KeyboardInterrupt:  # `timeout -s INT`: report the steps that finished
        interrupted = True
    finally:
        # Also on Ctrl-C / `timeout -s INT`: show where the trainer got to.
        log = work / "run" / "logs" / "train-launcher.log"
        if log.exists():
            print("".join(log.read_text().splitlines(keepends=True)[-25:]), flush=True)
    metrics = work / "run" / "metrics.jsonl"
    recs = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if len(recs) < 4:
        print(f"only {len(recs)} steps finished: too few for steady-state figures", flush=True)
        return 1
    res = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu", "torch": torch.__version__,
           "shape": "tiny" if args.tiny else "qwen3.5-27b drafter", "attention": args.attention,
           "loss_impl": args.loss_impl, "compile_layers": args.compile_layers,
           "compile_loss": args.compile_loss, "interrupted": interrupted, **figures(recs, args)}
    for k, v in res.items():
        print(f"{k}: {v}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def figures(recs: list[dict], args) -> dict:
    """Throughput figures from the trainer's metrics.jsonl records. Steady state = every step after
    the third (the first compiles). `within_epoch` also leaves out each epoch's first step (this
    benchmark's small cache has only rows / rows_per_step steps per epoch, a real cache thousands;
    before one loader spanned the epochs, that step waited for new loader processes)."""
    steady = recs[3:]
    within = [r for i, r in enumerate(recs) if i >= 3 and r["epoch"] == recs[i - 1]["epoch"]]
    H, F, V = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    qd, kvd = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    Q, S = args.num_anchors * 16, args.seq_len
    per_layer_block = 2 * H * qd + 2 * H * kvd + 3 * H * F  # q, o, k, v, mlp params used per block token
    flops_row = (6 * 5 * per_layer_block * Q  # 5 drafter layers, block tokens, fwd + bwd
                 + 6 * 5 * 2 * H * kvd * S  # context k/v projections
                 + 6 * len(LAYERS) * H * H * S  # fc
                 + 4 * H * V * Q)  # LM head: forward + input gradient (frozen weight)
    flops_step = flops_row * args.rows_per_step
    # Attention over the pairs the mask allows (QK^T and PV, 2 FLOPs a multiply-add, forward + a
    # backward of twice that): what any kernel must compute; flex also computes masked pairs inside
    # partial tiles, SDPA all of them, and neither is counted.
    pairs = getattr(args, "attention_pairs_per_row", None)
    attn_step = (3 * 5 * 4 * pairs * qd * args.rows_per_step) if pairs else 0.0

    def block(rs: list[dict]) -> dict:
        t = sum(r["step_time"] for r in rs) / len(rs)
        return {"steps": len(rs), "step_time_s": t, "context_tokens_per_s": S * args.rows_per_step / t,
                "block_tokens_per_s": Q * args.rows_per_step / t, "model_tflops_per_s": flops_step / t / 1e12,
                "share_of_bf16_peak": flops_step / t / PEAK,
                "with_attention_tflops_per_s": (flops_step + attn_step) / t / 1e12,
                "with_attention_share_of_bf16_peak": (flops_step + attn_step) / t / PEAK,
                "data_wait_mean": sum(r["data_wait"] for r in rs) / len(rs)}

    return {"steps": len(recs), "seq_len": S, "num_anchors": args.num_anchors, "rows_per_step": args.rows_per_step,
            "model_flops_per_step": flops_step, "attention_flops_per_step": attn_step,
            "attention_pairs_per_row": pairs, "steady": block(steady),
            "within_epoch": block(within) if within else None,
            "epoch_first_steps_s": [round(r["step_time"], 3) for prev, r in zip(recs, recs[1:]) if r["epoch"] != prev["epoch"]],
            "max_mem_gb": max(r.get("max_mem_gb", 0) for r in recs),
            "recompiles_after_first_step": recs[-1]["recompiles"] - recs[0]["recompiles"],
            "recompiles_total": recs[-1]["recompiles"], "first_step_s": recs[0]["step_time"],
            "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"]}

def attention_pairs_per_row(cache: Path, args, rows: int = 8) -> float:
    """Mean number of (query, key) pairs the DFlash mask allows in a row, over `rows` rows packed from
    the cache the trainer's way (epoch 0's order, its anchors). The rules read a query only through
    its block, so each block's row of the mask is evaluated once and counted block_size times."""
    import numpy as np
    import torch

    from dflash_offline.drafter import masks
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.blocks.packing import anchor_rng, build_row, epoch_order, loss_weights, pack_rows

    reader = CacheReader(str(cache))
    samples = [(reader.shard(n), k) for n in reader.shard_names for k in range(len(reader.shard(n)))]
    lengths = np.array([int(sh.offsets[k + 1] - sh.offsets[k]) for sh, k in samples])
    packed = pack_rows(lengths, epoch_order(len(samples), 0, 0), args.seq_len)
    B, N, S = 16, args.num_anchors, args.seq_len
    total = 0
    for g, row in enumerate(packed[:rows]):
        ids, lms = [], []
        for s_, keep in row:
            sh, k = samples[s_]
            a = int(sh.offsets[k])
            ids.append(sh.group["input_ids"][a:a + keep].astype(np.int64))
            lms.append(sh.group["loss_mask"][a:a + keep])
        r = build_row(ids, lms, S, N, B, 1, loss_weights(B, 7.0), anchor_rng(0, 0, g))
        doc = torch.from_numpy(r.doc_ids)[None]
        anc = torch.from_numpy(r.anchors)[None]
        val = torch.from_numpy(r.anchor_valid)[None]
        mod = masks.make_mask_mod(doc, anc, val, S, B)
        q = (torch.arange(N) * B).view(1, 1, N, 1)
        kv = torch.arange(S + N * B).view(1, 1, 1, -1)
        total += int(mod(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long),
                         q, kv).sum()) * B
    return total / max(1, min(rows, len(packed)))


if __name__ == "__main__":
    sys.exit(main())
