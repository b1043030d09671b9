"""`dflash-offline demo`: the main job end to end on an embedded default, on the CPU in minutes.

A tiny dense Qwen3 target (random weights) and learnable data (arithmetic progressions) are made
on the fly; then extract -> verify the cache -> train a 2-layer drafter -> export. The options
match `stages/tiny/extract.toml` and `stages/tiny/train.toml`.
"""

from __future__ import annotations

from pathlib import Path

from .config import ExtractConfig, TrainConfig


def run(out: str, devices: str = "cpu") -> None:
    root = Path(out)
    target = root / "tiny-target"
    data = root / "tiny-data.parquet"
    if not (target / "config.json").exists():
        from .tiny import make_tiny_target

        make_tiny_target(target, kind="qwen3", num_layers=8)
    if not data.exists():
        from .tiny import make_tiny_data

        make_tiny_data(data, rows=256, min_len=40, max_len=256, pattern="arith")
    from . import extract

    cache = root / "cache"
    extract.run(ExtractConfig(target=str(target), data=[str(data)], cache=str(cache), devices=devices,
                              topk=8, max_len=256, batch_tokens=2048, shard_tokens=8192))
    from .cache.reader import CacheReader

    reader = CacheReader(str(cache))
    bad = reader.verify()
    print(f"verified {len(reader.shard_names)} shards against their checksums: "
          f"{'all match' if not bad else 'MISMATCH in ' + ', '.join(bad)}")
    if bad:
        raise RuntimeError(f"checksum mismatch in {bad}")
    from . import train

    run_dir = root / "train"
    train.run(TrainConfig(cache=str(cache), target=str(target), out=str(run_dir), devices=devices.split(",")[0],
                          num_layers=2, block_size=8, num_anchors=16, seq_len=256, global_batch_tokens=512,
                          lr=3e-3, epochs=3, mask_token_id=1, loader_workers=0, checkpoint_every=50))
    print(f"target:  {target}\ndata:    {data}\ncache:   {cache} (logs in {cache / 'logs'})\n"
          f"run:     {run_dir} (metrics.jsonl, step-N/ checkpoints, logs/)\nexport:  {run_dir / 'export'}")
