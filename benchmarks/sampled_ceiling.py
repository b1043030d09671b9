"""How far sampled acceptance can go for a drafter that drafts a block's slots in parallel: measured
on the target alone, with no drafter trained.

When decoding samples at temperature T, a drafted token at slot k is kept with probability
min(1, p_k / q_k), so a slot survives with probability 1 - TV(p_k, q_k) = sum_v min(p_k, q_k). A DFlash
drafter drafts slot k without the tokens sampled at slots 1..k-1, while the target's p_k depends on
them: its q_k can only be one distribution for all of them. That costs acceptance that training
cannot win back, and this script measures it. At positions along sampled continuations of held-out prompts
(the last token of each context plays the round's bonus token), it samples N continuations of the
block from the target and keeps every conditional p_{i,k}, then builds the two best blind drafts:

- mean: q_k = the mean of the N conditionals, the target's k-th-next-token distribution given the
  context alone (what cross-entropy and top-k distillation train towards);
- l1:   q_k = the distribution nearest the N conditionals in mean L1 distance (the coordinate-wise
  median, made to sum to one by water-filling), which maximises sum_v min(p_{i,k}, q_k) on average:
  what DSpark's L1 term trains towards.

With `--sharpen 0.5,0.7`, also mean^(1/t) renormalised ("sharp0.5", ...): the mean draft sampled at a
draft temperature t below the target's, what a drafter trained towards the mean (cross-entropy) can
output at decode time with no training (`eval --draft-temperature`).

With `--markov`, also the two drafts given the previous drafted token ("markov-mean", "markov-l1"):
slot k's q is the mean (or the l1 draft) of the conditionals of the samples whose token at slot k - 1
is the one just drafted, what DSpark's Markov head can see; fitted on the N samples, so an estimate
from below (a drafted token few samples drew gets a noisy draft).

All but the Markov drafts are drafts a perfect parallel drafter could output (functions of the context alone; slot 1's
equals the target's, so it always survives). Each is then decoded for real: S draft blocks drawn
from it, the target run on each, the rejection rule applied slot by slot; a round commits its kept
drafts plus one token, counted as the reference counts tau (pooled over rounds). DSpark's Markov
head sees the previous drafted token, so its ceiling is higher than this one. The drafts are fitted
to their N samples, so their acceptance on those samples (`slot_acceptance_on_samples` in the
output) is optimistic; the decoded rounds draw fresh tokens and give each draft's own tau.

    python benchmarks/sampled_ceiling.py --target ../shared/fixtures/pycode/target \\
        --prompts ../shared/fixtures/pycode/prompts-eval.parquet --prompts-used 50 --device cpu \\
        --out results/sampled_ceiling.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def l1_draft(p):
    """The distribution q maximising mean_i sum_v min(p[i, v], q[v]) for rows p [N, V], by water-filling:
    mean_i min(p[i, v], x) rises with slope (j + 1) / N between the (j+2)-th and (j+1)-th largest p[i, v],
    so the mass goes to the steepest pieces first (each token's from the bottom up) until it sums to one."""
    import torch

    n, v = p.shape
    top, _ = torch.sort(p, dim=0, descending=True)
    length = (top - torch.cat([top[1:], torch.zeros_like(top[:1])])).flatten()  # piece j: [top[j+1], top[j]]
    slope = torch.arange(1, n + 1, device=p.device)[:, None].expand(n, v).flatten()
    order = torch.argsort(slope, descending=True, stable=True)
    before = torch.cumsum(length[order], 0) - length[order]
    amount = torch.minimum(length[order], torch.clamp(1.0 - before, min=0.0))
    return torch.zeros(n * v, dtype=p.dtype, device=p.device).index_add_(0, order, amount).view(n, v).sum(0)


def sharpened(q, t: float, first_slot: int = 1):
    """q [slots, V] at draft temperature t (q^(1/t) renormalised) from slot `first_slot` (1-based)
    on; the slots before it unchanged."""
    import torch

    w = q.clamp_min(1e-30) ** (1.0 / t)
    w = torch.cat([q[:first_slot - 1], w[first_slot - 1:]])
    return w / w.sum(-1, keepdim=True)


def acceptance(p, q):
    """sum_v min(p, q) per row: the probability a token drafted from q survives the rejection rule."""
    import torch

    return torch.minimum(p, q).sum(-1)


def probs(logits, temperature: float):
    import torch

    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_block(model, context, n: int, slots: int, temperature: float, gen):
    """N continuations of `slots` tokens from the target after `context` [1, L]: the conditionals
    p[i, k] [N, slots, V] (row i's distribution of its k-th token) and the tokens [N, slots]."""
    import torch

    out = model(context, use_cache=True)
    cache = out.past_key_values
    cache.batch_repeat_interleave(n)
    p = [probs(out.logits[:, -1], temperature).expand(n, -1)]
    tokens = []
    for k in range(slots):
        tokens.append(torch.multinomial(p[-1], 1, generator=gen))
        if k + 1 < slots:
            out = model(tokens[-1], past_key_values=cache, use_cache=True)
            p.append(probs(out.logits[:, -1], temperature))
    return torch.stack(p, 1), torch.cat(tokens, 1)


def decode_rounds(model, context, q, rounds: int, temperature: float, gen, drawn=None):
    """`rounds` real verify rounds of a blind draft q [slots, V] after `context`: draft every slot from
    q, run the target over the block, keep slot k with probability min(1, p_k / q_k) until the first
    rejection. `drawn` (drafts [rounds, slots], q of each [rounds, slots]) replaces the draws from q
    (the Markov draft's). Returns the drafts kept per round [rounds]."""
    import torch

    if drawn is None:
        slots = q.shape[0]
        drafts = torch.stack([torch.multinomial(q[k], rounds, replacement=True, generator=gen) for k in range(slots)], 1)
        qk = q[torch.arange(slots)[None], drafts]
    else:
        drafts, qk = drawn
    out = model(context, use_cache=True)
    cache = out.past_key_values
    cache.batch_repeat_interleave(rounds)
    first = probs(out.logits[:, -1], temperature).expand(rounds, -1)
    rest = probs(model(drafts[:, :-1], past_key_values=cache, use_cache=True).logits, temperature)
    p = torch.cat([first[:, None], rest], 1)  # [rounds, slots, V]: p_k given the drafts before slot k
    pk = p.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(pk.shape, generator=gen, device=pk.device)
    kept = (u * qk < pk).int()
    return torch.cumprod(kept, 1).sum(1)


def markov_draw(p, tokens, rounds: int, gen, fit):
    """Drafts [rounds, slots] from a Markov draft, and q of each: slot 1 from fit(p[:, 0]); slot k from
    fit of the conditionals of the samples whose token at slot k - 1 is the one just drafted (all N
    samples when none is). What a drafter that sees the previous drafted token could reach
    (DSpark's Markov head), estimated from the N samples (a small group makes it noisy, not better)."""
    import torch

    slots = p.shape[1]
    drafts = torch.zeros(rounds, slots, dtype=torch.long, device=p.device)
    qk = torch.zeros(rounds, slots, dtype=p.dtype, device=p.device)
    q = fit(p[:, 0]).expand(rounds, -1)
    for k in range(slots):
        if k > 0:
            prev, q = drafts[:, k - 1], torch.empty(rounds, p.shape[-1], dtype=p.dtype, device=p.device)
            whole = fit(p[:, k])
            for x in prev.unique():
                group = tokens[:, k - 1] == x
                q[prev == x] = fit(p[group, k]) if group.any() else whole
        drafts[:, k] = torch.multinomial(q, 1, generator=gen)[:, 0]
        qk[:, k] = q.gather(1, drafts[:, k:k + 1])[:, 0]
    return drafts, qk


def trajectory(model, prompt, length: int, temperature: float, gen, eos: set[int], ks: tuple[int, ...]):
    """One sampled continuation of `prompt` (a list of ids), cut at a stop token, and for each of its
    tokens the probability mass of the target's top-k for every k in `ks` [tokens, len(ks)]."""
    import torch

    ids = torch.tensor([prompt], device=model.device)
    out = model(ids, use_cache=True)
    got, mass = [], []
    for _ in range(length):
        p = probs(out.logits[:, -1], temperature)
        t = torch.multinomial(p, 1, generator=gen)
        if int(t) in eos:
            break
        got.append(int(t))
        mass.append(p[0].topk(max(ks)).values.cumsum(-1)[[k - 1 for k in ks]])
        out = model(t, past_key_values=out.past_key_values, use_cache=True)
    return got, torch.stack(mass) if mass else torch.zeros(0, len(ks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True, help="Parquet of held-out prompts (input_ids)")
    ap.add_argument("--prompts-used", type=int, default=50)
    ap.add_argument("--positions", default="16,48,80,112",
                    help="where along each prompt's sampled continuation a round starts (tokens in)")
    ap.add_argument("--block-size", type=int, default=16, help="the drafter's block: block - 1 drafted slots")
    ap.add_argument("--samples", type=int, default=64, help="N: continuations sampled to build each blind draft")
    ap.add_argument("--rounds", type=int, default=64, help="S: verify rounds decoded per position and draft")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--sharpen", default="", help="draft temperatures t < 1 applied to the mean draft (comma-separated)")
    ap.add_argument("--sharpen-from", type=int, default=1, help="the first slot --sharpen applies to (1 = all)")
    ap.add_argument("--markov", action="store_true",
                    help="also the Markov drafts (markov-mean, markov-l1): each slot's draft given the token drafted "
                         "before it, fitted on the samples that drew that token (DSpark's head sees it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or a CUDA index")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    faulthandler.enable()
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_offline.evaluate.inputs import read_prompts
    from dflash_offline.targets.folder import eos_ids, read_target

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(f"cuda:{args.device}" if args.device != "cpu" else "cpu")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    _, prompts = read_prompts(args.prompts, read_target(args.target).vocab_size, args.prompts_used)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(dev).eval()
    eos, slots, t0 = set(eos_ids(args.target)), args.block_size - 1, time.time()
    positions = [int(x) for x in args.positions.split(",")]
    sharp = [float(t) for t in args.sharpen.split(",") if t.strip()]
    markov = {"markov-mean": lambda c: c.mean(0), "markov-l1": l1_draft} if args.markov else {}
    names = ["mean", "l1", *(f"sharp{t:g}" for t in sharp), *markov]
    accept = {name: torch.zeros(slots) for name in names}  # per slot, summed over positions
    kept: dict[str, list] = {name: [] for name in names}
    used, ks, mass = 0, (8, 32, 128, 512), []
    with torch.inference_mode():
        for n, prompt in enumerate(prompts):
            # The mass: how much of the target's distribution a top-k cache holds along the continuation
            # (a drafter trained on the k ids and one bucket for the rest knows nothing of the rest).
            lead, lead_mass = trajectory(model, prompt, max(positions), args.temperature, gen, eos, ks)
            mass.append(lead_mass.cpu())
            for at in (a for a in positions if a <= len(lead)):
                context = torch.tensor([prompt + lead[:at]], device=dev)
                p, tokens = sample_block(model, context, args.samples, slots, args.temperature, gen)
                mean = p.mean(0)
                drafts = {"mean": mean, "l1": torch.stack([l1_draft(p[:, k]) for k in range(slots)])}
                for t in sharp:
                    drafts[f"sharp{t:g}"] = sharpened(mean, t, args.sharpen_from)
                for name, q in drafts.items():
                    accept[name] += acceptance(p, q[None]).mean(0).cpu()
                    kept[name].append(decode_rounds(model, context, q, args.rounds, args.temperature, gen).cpu())
                for name, fit in markov.items():
                    drawn = markov_draw(p, tokens, args.rounds, gen, fit)
                    kept[name].append(decode_rounds(model, context, None, args.rounds, args.temperature, gen,
                                                    drawn).cpu())
                used += 1
            print(f"prompt {n + 1}/{len(prompts)}: {used} positions, {time.time() - t0:.0f} s", flush=True)
    res = {"positions": used, "samples": args.samples, "rounds_per_position": args.rounds,
           "temperature": args.temperature, "block_size": args.block_size, "seconds": time.time() - t0,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "topk_mass": dict(zip(map(str, ks), torch.cat(mass).mean(0).tolist()))}
    print("mean top-k mass along the continuations: "
          + ", ".join(f"top-{k} {m:.3f}" for k, m in res["topk_mass"].items()), flush=True)
    for name in names:
        k = torch.cat(kept[name]).float()
        survive = [(k >= j + 1).float().mean().item() for j in range(slots)]
        res[name] = {"tau": 1 + k.mean().item(), "survival": survive}
        if name not in markov:  # a Markov draft has no one q per slot to score on the samples
            res[name]["slot_acceptance_on_samples"] = (accept[name] / max(used, 1)).tolist()
        print(f"{name:>9}: tau {res[name]['tau']:.3f} (pooled over {len(k)} rounds); survival "
              + " ".join(f"{s:.2f}" for s in survive[:8]) + " ...", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
