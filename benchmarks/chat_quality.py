"""The drafter-quality scoreboard on the chat fixture: prepare, generate, extract, train, decode.

The chat path end to end, each phase one of the project's commands run as a user would (its own
process), timed:
  0. the chat fixture target (benchmarks/chat_fixture.py: the pycode target fine-tuned to answer
     "continue this code" conversations in a Qwen3-style template with <think> blocks); made first
     when --target holds no model (not counted in the pipeline's time);
  1. `prepare --responses regenerate`: the training conversations (--conversations of them made
     by chat_fixture.py's builder from the pycode data, or the committed
     benchmarks/chat_fixture/train.messages.jsonl, or --data) and the held-out ones (the committed
     eval.messages.jsonl: conversations from held-out source files; or --eval-fraction of the
     training data) rendered into prompt folders;
  2. `generate --turns all`: the target rewrites every assistant turn of both, turn by turn;
  3. `extract`: a training cache of the regenerated training conversations (layers 1-6, top-32,
     fp8) and a held-out cache of the regenerated held-out ones (train's --eval-cache walk estimate);
  4. `train`: stages/pycode-dflash/train.toml's recipe scaled to this data (--train-args);
  5. `eval --prompts`: lossless speculative decoding of the held-out conversations' first turns
     (the prepared eval prompt folder) against the target, decoding tau pooled over rounds and the
     mean of the per-prompt taus, from eval's JSON report.

    python benchmarks/chat_quality.py --device 0 --work /dev/shm/chat --results results/chat

H200-minutes per phase = the phase's wall seconds / 60 (one GPU). `--smoke` runs the whole
pipeline on the CPU with a few conversations and tiny budgets (the target from
`chat_fixture.py --smoke`), to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from pycode_quality import cli, wait  # noqa: E402  (one way to run a phase's commands and wait for them)
COMMITTED = ROOT / "benchmarks" / "chat_fixture"
TRAIN_ARGS = ("--block-size 16 --drafter-layers 5 --init-layers 0,1,2,3,4 --kd-weight 0.5 --seq-len 4096 "
              "--num-anchors 2048 --anchors-per-sample 512 --global-batch-tokens 16384")
SMOKE_TRAIN_ARGS = ("--block-size 8 --drafter-layers 1 --init-layers 0 --kd-weight 0.5 --seq-len 512 --num-anchors 64 "
                    "--anchors-per-sample 32 --global-batch-tokens 1024 --loader-workers 0")


def phase(summary: dict, name: str, procs: dict, logs: dict, **kw) -> None:
    t0 = time.time()
    took = wait(procs, logs, **kw)
    summary["phases_s"][name] = time.time() - t0
    if len(took) > 1:
        summary["phases_each_s"][name] = took


def slice_jsonl(src: Path, dest: Path, n: int) -> Path:
    lines = [ln for ln in src.read_text(encoding="utf-8").splitlines() if ln.strip()][:n]
    dest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dest


def made_conversations(fixture: Path, n: int, seed: int, dest: Path) -> Path:
    """n training conversations from chat_fixture.py's builder (the fine-tune's pool: the
    completions-train rows, then prompts-train-40k), as `messages` JSONL."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import chat_fixture as cf

    src = cf.Source(fixture, seed)
    long_rows = src.rows("completions-train.parquet", n)
    recs = src.make("completions-train.parquet", long_rows)
    if len(recs) < n:
        recs += src.make("prompts-train-40k.parquet", src.rows("prompts-train-40k.parquet", int((n - len(recs)) * 1.05)
                                                               + 16))
    tok = cf.build_tokenizer(fixture / "target")
    recs = cf.keep_short(tok, recs[:n + 64])[:n]
    cf.write_jsonl(dest, recs)
    return dest


def cache_figures(cache: Path) -> dict:
    m = json.loads((cache / "manifest.json").read_text())
    return {**m["totals"], "layer_ids": m["capture"]["layer_ids"],
            "bytes": sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())}


def gen_figures(out: Path) -> dict:
    m = json.loads((out / "manifest.json").read_text())
    return m["totals"]


def prepared_figures(folder: Path) -> dict:
    m = json.loads((folder / "manifest.json").read_text())
    return {**m["totals"], "dropped": m.get("counts", {}).get("dropped")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default=str(ROOT.parent / "shared" / "fixtures" / "pycode"),
                    help="the pycode fixture (source of the conversations and of the chat target)")
    ap.add_argument("--target", default=str(ROOT / ".fixtures" / "chat" / "target"),
                    help="the chat target; made with chat_fixture.py when the folder holds no model")
    ap.add_argument("--fixture-args", default="", help="options for chat_fixture.py when it makes the target")
    ap.add_argument("--work", default="/dev/shm/chat")
    ap.add_argument("--results", default="results/chat")
    ap.add_argument("--device", default="0", help="GPU index, or cpu")
    ap.add_argument("--data", action="append", default=None,
                    help="training conversations for prepare (repeatable; default: --conversations made ones, or "
                         "the committed train.messages.jsonl when --conversations 0)")
    ap.add_argument("--conversations", type=int, default=8000,
                    help="training conversations made from the pycode data (0: the committed 300)")
    ap.add_argument("--eval-data", default=str(COMMITTED / "eval.messages.jsonl"),
                    help="held-out conversations (default: the committed 100 from held-out files)")
    ap.add_argument("--eval-fraction", type=float, default=0.0,
                    help="> 0: hold out this share of the training data instead of --eval-data")
    ap.add_argument("--prepare-args", default="", help="more prepare options (e.g. --thinking off)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="generate's and eval's new tokens per turn")
    ap.add_argument("--gen-dtype", default="bfloat16", help="generate's compute dtype (bfloat16 or float32)")
    ap.add_argument("--turns", default="all", help="generate --turns: all or last")
    ap.add_argument("--capture", default="1,2,3,4,5,6", help="layers extracted")
    ap.add_argument("--hidden-dtype", default="fp8")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--train-args", default=None, help=f"train options (default: {TRAIN_ARGS!r})")
    ap.add_argument("--eval-prompts", type=int, default=0, help="decode only the first N held-out prompts (0: all)")
    ap.add_argument("--eval-dtype", default="float32", help="eval --dtype (float32: the lossless check is exact)")
    ap.add_argument("--eval-batch-size", type=int, default=100, help="eval --batch-size")
    ap.add_argument("--seed", type=int, default=0, help="seed of the made conversations (chat_fixture.py's)")
    ap.add_argument("--smoke", action="store_true", help="CPU, a few conversations: checks the script, not the drafter")
    args = ap.parse_args()
    fx, work, res = Path(args.fixture).absolute(), Path(args.work).absolute(), Path(args.results).absolute()
    target = Path(args.target).absolute()
    work.mkdir(parents=True, exist_ok=True)
    res.mkdir(parents=True, exist_ok=True)
    train_args = shlex.split(args.train_args if args.train_args is not None else
                             SMOKE_TRAIN_ARGS if args.smoke else TRAIN_ARGS)
    eval_data = Path(args.eval_data).absolute()
    if args.smoke:
        args.device, args.max_new_tokens, args.eval_every, args.epochs = "cpu", 24, 2, 1
        args.eval_batch_size, args.gen_dtype = 1, "float32"
        if args.target == ap.get_default("target"):
            target = work / "smoke-target"
        if args.conversations and not args.data:
            args.conversations = 10
        eval_data = slice_jsonl(eval_data, work / "smoke-eval.messages.jsonl", 4)
    summary: dict = {"args": vars(args), "phases_s": {}, "phases_each_s": {}, "train_args": train_args}
    # Each phase starts from nothing: an output left by an earlier run would be resumed ("already
    # complete" in seconds, a false time) or refused (other settings).
    import shutil

    for name in ("prep", "prep-eval", "gen-train", "gen-eval", "cache-train", "cache-eval", "run", "eval.json"):
        p = work / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()

    def save() -> None:
        (res / "chat.json").write_text(json.dumps(summary, indent=1) + "\n")

    # 0. The target.
    if not (target / "config.json").is_file():
        cmd = [sys.executable, str(ROOT / "benchmarks" / "chat_fixture.py"), "--fixture", fx, "--out", target,
               *(["--smoke"] if args.smoke else ["--device", "cpu" if args.device == "cpu" else "cuda"]),
               *shlex.split(args.fixture_args)]
        print(f"no chat target at {target}: making it ({' '.join(map(str, cmd))})", flush=True)
        t0 = time.time()
        with open(res / "chat_fixture.log", "w") as f:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if args.device != "cpu":
                env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", args.device)
            r = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, env=env)
        if r.returncode != 0:
            raise SystemExit(f"chat_fixture.py failed ({r.returncode}):\n"
                             + "".join((res / "chat_fixture.log").read_text().splitlines(True)[-25:]))
        summary["fixture_s"] = time.time() - t0
        print(f"  chat target made in {summary['fixture_s']:.0f}s", flush=True)
    if (target / "fixture.json").is_file():
        fig = json.loads((target / "fixture.json").read_text())
        summary["target"] = {k: fig.get(k) for k in ("steps", "batch", "heldout_before", "heldout_after", "device")}

    # 1. prepare: training and held-out conversations -> prompt folders.
    if args.data:
        data = [str(Path(d).absolute()) for d in args.data]
    elif args.conversations > 0:
        data = [str(made_conversations(fx, args.conversations, args.seed, work / "conversations-train.jsonl"))]
    else:
        data = [str(COMMITTED / "train.messages.jsonl")]
    if args.smoke and not args.data and args.conversations == 0:
        data = [str(slice_jsonl(Path(data[0]), work / "smoke-train.messages.jsonl", 10))]
    summary["data"] = data
    t_start = time.time()
    prep, extra = work / "prep", shlex.split(args.prepare_args)
    logs = {"prepare-train": res / "prepare-train.log"}
    procs = {"prepare-train": cli("prepare", "--target", target, *[a for d in data for a in ("--data", d)], "--out",
                                  prep, "--responses", "regenerate", "--eval-fraction", args.eval_fraction,
                                  "--no-progress", *extra, log=logs["prepare-train"])}
    if args.eval_fraction > 0:
        eval_prompts = prep / "eval"
    else:
        logs["prepare-eval"] = res / "prepare-eval.log"
        procs["prepare-eval"] = cli("prepare", "--target", target, "--data", eval_data, "--out", work / "prep-eval",
                                    "--responses", "regenerate", "--no-progress", *extra, log=logs["prepare-eval"])
        eval_prompts = work / "prep-eval" / "train"
    phase(summary, "prepare", procs, logs)
    summary["prepared"] = {"train": prepared_figures(prep / "train"), "eval": prepared_figures(eval_prompts)}
    save()

    # 2. generate: every assistant turn rewritten by the target, turn by turn.
    gen = ["--devices", args.device, "--max-new-tokens", args.max_new_tokens, "--compute-dtype", args.gen_dtype,
           "--turns", args.turns, "--no-progress"]
    logs = {"generate-train": res / "generate-train.log", "generate-eval": res / "generate-eval.log"}
    procs = {"generate-train": cli("generate", "--target", target, "--prompts", prep / "train", "--out",
                                   work / "gen-train", *gen, log=logs["generate-train"]),
             "generate-eval": cli("generate", "--target", target, "--prompts", eval_prompts, "--out",
                                  work / "gen-eval", *gen, log=logs["generate-eval"])}
    phase(summary, "generate", procs, logs)
    summary["generated"] = {"train": gen_figures(work / "gen-train"), "eval": gen_figures(work / "gen-eval")}
    save()

    # 3. extract: the training cache and the held-out cache.
    ext = ["--devices", args.device, "--capture-layers", args.capture, "--max-len", "2048", "--compute-dtype", "float32",
           "--no-progress"]
    logs = {"extract-train": res / "extract-train.log", "extract-eval": res / "extract-eval.log"}
    procs = {"extract-train": cli("extract", "--target", target, "--data", work / "gen-train", "--cache",
                                  work / "cache-train", "--hidden-dtype", args.hidden_dtype, "--topk", args.topk,
                                  *ext, log=logs["extract-train"]),
             "extract-eval": cli("extract", "--target", target, "--data", work / "gen-eval", "--cache",
                                 work / "cache-eval", "--topk", "0", *ext, log=logs["extract-eval"])}
    phase(summary, "extract", procs, logs)
    summary["train_cache"] = cache_figures(work / "cache-train")
    save()
    print(f"data ready after {time.time() - t_start:.0f}s: {summary['train_cache']}", flush=True)

    # 4. train.
    run = work / "run"
    logs = {"train": res / "train.log"}
    procs = {"train": cli("train", "--cache", work / "cache-train", "--out", run, "--target", target, "--devices",
                          args.device, "--epochs", args.epochs, "--eval-cache", work / "cache-eval", "--eval-every",
                          args.eval_every, "--checkpoint-every", "100000", "--keep-checkpoints", "1", "--log-every",
                          "20", "--no-progress", *train_args, log=logs["train"])}
    phase(summary, "train", procs, logs)
    summary["end_to_end_s"] = time.time() - t_start
    mt = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (run / "heldout.jsonl").read_text().splitlines()]
    steady = mt[3:] or mt
    summary["train"] = {
        "steps": len(mt), "step_time_s": sum(r["step_time"] for r in steady) / len(steady),
        "loss_last": mt[-1]["loss"], "tau_train_last": mt[-1]["tau"], "tokens": mt[-1]["tokens"],
        "walk": [{k: h[k] for k in ("step", "tau_pooled", "tau_per_prompt_mean", "tau_all_anchors", "train_s")
                  if k in h} for h in held],
        "best": json.loads((run / "best.json").read_text()),
    }
    save()

    # 5. eval: speculative decoding of the held-out conversations' first turns.
    report = work / "eval.json"
    report.unlink(missing_ok=True)  # a report left by an earlier run must not pass for this run's
    logs = {"eval": res / "eval.log"}
    procs = {"eval": cli("eval", "--target", target, "--drafter", run / "best", "--prompts", eval_prompts,
                         "--max-new-tokens", args.max_new_tokens, "--devices", args.device, "--dtype", args.eval_dtype,
                         "--batch-size", args.eval_batch_size, "--json", report, "--no-progress",
                         *(["--max-prompts", args.eval_prompts] if args.eval_prompts else []), log=logs["eval"])}
    phase(summary, "eval", procs, logs, reported=lambda n: report.exists())
    r = json.loads(report.read_text())
    (res / "eval.json").write_text(json.dumps(r, indent=1) + "\n")
    d = r["drafters"][0]
    per = d.get("tau_per_prompt") or []
    summary["decode"] = {"prompts": r["num_prompts"], "rounds": d["rounds"], "tokens": d["tokens"],
                         "tau_pooled": d["tau"],
                         "tau_per_prompt_mean": d.get("tau_per_prompt_mean", sum(per) / len(per) if per else None),
                         "accept_rate": d["accept_rate"], "lossless": d.get("lossless"),
                         "speedup": d.get("speedup"), "device": r.get("device"), "torch": r.get("torch")}
    summary["total_s"] = time.time() - t_start
    summary["device_minutes"] = {k: v / 60 for k, v in summary["phases_s"].items()}
    save()
    table = render(summary)
    print(table, flush=True)
    (res / "summary.txt").write_text(table + "\n")
    return 0 if summary["decode"]["lossless"] in (True, None) else 1


def render(summary: dict) -> str:
    ph, dm = summary["phases_s"], summary["device_minutes"]
    unit = "CPU-minutes" if summary["args"]["device"] == "cpu" else "H200-minutes"
    lines = [f"{'phase':<10} {'seconds':>8} {unit:>13}"]
    for k in ("prepare", "generate", "extract", "train", "eval"):
        lines.append(f"{k:<10} {ph[k]:>8.1f} {dm[k]:>13.2f}")
    lines.append(f"{'pipeline':<10} {summary['total_s']:>8.1f} {summary['total_s'] / 60:>13.2f}"
                 f"   (prepare through train: {summary['end_to_end_s'] / 60:.2f})")
    if "fixture_s" in summary:
        lines.append(f"(chat target made first: {summary['fixture_s']:.0f}s, not counted above)")
    g, t, d = summary["generated"]["train"], summary["train"], summary["decode"]
    b = t["best"]
    lines.append(f"generated: {g['rows']} training rows, {g['new_tokens']:,} new tokens ({g['ended_by_eos']} ended by "
                 f"eos); cache {summary['train_cache'].get('tokens', 0):,} tokens")
    lines.append(f"train: {t['steps']} steps, {t['step_time_s']:.3f} s/step, loss {t['loss_last']:.3f}; held-out walk "
                 f"tau {b.get('tau_pooled', float('nan')):.3f} pooled, {b.get('tau_per_prompt_mean', float('nan')):.3f} "
                 f"per-prompt mean")
    per = d["tau_per_prompt_mean"]
    lines.append(f"decode ({d['prompts']} held-out first turns, {summary['args']['max_new_tokens']} new tokens): tau "
                 f"{d['tau_pooled']:.3f} pooled, {per if per is not None else float('nan'):.3f} per-prompt mean, "
                 f"lossless {d['lossless']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
