"""`dflash-offline demo`: the main job end to end on an embedded default, on the CPU in seconds."""

from __future__ import annotations

from pathlib import Path

from .config import ExtractConfig


def run(out: str, devices: str = "cpu") -> None:
    root = Path(out)
    target = root / "tiny-target"
    data = root / "tiny-data.parquet"
    if not (target / "config.json").exists():
        from .tiny import make_tiny_target

        make_tiny_target(target, kind="qwen3", num_layers=8)
    if not data.exists():
        from .tiny import make_tiny_data

        make_tiny_data(data, rows=256, max_len=256)
    from . import extract

    cfg = ExtractConfig(target=str(target), data=[str(data)], cache=str(root / "cache"), devices=devices,
                        topk=8, max_len=256, batch_tokens=2048, shard_tokens=8192)
    extract.run(cfg)
    from .cache.reader import CacheReader

    reader = CacheReader(str(root / "cache"))
    bad = reader.verify()
    print(f"verified {len(reader.shard_names)} shards against their checksums: "
          f"{'all match' if not bad else 'MISMATCH in ' + ', '.join(bad)}")
    if bad:
        raise RuntimeError(f"checksum mismatch in {bad}")
