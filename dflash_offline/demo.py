"""`dflash-offline demo`: the whole job end to end on an embedded default, on the CPU in minutes.

1. a tiny dense Qwen3 target (8 layers, hidden 64, vocabulary 512) is built and trained for a
   few seconds on progression text (arithmetic progressions of stride 1-3 around a cycle of 32
   tokens), so that what it writes has structure; a random-weight target's output is noise that
   no drafter can predict, and a demo built on one would report a training tau that decoding
   never sees;
2. `generate`: the target completes 512 prompts (greedy, 64 new tokens): its own data;
3. `extract` -> `verify` -> `train` (a 2-layer drafter, block 8) -> `export`;
4. `eval --prompts`: real speculative decoding of 32 held-out prompts against the target,
   checked lossless, with the speed against the target alone.
Every stage writes where a user's run would, and running the demo again into the same --out
resumes or says that each stage is complete. The options match the recipes in `stages/tiny/`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dflash_offline.config import ExtractConfig, GenerateConfig
from dflash_offline.evaluate.config import EvalConfig
from dflash_offline.train.config import TrainConfig
from dflash_offline.runtime.errors import UserError
from dflash_offline.runtime.launch import check_devices_exist, parse_devices
from dflash_offline.train import launcher as train

TRAIN_PROMPTS, EVAL_PROMPTS, NEW_TOKENS = 512, 32, 64
MARK = ".dflash-demo"  # written first into a folder the demo makes or finds empty: "this folder is a demo's"


def claim_out(root: Path) -> None:
    """Check --out (_check_out) and mark it as a demo's."""
    _check_out(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARK).touch()


def _check_out(root: Path) -> None:
    """--out must be new, empty, or a demo's own folder: the demo writes files by fixed names, and a
    user's file of one of those names must never be replaced."""
    if root.exists() and not root.is_dir():
        raise UserError(f"--out {root}: exists and is not a folder; choose a new folder")
    if not root.is_dir() or (root / MARK).exists():
        return
    # Without the mark only an empty folder is the demo's: a folder holding files of the demo's names
    # (a model folder called tiny-target, a prompts-train.parquet) may well be the user's own.
    if any(root.iterdir()):
        raise UserError(f"--out {root}: the folder exists, is not empty and is not a demo's (no {MARK} in it); "
                        "choose a new or empty folder (nothing was changed)")


def run(out: str, devices: str = "cpu") -> dict:
    root = Path(out)
    _check_out(root)
    check_devices_exist(parse_devices(devices))  # before minutes of work, not after the target is trained
    claim_out(root)
    target = root / "tiny-target"
    if not (target / "config.json").exists():
        from dflash_offline.tiny import make_tiny_target, train_tiny_target

        tmp = root / ".tiny-target.tmp"  # renamed into place once trained: a killed demo leaves no half-trained target
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_target(tmp, kind="qwen3", num_target_layers=8)
        fit = train_tiny_target(tmp)
        tmp.rename(target)
        print(f"target:   trained a tiny Qwen3 ({target}) for {fit['steps']} steps on progression text in "
              f"{fit['seconds']:.0f} s (loss {fit['loss']:.3f})", flush=True)
    else:
        if not (target / "tokenizer.json").exists():  # a demo folder from before the tiny target had one
            from dflash_offline.tiny import save_tiny_tokenizer

            save_tiny_tokenizer(target)
        print(f"target:   {target} (trained earlier)", flush=True)
    prompts_train, prompts_eval = root / "prompts-train.parquet", root / "prompts-eval.parquet"
    if not prompts_eval.exists():
        from dflash_offline.tiny import make_progression_prompts

        make_progression_prompts(prompts_train, TRAIN_PROMPTS, seed=1)
        # Held out: prompts longer than any training prompt, so none is a training prompt.
        make_progression_prompts(prompts_eval, EVAL_PROMPTS, seed=2, min_len=21, max_len=28, id_offset=100_000)

    from dflash_offline.evaluate import run as evaluate
    from dflash_offline.extract import launcher as extract
    from dflash_offline.generate import launcher as generate

    generated, cache, run_dir = root / "generated", root / "cache", root / "train"
    generate.run(GenerateConfig(target=str(target), prompts=[str(prompts_train)], out=str(generated), devices=devices,
                                max_new_tokens=NEW_TOKENS, chunk_prompts=256, batch_tokens=128 * (20 + NEW_TOKENS),
                                ignore_eos=True))  # the tiny target has no end-of-sequence token: its lines run on
    extract.run(ExtractConfig(target=str(target), data=[str(generated)], cache=str(cache), devices=devices,
                              topk=8, max_len=256, batch_tokens=2048, shard_tokens=8192))
    from dflash_offline.cache.reader import CacheReader

    reader = CacheReader(str(cache))
    bad = reader.verify()
    print(f"verified {len(reader.shard_names)} shards against their checksums: "
          f"{'all match' if not bad else 'MISMATCH in ' + ', '.join(bad)}", flush=True)
    if bad:
        raise RuntimeError(f"checksum mismatch in {bad}")
    train.run(TrainConfig(cache=str(cache), target=str(target), out=str(run_dir), devices=devices.split(",")[0],
                          drafter_layers=2, block_size=8, num_anchors=16, seq_len=256, global_batch_tokens=512,
                          lr=3e-3, epochs=3, mask_token_id=1, loader_workers=0, checkpoint_every=50))
    export = run_dir / "export"
    report = evaluate.run(EvalConfig(target=str(target), drafters=[str(export)], prompts=str(prompts_eval),
                                     max_new_tokens=NEW_TOKENS, ignore_eos=True, json_path=str(root / "eval.json")))
    e = report.drafters[0]
    print(f"\ntarget:    {target}\nprompts:   {prompts_train} (training), {prompts_eval} (held out)\n"
          f"generated: {generated} (the target's own completions; logs in {generated / 'logs'})\n"
          f"cache:     {cache} (logs in {cache / 'logs'})\nrun:       {run_dir} (metrics.jsonl, step-N/ checkpoints, logs/)\n"
          f"export:    {export}\neval:      {root / 'eval.json'}\n"
          f"decoding:  tau {e.decode.tau:.2f} (pooled over {e.decode.rounds} rounds of {EVAL_PROMPTS} held-out prompts, "
          f"block {e.block_size}), {e.speedup:.2f}x the target alone on the CPU, "
          f"{'lossless' if e.lossless else 'NOT LOSSLESS'}", flush=True)
    first = reader.manifest["shards"][0]["sample_ids"][0][0]  # the first committed sample's id
    print(f"\nlook inside:\n"
          f"  what each stage did:  dflash-offline status {root}\n"
          f"  the cache:            dflash-offline inspect {cache}\n"
          f"  a sample as text:     dflash-offline inspect {cache} --sample {first} --text   (trained spans in [[ ]])\n"
          f"  a decode as text:     dflash-offline eval --target {target} --drafter {export} --prompts {prompts_eval} "
          f"--max-new-tokens {NEW_TOKENS} --ignore-eos --max-prompts 1 --show 1   (accepted drafts in {{{{ }}}})", flush=True)
    return report
