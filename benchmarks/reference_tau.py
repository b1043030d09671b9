"""The reference judge of decoding tau: z-lab's own decoding loop (`dflash==0.1.0`,
`dflash.model.dflash_generate`, batch 1) on an exported drafter, beside `eval`'s figure.

The reference counts tau as new tokens committed by verify rounds / verify rounds (its
`acceptance_lengths`, each round's committed tokens, the last cut at max_new_tokens and after a stop
token): this prints its pooled figure and the mean of per-prompt figures, checks its outputs
against the target's greedy completions (lossless), and with --eval-json compares round by round
with `eval --json`'s `committed_per_prompt` (same prompts, same order).

    python benchmarks/reference_tau.py --target ../shared/fixtures/pycode/target --drafter RUN/export \\
        --prompts ../shared/fixtures/pycode/prompts-eval.parquet \\
        --completions ../shared/fixtures/pycode/completions-eval.parquet --max-new-tokens 384 \\
        --device 0 --jobs 8 --eval-json results/eval.json --out results/reference_tau.json

--jobs N decodes N slices of the prompts in N processes at once (batch-1 decoding leaves the
device idle; the figures do not depend on it). The reference wants another transformers than
the project's: install it with `pip install --no-deps dflash==0.1.0`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode_slice(args) -> list[dict]:
    """This process's prompts (every jobs-th from --slice) through dflash_generate, fp32."""
    import torch
    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import AutoModelForCausalLM

    from dflash_offline.evaluate.inputs import read_prompts
    from dflash_offline.targets.folder import eos_ids, read_target

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(f"cuda:{args.device}" if args.device != "cpu" else "cpu")
    ids, prompts = read_prompts(args.prompts, read_target(args.target).vocab_size, args.max_prompts)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(dev).eval()
    draft = DFlashDraftModel.from_pretrained(args.drafter, dtype=torch.float32).to(dev).eval()
    stop = sorted(eos_ids(args.target))
    if dev.type == "cpu":
        import dflash.model as ref

        ref._cuda_time = time.perf_counter  # its statistics synchronise CUDA
    out = []
    for k in range(args.slice, len(prompts), args.jobs):
        stats = dflash_generate(draft, target, torch.tensor([prompts[k]], device=dev), args.max_new_tokens,
                                stop or None, return_stats=True)
        out.append({"index": k, "id": ids[k], "tokens": stats.output_ids[0, len(prompts[k]):].tolist(),
                    "committed": [int(x) for x in stats.acceptance_lengths]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True, help="an export folder (config.json + model.safetensors)")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--completions", help="Parquet of the target's greedy completions (id, input_ids, loss_mask)")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--max-prompts", type=int)
    ap.add_argument("--device", default="0")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--eval-json", help="eval --json report of the same prompts: compared round by round")
    ap.add_argument("--out", required=True)
    ap.add_argument("--slice", type=int, help=argparse.SUPPRESS)  # a worker: its slice, JSON to stdout
    args = ap.parse_args()
    faulthandler.enable()
    if args.slice is not None:
        print(json.dumps(decode_slice(args)))
        return
    t0 = time.time()
    argv = [a for a in sys.argv[1:]]
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--slice", str(j)], stdout=subprocess.PIPE, text=True)
             for j in range(args.jobs)]
    rows = []
    for p in procs:
        got, _ = p.communicate()
        if p.returncode != 0:
            sys.exit(f"a worker failed (exit {p.returncode})")
        rows += json.loads(got)
    rows.sort(key=lambda r: r["index"])
    rounds = sum(len(r["committed"]) for r in rows)
    committed = sum(sum(r["committed"]) for r in rows)
    per_prompt = [sum(r["committed"]) / len(r["committed"]) for r in rows if r["committed"]]
    res = {"prompts": len(rows), "rounds": rounds, "committed": committed, "tau": committed / rounds,
           "tau_per_prompt_mean": sum(per_prompt) / len(per_prompt), "seconds": time.time() - t0,
           "max_new_tokens": args.max_new_tokens, "command": " ".join([Path(sys.argv[0]).name, *argv])}
    if args.completions:
        from dflash_offline.evaluate.inputs import read_reference, read_prompts
        from dflash_offline.targets.folder import eos_ids, read_target

        ids, prompts = read_prompts(args.prompts, read_target(args.target).vocab_size, args.max_prompts)
        want = read_reference(args.completions, ids, prompts, args.max_new_tokens, eos_ids(args.target),
                              vocab_size=read_target(args.target).vocab_size)
        res["lossless"] = sum(r["tokens"] == w for r, w in zip(rows, want))
    if args.eval_json:
        rep = json.loads(Path(args.eval_json).read_text())
        ours = rep["drafters"][0]
        res["eval_tau"] = ours["tau"]
        res["eval_tau_per_prompt_mean"] = ours["tau_per_prompt_mean"]
        res["same_rounds"] = sum(a == r["committed"] for a, r in zip(ours["committed_per_prompt"], rows))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"reference (dflash_generate, fp32, batch 1): tau {res['tau']:.4f} pooled ({committed} tokens / {rounds} "
          f"rounds), {res['tau_per_prompt_mean']:.4f} per-prompt mean"
          + (f"; lossless {res['lossless']}/{len(rows)}" if "lossless" in res else "")
          + (f"; eval: tau {res['eval_tau']:.4f} pooled, {res['eval_tau_per_prompt_mean']:.4f} per-prompt, "
             f"same rounds on {res['same_rounds']}/{len(rows)} prompts" if "eval_tau" in res else "")
          + f" ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
