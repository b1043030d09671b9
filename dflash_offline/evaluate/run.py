"""`dflash-offline eval`: how many tokens a drafter saves, measured two ways.

1. **Speculative decoding against the target** (`--prompts`; the decoder evaluate.decoders picks:
   the static decoder, evaluate.graphed, for attention and hybrid targets, else transformers' forward,
   evaluate.speculative / kv_batch / batched): greedy, every output is checked against the
   target's own greedy decode of the same prompt (lossless); sampled (`--temperature`), drafts are
   verified by speculative sampling's rule (dflash_offline.sampling). Decode speed is measured
   against the target alone through the same decoder in one run. With `--reference` the outputs
   are checked against given greedy completions instead (the target-alone decode costs as much as
   the speculative one), and no speed-up is measured.
2. **Acceptance from the cache** (`--cache`; blocks.walk), without running the target: the
   *walk* over the blocks decoding would draft, and *random anchors* as in training; with
   `--parity`, both checked against real decoding of the same samples (evaluate.parity).

This module holds the command: its inputs read and checked before anything loads (prompts,
reference completions, drafters, the cache's target), the measurements run, and the report.

tau = new tokens committed by verify rounds / verify rounds, the reference's rule
(evaluate.speculative.summarize).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import NamedTuple


from dflash_offline.options import also, replaced, where
from dflash_offline.evaluate.config import AS_FLAGS, EvalConfig, Said
from dflash_offline.evaluate.inputs import (check_prompts_path, check_reference_path, read_prompts, read_reference,
                                            warn_chat_mismatch, chat_stop_ids)
from dflash_offline.blocks.walk import cache_acceptance, walk_acceptance
from dflash_offline.cache.location import Location
from dflash_offline.cache.manifest import ManifestStore
from dflash_offline.cache.view import ManifestView
from dflash_offline.evaluate.ceiling import (find_shape, format_implied, implied_speedup, load_shapes,
                                             verify_width_shape)
from dflash_offline.evaluate.report import Baseline, DecodeSetup, DrafterResult, EvalReport, Implied, format_report
from dflash_offline.evaluate.verdicts import Divergence
from dflash_offline.runs.checkpoint import CHECKPOINT_PREFIX, checkpoint_before, checkpoint_damage, load_checkpoint
from dflash_offline.runs.folder import is_run_folder
from dflash_offline.runtime.early_log import open_launcher_log
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.launch import check_devices_exist, parse_devices, single_thread_compute
from dflash_offline.runtime.logs import claim_heartbeat, log_dir_refusal
from dflash_offline.sampling import Sampling
from dflash_offline.runtime.paths import check_report_dest, require_kind
from dflash_offline.targets.folder import eos_ids, read_target
from dflash_offline.text import show_decoded, show_tokenizer

log = logging.getLogger("dflash.eval")
# eval's default --batch-size on a GPU: one prompt at a time leaves it idle (launch-bound rounds),
# and 64 rows of a 27B hybrid target (recurrent states in fp32 and their copy for rollback, about
# 0.3 GB a row; keys/values of 1K-token sequences with holes, about 0.13 GB) fit beside its 54 GB
# of bf16 weights on a 141 GB H200; out of memory, eval names the option.
GPU_BATCH_SIZE = 64


# ----------------------------------------------------------------------------------------------
# Inputs (evaluate/inputs.py reads and checks the prompt and reference files)

def load_drafter(path: str, target_dir: str, said: Said = AS_FLAGS):
    """A drafter from an export folder (config.json) or a training checkpoint (step-N/), with the
    target's frozen embedding and LM head; refuses a drafter made for another target shape."""
    from dflash_offline.drafter.export import EXPORT_WEIGHTS, load_exported

    root = Path(path)
    if root.is_file():
        raise UserError(f"{said('drafters')} {path}: a file, not a folder; give a drafter export folder (RUN/export, with "
                        "config.json + model.safetensors) or a checkpoint folder (RUN/step-N)")
    if not root.exists():
        raise UserError(f"{said('drafters')} {path}: no such folder; give a drafter export folder (RUN/export, with "
                        "config.json + model.safetensors) or a checkpoint folder (RUN/step-N)")
    checkpoint_files = ("state.json", "drafter.safetensors")
    found = [n for n in checkpoint_files if (root / n).is_file()]
    if found and (len(found) == len(checkpoint_files) or not (root / "config.json").is_file()):
        # A checkpoint, or one that lost a file: the damage named here with the checkpoint before it.
        what = checkpoint_damage(root, checkpoint_files)
        if what:
            before = checkpoint_before(root.absolute())
            other = (f"use the checkpoint before it, {root.parent / f'{CHECKPOINT_PREFIX}{before}'}"
                     if before is not None else "use another checkpoint or an export")
            raise UserError(f"{said('drafters')} {path}: {what}; the checkpoint is damaged: {other}, or restore the "
                            "file from a copy")
        drafter = load_checkpoint(str(root))
    elif (root / "config.json").is_file():
        what = checkpoint_damage(root, (EXPORT_WEIGHTS,))
        if what:
            raise UserError(f"{root}/{what}; the drafter export is damaged: export it again (dflash-offline export "
                            "--run RUN --to DIR) or restore the file from a copy")
        drafter = load_exported(str(root))
    elif (root / EXPORT_WEIGHTS).is_file():
        raise UserError(f"{said('drafters')} {path}: config.json: No such file or directory; the drafter export is "
                        "damaged: export it again (dflash-offline export --run RUN --to DIR) or restore the file from "
                        "a copy")
    else:
        raise UserError(f"{said('drafters')} {path}: neither a drafter export (config.json + model.safetensors) nor a "
                        "training checkpoint (step-N/ with state.json)")
    info = read_target(target_dir, said("target"))
    cfg = drafter.cfg
    if (cfg.hidden_size, cfg.vocab_size) != (info.hidden_size, info.vocab_size) or max(cfg.target_layer_ids) >= info.num_target_layers:
        raise UserError(f"{said('drafters')} {path} was made for a target with hidden {cfg.hidden_size}, vocabulary "
                        f"{cfg.vocab_size} and layers {cfg.target_layer_ids}; {said('target')} {target_dir} has hidden "
                        f"{info.hidden_size}, vocabulary {info.vocab_size}, {info.num_target_layers} layers")
    trained_for = cfg.target or {}
    differs = [k for k in ("weights_fingerprint", "config_sha256") if trained_for.get(k) not in (None, getattr(info, k))]
    if differs:
        log.warning("%s %s was trained for target %r (%s differs from %s %s): its acceptance here "
                    "says little about the target it was made for", said("drafters"), path, trained_for.get("name"), " and ".join(differs),
                    said("target"), target_dir)
    drafter.load_frozen_from_target(target_dir, said("target"))
    return drafter.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# The command


def _check_cache_target(cfg: EvalConfig) -> None:
    """--cache must hold the completions of --target, the model whose features it stores: another
    target's cache would score the drafter on features it never sees when serving."""
    cache, target, option = cfg.cache, cfg.target, where(cfg, "cache")
    try:
        m = ManifestStore(Location(cache, option)).read_committed()  # an edited one: before any decoding
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{option} {cache}: unreadable manifest ({type(e).__name__}: {e})") from None
    if m is None:
        raise UserError(f"{option} {cache}: no cache there (no manifest.json); extract the held-out completions into it")
    v = ManifestView.of(m)
    if v.status != "complete":  # an estimate over part of the data would pass for the whole
        raise UserError(f"{option} {cache}: extraction is not complete ({v.shards_committed}/{v.num_shards} shards "
                        "committed); run the same extract command again to finish it first")
    info = read_target(target, where(cfg, "target"))
    if m.get("target", {}).get("weights_fingerprint") != info.weights_fingerprint:
        raise UserError(f"{option} {cache} was extracted from another target than {where(cfg, 'target')} {target}; give the cache "
                        "of this target's completions (or the target the cache was made from)")


def _check_cache_layers(cfg: EvalConfig, drafters) -> None:
    """Every drafter reads layers --cache holds, and its shards are there, checked before any
    prompt decodes (the cache walk runs after the decoding)."""
    from dflash_offline.cache.reader import cache_reader, check_shards
    from dflash_offline.blocks.walk import cache_layer_columns

    reader = cache_reader(cfg.cache, where(cfg, "cache"))
    for _, d in drafters:
        cache_layer_columns(reader.manifest, d.cfg, cfg.cache, where(cfg, "cache"))
    # Its shards too (there and opening), as training checks its caches: not a crash mid-walk.
    check_shards(reader, f"{where(cfg, 'cache')} {cfg.cache}", "quick")


def log_folder(cfg: EvalConfig) -> Path:
    """--log-dir, else the logs/ of the training run the first drafter belongs to (a folder train
    made), else ./dflash-logs: eval never creates a folder beside a model someone put there."""
    if cfg.log_dir:
        return Path(cfg.log_dir)

    run = Path(cfg.drafters[0]).absolute().parent
    if is_run_folder(run):
        return run / "logs"
    return Path("dflash-logs").absolute()


def run(cfg: EvalConfig) -> EvalReport:
    cfg.validate()
    said = partial(where, cfg)
    require_kind(cfg.cache, said("cache"), True, "a cache folder (the one with manifest.json)")
    check_prompts_path(cfg.prompts, said)
    check_reference_path(cfg.reference, said)
    require_kind(cfg.json_path, said("json_path"), False, "a file name for the JSON report")
    check_report_dest(cfg.json_path, said("json_path"))
    if cfg.cache:
        _check_cache_target(cfg)
    if cfg.implied_for:
        find_shape(cfg.implied_for, option=said("implied_for"))  # an unknown name: one line now, not after the decoding
    try:  # in its folder once the inputs are checked (claim_heartbeat): a refusal leaves no log folder behind
        open_launcher_log(log_folder(cfg), "eval")
    except OSError as e:  # one line naming the folder, before any work
        if refusal := log_dir_refusal(cfg.log_dir, e, where(cfg, "log_dir")):
            raise refusal from None
        raise UserError(f"cannot write the log folder {log_folder(cfg)} ({e.strerror or e}); choose a writable "
                        "one with --log-dir") from None
    devices = parse_devices(cfg.devices, said("devices"))
    if len(devices) != 1:
        raise UserError(f"{where(cfg, 'devices')} {cfg.devices}: eval runs on one device (e.g. 0 or cpu); give one")
    device = devices[0]
    check_devices_exist(devices, said("devices"))
    import torch

    single_thread_compute()
    drafters = [(p, load_drafter(p, cfg.target, said)) for p in cfg.drafters]  # all refused before any decoding
    if cfg.prompts:
        warn_chat_mismatch(cfg.prompts, drafters)
    dspark = [str(p) for p, d in drafters if d.cfg.method == "dspark"]
    if dspark and cfg.parity:
        raise UserError(f"{said('parity')}: the parity check decodes DFlash blocks; {dspark[0]} is a DSpark drafter "
                        f"(its slots draft one token further, through a Markov head): leave {said('parity')} out")
    if cfg.cache:
        _check_cache_layers(cfg, drafters)
        widest = max(d.cfg.block_size for _, d in drafters)
        if cfg.seq_len <= widest:
            raise UserError(f"{where(cfg, 'seq_len')} {cfg.seq_len} must exceed the drafter's block size ({widest}): "
                            "the cache estimate's rows hold an anchor and its drafted tokens; raise it")
    report = EvalReport(target=str(Path(cfg.target).absolute()), device=device, dtype=cfg.dtype,
                        torch=torch.__version__, drafters=[DrafterResult(str(p), d.cfg.block_size) for p, d in drafters])
    if cfg.prompts:
        report.decode, report.baseline, report.drafters = _decode_all(cfg, drafters, device)
    if cfg.cache:
        report.cache = str(cfg.cache)
        for (path, d), result in zip(drafters, report.drafters):
            result.cache_walk, result.cache_estimate, result.parity = _cache_figures(cfg, path, d, device)
    if cfg.implied_for and cfg.prompts:
        for (_, d), result in zip(drafters, report.drafters):
            result.implied = _implied(cfg, d, result)
    print(format_report(report), flush=True)
    if cfg.json_path:
        tmp = Path(f"{cfg.json_path}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(report.to_json(), indent=1) + "\n")
        os.replace(tmp, cfg.json_path)  # whole or not at all
        print(f"json: {cfg.json_path}")
    return report


def _decode_all(cfg: EvalConfig, drafters, device: str) -> tuple[DecodeSetup, Baseline | None, list[DrafterResult]]:
    """The prompts through the target alone (when asked for, or needed as the reference) and through
    each drafter: the set-up, the baseline, each drafter's result."""
    # Here, not at the top: the command's log opens before torch is imported (cli.py; tests/test_layout.py).
    from dflash_offline.evaluate.decoders import Decoders
    from dflash_offline.evaluate.speculative import load_target_for_decoding

    if cfg.batch_size is None:
        cfg = replaced(cfg, batch_size=GPU_BATCH_SIZE if device.startswith("cuda") else 1)

    said = partial(where, cfg)
    ids, prompts, eos, turn_warning, reference = _read_inputs(cfg)
    tok = show_tokenizer(cfg.target, cfg.show)  # --show: the target's tokenizer.json, or one line now
    # With a reference the target-alone decode (as long as the speculative one) is needed only for
    # the speed-up figure, so it runs only when asked for.
    baseline = cfg.baseline if cfg.baseline is not None else not cfg.reference
    model, info = load_target_for_decoding(cfg.target, device, cfg.dtype)
    log.info("decoding %d prompts, up to %d new tokens, eos %s, %s on %s", len(prompts), cfg.max_new_tokens,
             sorted(eos), cfg.dtype, device)
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.seed, cfg.top_k)
    decoders = Decoders(model, cfg.decoder, cfg.batch_size, max(len(p) for p in prompts), cfg.max_new_tokens, eos,
                        sampling, device, cfg.dtype, said)
    decoders.check_drafters([(str(p), d) for p, d in drafters])  # before the baseline's decoding
    claim_heartbeat()  # the inputs are checked, the decoding starts: the log goes to its folder
    if not eos and not cfg.ignore_eos:  # after the refusals: a warning line must not precede an error line
        log.warning("%s %s names no end-of-sequence id (generation_config.json, config.json, tokenizer files): "
                    "every decode runs to %s %d", where(cfg, "target"), cfg.target, where(cfg, "max_new_tokens"),
                    cfg.max_new_tokens)
    if turn_warning:
        log.warning("%s", turn_warning)
    setup = DecodeSetup(prompts=str(cfg.prompts), num_prompts=len(prompts), max_new_tokens=cfg.max_new_tokens,
                        eos=sorted(eos), hybrid_target=info.hybrid, prompt_ids=ids,
                        lossless_against=None if cfg.temperature > 0 else str(cfg.reference) if cfg.reference
                        else ("baseline" if baseline else None),
                        decoder=decoders.name, decoding=decoders.describe, batch_size=cfg.batch_size, sampling=sampling)
    log.info("decoder: %s; %s", decoders.describe,
             "greedy" if sampling.greedy else f"sampling {dataclasses.asdict(sampling)}")
    alone = None
    if baseline:
        alone, reference = _decode_baseline(cfg, decoders, prompts, ids, reference, sampling.greedy)
    results = [_decode_drafter(cfg, decoders, path, drafter, prompts, ids, alone, reference, tok)
               for path, drafter in drafters]
    return setup, alone, results


def _every(prompts: list) -> int:
    """Also in the log, every tenth of the prompts: a long decode without a progress bar
    (--no-progress, a batch job) still shows how far it got."""
    return max(1, len(prompts) // 10)


def _decode_baseline(cfg: EvalConfig, decoders, prompts, ids, reference, greedy: bool) -> tuple[Baseline, list | None]:
    """The target alone through the same decoder and batches: a like-for-like speed-up. Returns its
    figures and the reference the drafters are checked against (its outputs, when greedy and none
    was given)."""
    from tqdm import tqdm

    from dflash_offline.evaluate.speculative import Decoded, summarize, tokens_per_s

    every = _every(prompts)
    bar = tqdm(total=len(prompts), desc="target alone", unit="prompt", disable=not cfg.progress)
    done_alone: list[Decoded] = []

    def alone_progress(new: list[Decoded]) -> None:
        done_alone.extend(new)
        bar.update(len(new))
        if len(done_alone) % every < len(new) or len(done_alone) == len(prompts):
            log.info("target alone: %d/%d prompts, %.1f tokens/s", len(done_alone), len(prompts),
                     tokens_per_s(done_alone))

    with batch_fits(cfg, decoders.device):
        runs = decoders.target_alone(prompts, ids, alone_progress)
    bar.close()
    s = summarize(runs, 2)
    alone = Baseline(tokens=s.tokens, seconds=s.seconds, tokens_per_s=s.tokens_per_s, target_forwards=s.target_forwards)
    if reference is None and greedy:
        return alone, [r.tokens for r in runs]
    if reference is not None:
        # Both given: a baseline that differs from the reference says the reference is not this
        # target's greedy decode in this dtype, rather than the drafter path being wrong.
        alone.mismatched_reference_ids = [ids[k] for k, (r, ref) in enumerate(zip(runs, reference)) if r.tokens != ref]
    return alone, reference


def _decode_drafter(cfg: EvalConfig, decoders, path, drafter, prompts, ids, alone: Baseline | None, reference,
                    tok) -> DrafterResult:
    """One drafter's speculative decode of every prompt: its figures, checked against the reference."""
    from tqdm import tqdm

    from dflash_offline.evaluate.speculative import Decoded, summarize

    every = _every(prompts)
    bar = tqdm(total=len(prompts), desc=f"speculative {Path(path).name}", unit="prompt", disable=not cfg.progress)
    done: list[Decoded] = []

    def progress(new: list[Decoded]) -> None:
        done.extend(new)
        tau = sum(sum(r.committed) for r in done) / max(1, sum(len(r.committed) for r in done))
        bar.update(len(new))
        bar.set_postfix_str(f"tau {tau:.2f}")
        if len(done) % every < len(new) or len(done) == len(prompts):
            log.info("speculative %s: %d/%d prompts, tau so far %.3f", path, len(done), len(prompts), tau)

    with batch_fits(cfg, decoders.device):
        runs = decoders.speculative(drafter, prompts, ids, progress)
    bar.close()
    dec = summarize(runs, drafter.cfg.block_size + drafter.cfg.label_offset)  # DSpark drafts B a round
    e = DrafterResult(str(path), drafter.cfg.block_size, decode=dec, accepted_per_prompt=[r.accepted for r in runs],
                      committed_per_prompt=[r.committed for r in runs])
    show_decoded(tok, path, ids, prompts, runs, cfg.show)  # --show N: where the drafter was right, as text
    if alone is not None:
        e.speedup = dec.tokens_per_s / alone.tokens_per_s
    if reference is not None:
        bad = [ids[k] for k, (r, ref) in enumerate(zip(runs, reference)) if r.tokens != ref]
        e.lossless, e.mismatched_prompt_ids = not bad, bad
        if bad:
            log.error("%s: %d of %d outputs differ from the target's greedy decode%s (ids %s)", path, len(bad),
                      len(runs), f" in {cfg.reference}" if cfg.reference else "", bad[:10])
            e.divergences = _forensics(cfg, decoders, prompts, ids, runs, reference)
    log.info("%s: tau %.3f over %d rounds, %.1f tokens/s", path, dec.tau, dec.rounds, dec.tokens_per_s)
    return e


def _forensics(cfg: EvalConfig, decoders, prompts, ids, runs, reference) -> list[Divergence]:
    """Where each differing output parts from the reference, and why: in the report and the log."""
    from dflash_offline.evaluate.forensics import diagnose_all

    found = diagnose_all(decoders.model, prompts, ids, [r.tokens for r in runs], reference, cfg.dtype, decoders.describe,
                         "file" if cfg.reference else "baseline")
    for d in found:
        log.error("%s", d.line())
    return found


def _cache_figures(cfg: EvalConfig, path, d, device: str) -> tuple[dict, dict, dict | None]:
    """A drafter's figures on the cache: the walk, the random-block estimate, and --parity's check."""
    walk = walk_acceptance(cfg.cache, d, device, cfg.max_samples, batch_rows=cfg.walk_batch_rows,
                           option=where(cfg, "cache"))
    # After the first walk: a cache with nothing to walk is refused in one line, and a refusal
    # leaves no log folder behind (the walk reads the samples that say so).
    claim_heartbeat()
    log.info("cache walk for %s: tau %.3f pooled, %.3f per-prompt mean, over %d rounds of %d samples (%.1fs)",
             path, walk["tau_pooled"], walk["tau_per_prompt_mean"], walk["rounds"], walk["samples"], walk["seconds"])
    t0 = time.time()
    est = cache_acceptance(cfg.cache, d, device, cfg.seq_len, cfg.num_anchors, cfg.max_rows, option=where(cfg, "cache"))
    log.info("cache estimate for %s: tau %.3f over %d random blocks (%.1fs)", path, est["tau"], est["blocks"],
             time.time() - t0)
    parity = None
    if cfg.parity:
        from dflash_offline.evaluate.parity import check_parity

        parity = check_parity(cfg.target, d, cfg.cache, cfg.parity, device, cfg.dtype)
    return walk, est, parity


def _implied(cfg: EvalConfig, d, result: DrafterResult) -> Implied | None:
    """--implied-for: the speed-up a drafter's decoded tau implies at a named shape's measured kernel
    times; a DSpark drafter's rounds verify B + 1 tokens and are priced so (verify_width_shape)."""
    shape = find_shape(cfg.implied_for)
    tau = result.decode.tau if result.decode is not None else float("nan")
    if not tau >= 1:
        return None
    block = d.cfg.block_size
    if d.cfg.method == "dspark" and block == shape.block_size:
        shape = verify_width_shape(shape, block + 1, load_shapes(), where(cfg, "implied_for"))
        block = shape.block_size
    return Implied(shape.name, implied_speedup(min(tau, shape.block_size), shape), format_implied(tau, shape, block))


class EvalInputs(NamedTuple):
    ids: list[int]  # the prompts' ids, in their order
    prompts: list[list[int]]
    eos: set[int]  # the end-of-sequence ids (a chat template's end of turn included)
    turn_warning: str | None
    reference: list[list[int]] | None  # --reference: the target's greedy outputs, in the prompts' order


def _read_inputs(cfg: EvalConfig) -> EvalInputs:
    """The prompts, end-of-sequence ids and reference outputs, checked before the target loads: a
    bad prompt or reference file costs nothing."""
    tinfo = read_target(cfg.target, where(cfg, "target"))
    said = partial(where, cfg)
    ids, prompts = read_prompts(cfg.prompts, tinfo.vocab_size, cfg.max_prompts, said)
    longest = max(range(len(prompts)), key=lambda k: len(prompts[k]))
    if tinfo.max_positions is not None and len(prompts[longest]) + cfg.max_new_tokens > tinfo.max_positions:
        raise UserError(f"{where(cfg, 'prompts')} {cfg.prompts}: row {longest}: a prompt of {len(prompts[longest])} "
                        f"tokens + {also(cfg, 'max_new_tokens')} {cfg.max_new_tokens} exceeds the target's context "
                        f"({tinfo.max_positions} positions); lower the new tokens or leave out the longest prompts")
    eos, turn_warning = chat_stop_ids(cfg.prompts, cfg.target, set() if cfg.ignore_eos else eos_ids(cfg.target),
                                      f"{where(cfg, 'max_new_tokens')} {cfg.max_new_tokens}")
    reference = (read_reference(cfg.reference, ids, prompts, cfg.max_new_tokens, eos, said, vocab_size=tinfo.vocab_size,
                                greedy=cfg.temperature == 0) if cfg.reference else None)
    return EvalInputs(ids, prompts, eos, turn_warning, reference)


@contextmanager
def batch_fits(cfg: EvalConfig, device: str):
    """A batch that runs out of device memory is a setting to change, not a crash to read."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError:
        raise UserError(f"{where(cfg, 'batch_size')} {cfg.batch_size}: a batch of that many prompts (cache: the "
                        f"longest prompt + {cfg.max_new_tokens} new tokens + drafted blocks per row) does not fit in "
                        f"the memory of {device}; lower --batch-size") from None
