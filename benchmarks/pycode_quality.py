"""The drafter-quality scoreboard on the pycode fixture: generate, extract, train, decode.

Runs the project's commands as a user would, each in its own process, and times every phase:
  1. `generate`: the fixture target's own completions of --fresh training prompts
     (`prompts-train-40k.parquet`), sampled at --fresh-temperature (1 by default: the default
     recipe's data) or greedy (0);
  2. `extract`: one training cache of those completions plus the fixture's 4000 training
     completions (a superset of layers: `train --target-layers` picks from it), and a held-out cache of
     the fixture's 200 eval completions (the walk estimate during and after training);
  3. `train`: each variant (the shared options of RECIPE plus the variant's; by default `dspark-cl`,
     the fixture's default recipe, stages/pycode/train.toml; `dflash` is the DFlash recipe,
     stages/pycode-dflash/train.toml), with the
     held-out walk estimate at the end, or every --eval-every steps (the curve of tau against time);
  4. `eval --prompts`: lossless speculative decoding of the 200 held-out prompts, checked token for
     token against the fixture's greedy completions (`--reference`), batched (--eval-batch-size
     prompts per target forward, fp32) in --eval-jobs processes; then sampled at
     --sampled-temperature (speculative sampling, exact in distribution: no token check).
Optionally (--peer-budget) a drafter trained on the peer trainer's budget: 372 steps of 16,384
tokens on the fixture's 4000 completions alone, decoded the same way.

    python benchmarks/pycode_quality.py --fixture ../shared/fixtures/pycode --work /dev/shm/pycode \
        --device 0 --results results/

The end-to-end figure is the wall time of generate + extract + train of the first variant when it
runs alone on the device (--sequential, the default); variants run after it do not change it.
Decoding tau is pooled over all rounds of all prompts (total committed tokens / rounds) and also
given as the mean over prompts of each prompt's own tau (the reference benchmark's average).
`--smoke` runs the same pipeline on the CPU with a few rows and tiny budgets, to check the script.
`--target-family hybrid` runs it all on the hybrid target of benchmarks/hybrid_fixture.py (a trained
Qwen3.5-style Gated DeltaNet model, its own completions from --hybrid-fixture, by default
benchmarks/fixtures/pycode-hybrid, where it is committed: its README says whether it is there yet)
with the same prompts. Its defaults stay the DFlash
recipe on greedy data (`--variants dflash --fresh-temperature 0`, the recipe measured on it) until
DSpark, the warm start and the tap table are measured there. Presets combine with `+` (their
options one after the other: `dspark-cl+init-all+tap-full`); groups name the tables:

    # the tap table: six layer choices from one cache of all 8 layers, DSpark, one epoch each
    python benchmarks/pycode_quality.py --target-family hybrid --fresh-temperature 1 \
        --capture 0,1,2,3,4,5,6,7 --epochs 1 --variants taps
    # the warm-start table: random, every layer's MLP and norms (attention from 3 and 7), all attention
    python benchmarks/pycode_quality.py --target-family hybrid --fresh-temperature 1 --epochs 1 --variants warm

The default recipe against the DFlash one, side by side (docs/benchmarks.md):

    python benchmarks/pycode_quality.py --variants "dspark-cl,dflash@t0"
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

HYBRID_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "pycode-hybrid"  # hybrid_fixture.py's COMMITTED

# name -> extra train options. The first variant is the one whose end-to-end time is reported.
PRESETS = {
    "dflash": [],  # the DFlash recipe (RECIPE alone; stages/pycode-dflash)
    "row512": ["--anchors-per-sample", "0"],
    "lr6e-4": ["--lr", "6e-4"],
    "layers1-5": ["--target-layers", "1,2,3,4,5"],
    "kd": ["--kd-weight", "0.5"],
    "lr2.5e-3": ["--lr", "2.5e-3"],
    # DSpark (drafter/dspark.py) on the same cache: its loss replaces the recipe's distillation
    # (--kd-weight) and D-PACE weights (exp(-k/gamma) slot weights); p_target is the cache's top-32.
    "dspark": ["--method", "dspark", "--kd-weight", "0", "--loss-weights", "decay"],
    # The same with each chunk of its three-term loss compiled (train --compile-loss): the fixture's
    # default recipe (stages/pycode), trained on completions sampled at T = 1.
    "dspark-cl": ["--method", "dspark", "--kd-weight", "0", "--loss-weights", "decay", "--compile-loss"],
    "dspark-gated": ["--method", "dspark", "--kd-weight", "0", "--loss-weights", "decay", "--markov-head", "gated"],
    # The default recipe's ablations, each behind its switch: the gated Markov head, no confidence
    # head (its BCE term gone), a Markov head of rank 64.
    "dspark-cl-gated": ["--method", "dspark", "--kd-weight", "0", "--loss-weights", "decay", "--compile-loss",
                        "--markov-head", "gated"],
    "dspark-cl-noconf": ["--method", "dspark", "--kd-weight", "0", "--loss-weights", "decay", "--compile-loss",
                         "--no-confidence-head"],
    "dspark-cl-r64": ["--method", "dspark", "--kd-weight", "0", "--loss-weights", "decay", "--compile-loss",
                      "--markov-rank", "64"],
    # DFlash with DSpark's distribution term (no heads; exported as plain DFlash): the lever for
    # sampled acceptance that keeps the served method.
    "tv": ["--kd-weight", "0", "--loss-weights", "decay", "--tv-weight", "0.9"],
    # The same with the recipe's D-PACE slot weights in place of the decay.
    "tv-dpace": ["--kd-weight", "0", "--tv-weight", "0.9"],
    "dspark-ce": ["--method", "dspark", "--kd-weight", "0", "--loss-weights", "decay", "--ce-weight", "1",
                  "--tv-weight", "0"],
}

# The hybrid fixture's target (benchmarks/hybrid_fixture.py): 8 layers, [Gated DeltaNet x 3, full
# attention] x 2. What a drafter reads of it (`--target-layers`, from one cache of all 8 layers:
# `--capture 0,1,2,3,4,5,6,7`) and what its layers start from (`--init-layers`, one id per drafter
# layer; a Gated DeltaNet layer gives its MLP and norms, a full-attention one its attention too:
# drafter/warm_start.py). Combined with a recipe by `+`: `dspark-cl+tap-full`, `dspark-cl+init-all`.
HYBRID_PRESETS = {
    "tap-dense": ["--target-layers", "1,2,3,4,5,6"],  # the dense recipe's capture
    "tap-even": ["--target-layers", "1,3,5,7"],  # every other layer, over the whole depth
    "tap-gdn": ["--target-layers", "0,1,2,4,5,6"],  # Gated DeltaNet layers only
    "tap-full": ["--target-layers", "3,7"],  # full-attention layers only: here also the last layer of each group
    "tap-first": ["--target-layers", "0,4"],  # the first layer of each group of four
    "tap-lastgdn": ["--target-layers", "2,6"],  # the last Gated DeltaNet layer of each group
    "tap-all": ["--target-layers", "0,1,2,3,4,5,6,7"],
    "init-all": ["--init-layers", "0,1,2,3,4,5,6,7"],  # each layer's MLP and norms, attention in layers 3 and 7
    "init-attn": ["--init-layers", "3,3,3,3,7,7,7,7"],  # every drafter layer's attention from a full-attention one
}
PRESETS.update(HYBRID_PRESETS)

# Names for a set of variants measured side by side (each member as --variants takes it).
GROUPS = {
    # The tap table: six layer choices, one recipe and budget (the last layer of each group is the
    # full-attention one in this layout, so tap-lastgdn takes the sixth row).
    "taps": [f"dspark-cl+{t}" for t in ("tap-dense", "tap-even", "tap-gdn", "tap-full", "tap-first", "tap-lastgdn")],
    # The warm-start table: the random start against the two starts the hybrid's layers allow.
    "warm": ["dspark-cl", "dspark-cl+init-all", "dspark-cl+init-attn"],
}

# Earlier names of presets, kept working with a note: the commands in docs/benchmarks.md use them.
RENAMED = {"default": "dflash"}
RENAMED_WHY = {"default": "the DFlash recipe; the fixture's default recipe is now dspark-cl"}

# The recipe (docs/benchmarks.md, "Drafter quality on the pycode fixture"): 8 drafter layers started
# as copies of all 8 target layers, D-PACE slot weights, rows of 16,384 tokens (one micro-batch a step),
# 8192 blocks a row, top-32 distillation at half weight.
RECIPE = ("--global-batch-tokens 16384 --seq-len 16384 --num-anchors 8192 --kd-weight 0.5 --drafter-layers 8 "
          "--init-layers 0,1,2,3,4,5,6,7 --loss-weights dpace --lr 2.5e-3")
# The hybrid target's Gated DeltaNet and gated attention layers cannot start the drafter's layers.
HYBRID_RECIPE = RECIPE.replace(" --init-layers 0,1,2,3,4,5,6,7", "")
# The peer's budget is 372 steps of 16,384 tokens in rows of 4096 (see --peer-budget).
PEER_ROWS = ["--seq-len", "4096", "--num-anchors", "2048"]


def cli(*args, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    f = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "dflash_offline", *map(str, args)], stdout=f, stderr=subprocess.STDOUT,
                            env=env)


def stop(procs) -> None:
    """End processes still running (SIGTERM, then SIGKILL after 10 s): a benchmark that stops leaves
    nothing holding the GPU."""
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        p.terminate()
    deadline = time.time() + 10
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_all(starts: dict, logs: dict[str, Path], limit: int = 0, reported=lambda name: False) -> dict[str, float]:
    """Start each process (`starts`: name -> a function that starts it), at most `limit` at once (0:
    all), and wait for all; returns each one's seconds from its own start. A non-zero exit stops the
    benchmark, except exit 1 of a process whose report `reported(name)` says was written (eval exits 1
    when its outputs are not lossless: a result); the ones still running are stopped first."""
    queue, running, began, took = list(starts), {}, {}, {}
    try:
        while queue or running:
            while queue and (limit <= 0 or len(running) < limit):
                name = queue.pop(0)
                began[name], running[name] = time.time(), starts[name]()
            for name, p in list(running.items()):
                if p.poll() is None:
                    continue
                del running[name]
                took[name] = time.time() - began[name]
                if p.returncode != 0 and not (p.returncode == 1 and reported(name)):
                    tail = "".join(logs[name].read_text().splitlines(keepends=True)[-20:])
                    raise SystemExit(f"{name} failed with exit code {p.returncode}"
                                     f"{f' ({len(running)} others stopped)' if running else ''}:\n{tail}")
                print(f"  {name} done in {took[name]:.0f}s", flush=True)
            time.sleep(0.5)
    finally:
        stop(running.values())
    return took


def wait(procs: dict[str, subprocess.Popen], logs: dict[str, Path], reported=lambda name: False) -> dict[str, float]:
    """Wait for processes already started (run_all's rules)."""
    return run_all({n: (lambda p=p: p) for n, p in procs.items()}, logs, reported=reported)


def parse_variants(text: str) -> dict[str, list[str]]:
    """'dflash,kd' (presets), 'dspark-cl+tap-full' (presets' options one after another), 'taps' (a
    group: its members) or 'name=--opt v --opt2 w;name2=...' (explicit options). A name ending in
    @tT (`tv@t1`, `dflash@t0`) trains on fresh completions sampled at temperature T (0: greedy)
    instead of --fresh-temperature's: the board then makes and extracts one training set per
    temperature, so data and objective compare side by side in one run."""
    out = {}
    items = [t.strip() for t in text.split(";" if "=" in text else ",") if t.strip()]
    items = [m for t in items for m in (GROUPS[t] if t in GROUPS else [t])]
    for item in items:
        if "=" in item:
            name, opts = item.split("=", 1)
            out[name.strip()] = shlex.split(opts)
            continue
        opts = []
        for p in item.split("@")[0].split("+"):
            preset = RENAMED.get(p, p)
            if preset not in PRESETS:
                raise SystemExit(f"--variants: unknown preset {p!r} in {item!r}; presets: {', '.join(PRESETS)}; "
                                 f"groups: {', '.join(GROUPS)}; or NAME=OPTIONS")
            if preset != p:
                print(f"--variants: {p!r} is now named {preset!r} ({RENAMED_WHY[p]})", file=sys.stderr)
            opts += PRESETS[preset]
        out[item] = opts
    return out


def last_value(opts: list[str], flag: str) -> str | None:
    """The value the last `flag VALUE` of an option list gives (the one train keeps), or None."""
    found = None
    for a, b in zip(opts, opts[1:]):
        if a == flag:
            found = b
    return found


def check_variants(variants: dict[str, list[str]], train_args: list[str], capture: str) -> None:
    """Refuse, before any GPU time is spent, a variant whose train would fail after generate and
    extract: layers it reads that the cache will not hold, a start with another count of layers
    than the drafter's."""
    held = {int(x) for x in capture.split(",")}
    for name, opts in variants.items():
        every = train_args + opts
        taps = last_value(every, "--target-layers")
        if taps is not None and not {int(x) for x in taps.split(",")} <= held:
            raise SystemExit(f"--variants: {name} reads layers {taps}, and --capture {capture} does not hold them all; "
                             f"capture them (--capture 0,1,2,3,4,5,6,7 for the tap table)")
        init, depth = last_value(every, "--init-layers"), last_value(every, "--drafter-layers")
        if init is not None and depth is not None and len(init.split(",")) != int(depth):
            raise SystemExit(f"--variants: {name} starts {len(init.split(','))} layers (--init-layers {init}) of a "
                             f"drafter of {depth} (--drafter-layers {depth})")


def data_temperature(variant: str, default: float) -> float:
    """The fresh data's temperature a variant trains on: its @tT suffix, else --fresh-temperature."""
    if "@" not in variant:
        return default
    tag = variant.split("@", 1)[1]
    try:
        if not tag.startswith("t"):
            raise ValueError
        return float(tag[1:])
    except ValueError:
        raise SystemExit(f"--variants: {variant!r}: the suffix after @ is tT, T the data's temperature (tv@t1)")


def cache_tag(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"t{temperature:g}"


def prompt_slices(prompts: Path, n: int, jobs: int, work: Path) -> list[Path]:
    """The first n prompts in `jobs` contiguous Parquet slices (ids kept)."""
    import pyarrow.parquet as pq

    table = pq.read_table(prompts)
    table = table.slice(0, min(n, table.num_rows))
    size = -(-table.num_rows // jobs)
    out = []
    for j in range(0, table.num_rows, size):
        path = work / f"prompts-{j // size}.parquet"
        pq.write_table(table.slice(j, size), path)
        out.append(path)
    return out


def merge_decode(reports: list[dict]) -> dict:
    """One drafter's decode figures over its prompt slices: pooled tau (all rounds), the per-prompt
    mean, per-slot acceptance, lossless only if every slice is."""
    ds = [r["drafters"][0] for r in reports]
    rounds = sum(d["rounds"] for d in ds)
    slots = len(ds[0]["accept_rate"])
    per_prompt = [t for d in ds for t in d.get("tau_per_prompt", [])]
    out = {"prompts": sum(r["num_prompts"] for r in reports), "rounds": rounds,
            "tokens": sum(d["tokens"] for d in ds), "tau_pooled": sum(d["tau"] * d["rounds"] for d in ds) / rounds,
            "tau_per_prompt_mean": sum(per_prompt) / len(per_prompt) if per_prompt else None,
            "accept_rate": [sum(d["accept_rate"][j] * d["rounds"] for d in ds) / rounds for j in range(slots)],
            "lossless": all(d.get("lossless") is True for d in ds),
            "mismatched_prompt_ids": [i for d in ds for i in d.get("mismatched_prompt_ids", [])],
            "device": reports[0]["device"], "torch": reports[0]["torch"]}
    if all("confidence" in d for d in ds):  # a DSpark drafter's confidence head: its calibration per slot
        n = [sum(d["confidence"]["verified"][j] for d in ds) for j in range(len(ds[0]["confidence"]["verified"]))]
        out["confidence"] = {key: [sum(d["confidence"][key][j] * d["confidence"]["verified"][j] for d in ds) / max(n[j], 1)
                                   for j in range(len(n))] for key in ("predicted", "observed")}
        out["confidence"]["verified"] = n
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default="../shared/fixtures/pycode")
    ap.add_argument("--target-family", choices=("dense", "hybrid"), default="dense",
                    help="dense: the fixture's Qwen3 target; hybrid: the target and completions of --hybrid-fixture "
                         "(prompts still from --fixture)")
    ap.add_argument("--hybrid-fixture", default=str(HYBRID_FIXTURE),
                    help="the folder benchmarks/hybrid_fixture.py made (--target-family hybrid; default: the committed "
                         "one, %(default)s)")
    ap.add_argument("--work", default="/dev/shm/pycode")
    ap.add_argument("--results", default="results")
    ap.add_argument("--device", default="0")
    ap.add_argument("--fresh", type=int, default=12000, help="training prompts to complete with the target (0: none)")
    ap.add_argument("--fresh-temperature", type=float, default=None,
                    help="sample the fresh completions at this temperature (0: greedy; default 1, the default "
                         "recipe's data; 0 with --target-family hybrid)")
    ap.add_argument("--fresh-samples", type=int, default=1,
                    help="completions per fresh prompt (generate --samples-per-prompt: sampled, each its own row id "
                         "and noise)")
    ap.add_argument("--gen-dtype", default="bfloat16", help="generate's compute dtype (bf16: twice the speed; the fixture's completions are fp32)")
    ap.add_argument("--capture", default="1,2,3,4,5,6", help="layers extracted (train --target-layers picks among them)")
    ap.add_argument("--hidden-dtype", default="fp8", help="training cache: fp8 (half the bytes) or bfloat16")
    ap.add_argument("--topk", type=int, default=32, help="top-k log-probabilities in the training cache (for --kd-weight)")
    ap.add_argument("--gen-batch-tokens", type=int, default=1 << 20,
                    help="generate --batch-tokens: 2048 rows of 128 + 384 tokens per decoding batch (the default "
                         "512 rows leave the H200 launch-bound on this 17M target)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--train-args", default=None,
                    help="options given to every variant's train (default: the recipe of --target-family)")
    ap.add_argument("--variants", default=None,
                    help="presets or NAME=OPTIONS (default: dspark-cl, the fixture's default recipe; dflash with "
                         "--target-family hybrid)")
    ap.add_argument("--concurrent", type=int, nargs="?", const=0, default=None, metavar="N",
                    help="train the variants N at a time (no N: all at once; a quality comparison, their wall times "
                         "then shared); each hybrid-board trainer holds about 22 GB: 3 at a time on an 80 GB H100")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="steps between held-out walk estimates (the curve); 0 = at the end only (each costs seconds "
                         "of the budget)")
    ap.add_argument("--peer-budget", action="store_true", help="also the peer's budget: 372 steps x 16K tokens on 4000 rows")
    ap.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts decoded (0: walk estimate only)")
    ap.add_argument("--sampled-temperature", type=float, default=1.0,
                    help="also decode the held-out prompts sampling at this temperature (0 = greedy only)")
    ap.add_argument("--also-temperatures", default="",
                    help="more sampled decodes after --sampled-temperature's, comma-separated (0.6: each stored as "
                         "decode_t0.6; benchmarks/sampled_ceiling.py gives the ceiling to compare with)")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--eval-jobs", type=int, default=1, help="decoding processes per drafter (prompt slices)")
    ap.add_argument("--eval-batch-size", type=int, default=256,
                    help="prompts per target forward in each decoding process (eval --batch-size; 1 = one prompt at "
                         "a time with a KV cache, launch-bound on a GPU)")
    ap.add_argument("--eval-device", default=None,
                    help="where decoding runs (default: --device); cpu = --eval-jobs single-thread CPU processes, "
                         "fp32 like the reference completions (one launch-bound GPU process per prompt is slower)")
    ap.add_argument("--smoke", action="store_true", help="CPU, a few rows: checks the script, not the drafter")
    args = ap.parse_args()
    fx, work, res = Path(args.fixture).absolute(), Path(args.work).absolute(), Path(args.results).absolute()
    hybrid = args.target_family == "hybrid"
    # The default recipe (DSpark on sampled completions) is measured on the dense target; the hybrid
    # board keeps the recipe measured on it (DFlash, greedy data).
    args.variants = args.variants or ("dflash" if hybrid else "dspark-cl")
    args.fresh_temperature = args.fresh_temperature if args.fresh_temperature is not None else (0.0 if hybrid else 1.0)
    variants = parse_variants(args.variants)
    tfx = Path(args.hybrid_fixture).expanduser().absolute() if hybrid else fx  # the target and its completions
    missing = [f for f in ("target/config.json", "completions-train.parquet", "completions-eval.parquet")
               if not (tfx / f).is_file()]
    if missing:
        raise SystemExit(f"--{'hybrid-' if hybrid else ''}fixture {tfx}: no {missing[0]}"
                         + ("; make the hybrid fixture with benchmarks/hybrid_fixture.py all --out DIR (a GPU, about "
                            "9 minutes) and pass --hybrid-fixture DIR" if hybrid else ""))
    target = tfx / "target"
    train_rows, eval_rows = tfx / "completions-train.parquet", tfx / "completions-eval.parquet"
    fresh_prompts, eval_prompts = fx / "prompts-train-40k.parquet", fx / "prompts-eval.parquet"
    args.train_args = args.train_args or (HYBRID_RECIPE if hybrid else RECIPE)
    train_args = shlex.split(args.train_args)
    peer_epochs = 3  # 3 epochs of the 4000 rows in rows of 4096, 4 per step: 372 steps (the peer: 375)
    if args.smoke:
        import pyarrow.parquet as pq

        work.mkdir(parents=True, exist_ok=True)
        for src, n in ((train_rows, 24), (eval_rows, 6), (fresh_prompts, 8)):
            pq.write_table(pq.read_table(src).slice(0, n), work / f"smoke-{src.name}")
        train_rows, eval_rows = work / f"smoke-{train_rows.name}", work / f"smoke-{eval_rows.name}"
        fresh_prompts = work / f"smoke-{fresh_prompts.name}"
        args.device, args.fresh, args.max_new_tokens, args.eval_jobs = "cpu", min(args.fresh, 8), 24, 2
        args.eval_prompts, args.eval_every, peer_epochs = min(args.eval_prompts, 4), 2, 1
        # One drafter layer, unless a variant starts its layers from the target's (then as many as it starts).
        starts = {len(v.split(",")) for v in (last_value(o, "--init-layers") for o in variants.values()) if v}
        depth = str(max(starts)) if starts else "1"
        train_args += ["--seq-len", "512", "--num-anchors", "64", "--global-batch-tokens", "1024", "--drafter-layers", depth,
                       *([] if hybrid or starts else ["--init-layers", "0"]),
                       "--loader-workers", "0"]
    check_variants(variants, train_args, args.capture)
    work.mkdir(parents=True, exist_ok=True)
    res.mkdir(parents=True, exist_ok=True)
    summary: dict = {"args": vars(args), "phases_s": {}, "variants": {}}

    def save() -> None:
        (res / "pycode.json").write_text(json.dumps(summary, indent=1) + "\n")

    t_start = time.time()
    # One training set per data temperature the variants name (the first is --fresh-temperature's).
    data_of = {v: data_temperature(v, args.fresh_temperature) for v in variants}
    temps = list(dict.fromkeys([args.fresh_temperature, *data_of.values()]))
    if len(temps) > 1 and args.fresh == 0:
        raise SystemExit("--variants: a variant's @tT names fresh data at temperature T, and --fresh is 0")

    def named(base: str, t: float) -> str:  # the main set keeps the names of a board with one set
        return base if t == args.fresh_temperature else f"{base}-{cache_tag(t)}"

    train_cache = {t: work / named("cache-train", t) for t in temps}
    data = {t: [train_rows] for t in temps}
    if args.fresh > 0:
        import pyarrow.parquet as pq

        sel = work / "fresh-prompts.parquet"
        pq.write_table(pq.read_table(fresh_prompts).slice(0, args.fresh), sel)
        t0 = time.time()
        for t in temps:
            name, out = named("generate", t), work / f"{named('fresh', t)}.parquet"
            gen = cli("generate", "--target", target, "--prompts", sel, "--out", out, "--devices",
                      args.device, "--max-new-tokens", 384 if not args.smoke else 32, "--compute-dtype", args.gen_dtype,
                      "--batch-tokens", args.gen_batch_tokens,
                      *(["--temperature", t, "--seed", "0"] if t > 0 else []),
                      *(["--samples-per-prompt", args.fresh_samples] if args.fresh_samples > 1 and t > 0 else []),
                      "--no-progress", log=res / f"{name}.log")
            summary["phases_s"].setdefault("generate_each", {})[cache_tag(t)] = \
                wait({name: gen}, {name: res / f"{name}.log"})[name]
            data[t].append(out)
        summary["phases_s"]["generate"] = time.time() - t0
    ext = ["--devices", args.device, "--capture-layers", args.capture, "--max-len", "512", "--compute-dtype", "float32",
           "--no-progress", "--writers", "2" if not args.smoke else "1"]
    t0 = time.time()
    logs, procs = {}, {}
    for t in temps:
        name = named("extract-train", t)
        logs[name] = res / f"{name}.log"
        procs[name] = cli("extract", "--target", target, *[a for d in data[t] for a in ("--data", d)], "--cache",
                          train_cache[t], "--hidden-dtype", args.hidden_dtype, "--topk", args.topk, *ext, log=logs[name])
    logs["extract-eval"] = res / "extract-eval.log"
    procs["extract-eval"] = cli("extract", "--target", target, "--data", eval_rows, "--cache", work / "cache-eval",
                                "--topk", "0", *ext, log=logs["extract-eval"])
    if args.peer_budget:
        logs["extract-peer"] = res / "extract-peer.log"
        procs["extract-peer"] = cli("extract", "--target", target, "--data", train_rows, "--cache", work / "cache-peer",
                                    "--hidden-dtype", args.hidden_dtype, "--topk", args.topk, *ext,
                                    log=logs["extract-peer"])
    took = wait(procs, logs)
    summary["phases_s"]["extract"] = time.time() - t0
    summary["phases_s"]["extract_each"] = took
    summary["train_cache"] = {}
    for t, path in train_cache.items():
        m = json.loads((path / "manifest.json").read_text())
        summary["train_cache"][cache_tag(t)] = {
            **m["totals"], "layer_ids": m["capture"]["layer_ids"], "hidden_dtype": args.hidden_dtype,
            "bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file())}
    save()
    print(f"data ready after {time.time() - t_start:.0f}s: {summary['train_cache']}", flush=True)

    every = ["--eval-every", args.eval_every] if args.eval_every > 0 else []  # none: at the end only
    common = ["--target", target, "--devices", args.device, "--eval-cache", work / "cache-eval", *every,
              "--checkpoint-every", "100000", "--keep-checkpoints", "1", "--log-every", "20",
              "--no-progress", *train_args]
    jobs = {v: ["--cache", train_cache[data_of[v]], "--out", work / f"run-{v}", "--epochs", args.epochs, *common, *opts]
            for v, opts in variants.items()}
    if args.peer_budget:
        jobs["peer-budget"] = ["--cache", work / "cache-peer", "--out", work / "run-peer-budget", "--epochs", peer_epochs,
                               *common, *(PEER_ROWS if not args.smoke else []),
                               "--global-batch-tokens", "16384" if not args.smoke else "1024",
                               *variants[next(iter(variants))]]
    order = list(jobs)
    slices = prompt_slices(eval_prompts, args.eval_prompts, args.eval_jobs, work) if args.eval_prompts > 0 else []
    summary["decode_processes"] = len(slices)
    # Greedy, checked token for token against the fixture's completions; then sampled (speculative
    # sampling's rule: exact in distribution, so no token check), same prompts, seed 0.
    kinds = [("decode", ["--reference", eval_rows])]
    sampled = {"decode_sampled": args.sampled_temperature} if args.sampled_temperature > 0 else {}
    sampled.update({f"decode_t{float(t):g}": float(t) for t in args.also_temperatures.split(",") if t.strip()})
    kinds += [(k, ["--temperature", t, "--seed", "0", "--no-baseline"]) for k, t in sampled.items()]

    def record(v: str, train_s: float) -> None:
        run = work / f"run-{v}"
        mt = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        held = [json.loads(x) for x in (run / "heldout.jsonl").read_text().splitlines()]
        steady = mt[3:] or mt
        summary["variants"][v] = {
            "options": train_args + (variants.get(v) or variants[next(iter(variants))]), "steps": len(mt), "train_s": train_s,
            "step_time_s": sum(r["step_time"] for r in steady) / len(steady), "loss_last": mt[-1]["loss"],
            "tau_train_last": mt[-1]["tau"], "tokens": mt[-1]["tokens"],
            "walk": [{k: h[k] for k in ("step", "tau_pooled", "tau_per_prompt_mean", "tau_all_anchors", "train_s")
                      if k in h} for h in held],
            "best": json.loads((run / "best.json").read_text()),
        }
        save()

    def decode(v: str) -> None:  # one drafter at a time: its slices share the device
        for kind, extra in kinds if slices else []:
            t0 = time.time()
            names = [f"eval-{v}-{kind}-{j}" for j in range(len(slices))]
            logs = {n: res / f"{n}.log" for n in names}
            for n in names:  # a report left by an earlier run must not pass for this run's
                (work / f"{n}.json").unlink(missing_ok=True)
            procs = {n: cli("eval", "--target", target, "--drafter", work / f"run-{v}" / "best", "--prompts", sl,
                            *extra, "--max-new-tokens", args.max_new_tokens, "--devices",
                            args.eval_device or args.device, "--dtype", "float32", "--batch-size",
                            args.eval_batch_size, "--json", work / f"{n}.json", "--no-progress", log=logs[n])
                     for n, sl in zip(names, slices)}
            wait(procs, logs, reported=lambda n: (work / f"{n}.json").exists())
            d = merge_decode([json.loads((work / f"{n}.json").read_text()) for n in names])
            d["seconds"] = time.time() - t0
            if kind != "decode":
                d["lossless"], d["temperature"] = None, sampled[kind]  # exact in distribution
            summary["variants"][v][kind] = d
            save()
            print(f"{v} ({'greedy' if kind == 'decode' else f'temperature {sampled[kind]}'}): decoding "
                  f"tau {d['tau_pooled']:.3f} pooled, {d['tau_per_prompt_mean'] or float('nan'):.3f} per-prompt "
                  f"mean, lossless {d['lossless']} ({d['seconds']:.0f}s)", flush=True)

    logs = {v: res / f"train-{v}.log" for v in order}
    t_train = time.time()
    if args.concurrent is not None:
        took = run_all({v: (lambda v=v: cli("train", *jobs[v], log=logs[v])) for v in order}, logs, limit=args.concurrent)
        for v in order:
            record(v, took[v])
        for v in order:
            decode(v)
    else:  # each drafter decoded as soon as it is trained: its figures are in before the next one trains
        took = {}
        for v in order:
            took.update(wait({v: cli("train", *jobs[v], log=logs[v])}, logs))
            if v == order[0]:
                summary["phases_s"]["train_first"] = took[v]
                if len(temps) == 1:
                    summary["end_to_end_s"] = time.time() - t_start
                else:  # more training sets: its own generate, then extract (all sets at once: an upper bound)
                    summary["end_to_end_s"] = (summary["phases_s"].get("generate_each", {}).get(cache_tag(data_of[v]), 0)
                                               + summary["phases_s"]["extract"] + took[v])
                    summary["end_to_end_composed"] = True
                print(f"end to end (generate + extract + train {v}): {summary['end_to_end_s']:.0f}s"
                      f"{' (its own phases added up)' if len(temps) > 1 else ''}", flush=True)
            record(v, took[v])
            decode(v)
    summary["phases_s"]["train_each"] = took
    summary["phases_s"]["train_all"] = time.time() - t_train  # the decodes in between included when sequential
    summary["total_s"] = time.time() - t_start
    save()
    table = report(summary)
    print(table, flush=True)
    (res / "summary.txt").write_text(table + "\n")
    return 0 if all(v.get("decode", {}).get("lossless", True) for v in summary["variants"].values()) else 1


def report(summary: dict) -> str:
    ph = summary["phases_s"]
    lines = [f"phases: generate {ph.get('generate', 0):.0f}s, extract {ph['extract']:.0f}s, "
             f"train {' / '.join(f'{k} {v:.0f}s' for k, v in ph['train_each'].items())}"]
    if "end_to_end_s" in summary:
        lines.append(f"end to end (generate + extract + train of the first variant): {summary['end_to_end_s']:.0f}s "
                     f"= {summary['end_to_end_s'] / 60:.2f} device-minutes")
    w = max([14, *map(len, summary["variants"])])
    lines.append(f"{'variant':<{w}} {'steps':>5} {'s/step':>7} {'walk pooled':>11} {'walk/prompt':>11} "
                 f"{'rand.anch.':>10} {'decode pooled':>13} {'decode/prompt':>13} {'lossless':>8} {'sampled':>8}")
    for v, r in summary["variants"].items():
        b, d, ds = r["best"], r.get("decode", {}), r.get("decode_sampled", {})
        dp = d.get("tau_per_prompt_mean")
        lines.append(f"{v:<{w}} {r['steps']:>5} {r['step_time_s']:>7.3f} {b['tau_pooled']:>11.3f} "
                     f"{b['tau_per_prompt_mean']:>11.3f} {b['tau_all_anchors']:>10.3f} "
                     f"{d.get('tau_pooled', float('nan')):>13.3f} {dp if dp is not None else float('nan'):>13.3f} "
                     f"{str(d.get('lossless', '-')):>8} {ds.get('tau_pooled', float('nan')):>8.3f}")
    for v, r in summary["variants"].items():  # --also-temperatures
        extra = [f"T = {d['temperature']:g} tau {d['tau_pooled']:.3f} pooled, {d['tau_per_prompt_mean']:.3f} per-prompt"
                 for k, d in r.items() if k.startswith("decode_t")]
        if extra:
            lines.append(f"{v}: " + "; ".join(extra))
    for v, r in summary["variants"].items():  # DSpark: the confidence head's predicted / observed survival
        for k, d in r.items():
            if k.startswith("decode") and "confidence" in d:
                c = d["confidence"]
                lines.append(f"{v} {k}: confidence predicted/observed, slots 1-4: " + " ".join(
                    f"{p:.2f}/{o:.2f}" for p, o in list(zip(c["predicted"], c["observed"]))[:4]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
