"""Cache read throughput against what the trainer consumes, and against one `torch.save` file per sample.

For each storage folder given (e.g. /dev/shm and a local disk), this script writes the same random
samples twice:

  zarr     a committed dflash-offline cache (ShardWriter: Zarr shards, chunks of 1024 tokens, CRC32C)
  per-file one `torch.save` file per sample holding input_ids, loss_mask and the hidden states as a
           [t, layers x hidden] bf16 tensor: the layout of the peers' offline pipelines

and reads them back in one run with the same number of loader processes:

  rows     the trainer's own path: `stream.RowStream` + DataLoader (packing, anchors, labels, the
           hidden rows of every packed sample): context tokens/s, the figure to compare with the
           trainer's consumption (11,784 context tokens/s on an H200 for the 27B drafter)
  zarr     every sample of the cache, sample by sample (`Shard` reads), GB/s
  per-file every file with `torch.load`, GB/s

Files on a disk are evicted from the page cache (posix_fadvise DONTNEED) after writing, so disk
reads come from the disk. A second part measures the cost per token and the loader's host memory as
the cache grows 10x (a narrow hidden size, so the large cache fits: what grows is the number of
samples and shards, which is what the reader's index scales with).

    python benchmarks/reader_throughput.py --storage /dev/shm/bench-read,/tmp/bench-read --out results.json
    python benchmarks/reader_throughput.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

TRAINER_CTX_TOKENS_PER_S = 11_784  # the 27B drafter on one H200 (fused loss), docs/benchmarks.md


def write_zarr_cache(root: Path, lengths: list[int], n: int, H: int, seed: int, per_shard: int = 16) -> None:

    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, new_manifest
    from dflash_offline.cache.shards import publish_shard, shard_name, tmp_shard_rel
    from dflash_offline.cache.writer import ShardLayout, ShardWriter

    shards = [lengths[i:i + per_shard] for i in range(0, len(lengths), per_shard)]
    loc = Location(str(root))
    store = ManifestStore(loc)
    store.init_or_check(new_manifest(target={"note": "synthetic", "model_type": "synthetic", "num_layers": n,
                                             "hidden_size": H, "vocab_size": 1 << 16}, capture={"layer_ids": list(range(n)), "topk": 0,
                                                                             "hidden_dtype": "bfloat16"},
                                     source={"files": [], "rows": len(lengths)},
                                     plan={"shard_tokens": 0, "sort_window": 0, "num_shards": len(shards)}))
    loc.makedirs("shards")
    sid = 0
    for j, lens in enumerate(shards):
        name = shard_name(j)
        w = ShardWriter(loc, tmp_shard_rel(name), ShardLayout(tokens=sum(lens), cache_layers=n, hidden_size=H, topk=0,
                                                              chunk_tokens=1024, layer_ids=list(range(n))))
        for t in lens:
            ids, mask, h = sample_data(sid, t, n, H, seed)
            w.append(sid, ids, mask, h, None, None)
            sid += 1
        publish_shard(store, w.close(name))


def sample_data(sid: int, t: int, n: int, H: int, seed: int):
    import numpy as np

    rng = np.random.default_rng([seed, sid])
    h = rng.integers(0, 1 << 16, size=(t, n, H), dtype=np.uint16)
    mask = np.ones(t, np.uint8)
    mask[: t // 4] = 0
    return rng.integers(0, 100_000, size=t).astype(np.int32), mask, h


def write_per_file(root: Path, lengths: list[int], n: int, H: int, seed: int) -> None:
    import torch

    root.mkdir(parents=True, exist_ok=True)
    for sid, t in enumerate(lengths):
        ids, mask, h = sample_data(sid, t, n, H, seed)
        torch.save({"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask),
                    "hidden_states": torch.from_numpy(h.reshape(t, n * H)).view(torch.bfloat16)},
                   root / f"data_{sid}.ckpt")


def evict(root: Path) -> None:
    """Drop the folder's files from the page cache (after fsync), so reads go to the device."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _Files:
    """Dataset over per-sample files (map-style, read by DataLoader workers like the peers do)."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        import torch

        d = torch.load(self.files[i], weights_only=True)
        return d["hidden_states"].numel() * 2


class _Samples:
    def __init__(self, cache: str, refs):
        self.cache, self.refs, self.reader = cache, refs, None

    def __len__(self):
        return len(self.refs)

    def __getitem__(self, i):
        from dflash_offline.cache.reader import CacheReader

        if self.reader is None:
            self.reader = CacheReader(self.cache)
        name, k = self.refs[i][:2]
        s = self.reader.shard(name).sample(k)
        return s.hidden_bits.nbytes


class _Direct:
    """Every sample's hidden states through cache.reader.ChunkFiles (the trainer's loader path)."""

    def __init__(self, cache: str, refs, lengths):
        self.cache, self.refs, self.lengths, self.files = cache, refs, lengths, None

    def __len__(self):
        return len(self.refs)

    def __getitem__(self, i):
        from dflash_offline.cache.location import Location
        from dflash_offline.cache.reader import ChunkFiles

        if self.files is None:
            self.files = ChunkFiles(Location(self.cache))
        name, _, a = self.refs[i]
        return self.files.read(name, "hidden", a, a + int(self.lengths[i])).nbytes


def read_loader(ds, workers: int) -> tuple[float, int]:
    import torch

    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, shuffle=False,
                                     multiprocessing_context="spawn" if workers else None,
                                     prefetch_factor=4 if workers else None)
    it = iter(dl)
    first = next(it)  # worker start-up is not reading
    t0 = time.perf_counter()
    total = sum(int(b) for b in it)
    return time.perf_counter() - t0, total + 0 * int(first)


def rows_throughput(cache: str, seq_len: int, num_anchors: int, workers: int, steps: int, via_zarr: bool = False) -> dict:
    """The trainer's loader path: RowStream rows for `steps` micro-batches; context tokens/s, and
    the peak resident memory of this process and its loader processes. `via_zarr`: refs without
    their first token, which makes RowStream read through Zarr (the path before ChunkFiles)."""
    import numpy as np

    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.blocks.stream import RowStream, Span, make_loader

    reader = CacheReader(cache)
    refs, lengths = [], []
    for name in reader.shard_names:
        sh = reader.shard(name)
        lengths.extend((sh.offsets[1:] - sh.offsets[:-1]).tolist())
        refs.extend((name, k) if via_zarr else (name, k, int(sh.offsets[k])) for k in range(len(sh)))
    n, H = len(reader.manifest["capture"]["layer_ids"]), int(reader.shard(reader.shard_names[0]).group["hidden"].shape[2])
    spec = {"seed": 0, "seq_len": seq_len, "num_anchors": num_anchors, "block_size": 16, "mask_token_id": 1,
            "gamma": 7.0, "hidden_size": H, "num_layers": n}
    stream = RowStream(cache, refs, np.asarray(lengths), spec, Span(0, 0, steps), 0, 1, 1)
    rows = len(stream.rows())
    steps = min(steps, rows)
    stream = RowStream(cache, refs, np.asarray(lengths), spec, Span(0, 0, steps), 0, 1, 1)
    it = iter(make_loader(stream, workers, 4, pin=False))
    next(it)
    t0 = time.perf_counter()
    got = 1
    for _ in it:
        got += 1
    dt = time.perf_counter() - t0
    rss = peak_rss_mb()
    return {"rows": got - 1, "seconds": dt, "context_tokens_per_s": (got - 1) * seq_len / dt,
            "GB_per_s_hidden": (got - 1) * seq_len * n * H * 2 / dt / 1e9, "samples": len(refs),
            "shards": len(reader.shard_names), **rss}


def peak_rss_mb() -> dict:
    import resource

    return {"peak_rss_mb_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_rss_mb_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storage", default="/dev/shm/dflash-bench-read", help="comma list of folders to test")
    ap.add_argument("--tokens", type=int, default=131072, help="tokens of the throughput part's cache")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--workers", type=int, default=3, help="loader processes (the trainer's default recipe uses 3)")
    ap.add_argument("--scale-tokens", type=int, default=1_000_000, help="1x cache of the scaling part (10x is also built)")
    ap.add_argument("--scale-hidden", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        import tempfile

        # the system's temporary space as TMPDIR names it (a test run's own folder), not a fixed /tmp path
        args.storage = os.path.join(tempfile.gettempdir(), "dflash-bench-read")
        args.tokens, args.layers, args.hidden = 8192, 2, 64
        args.seq_len, args.num_anchors, args.workers, args.scale_tokens, args.scale_hidden = 1024, 32, 0, 16384, 32

    import numpy as np

    res = {"args": vars(args), "storage": {}, "scaling": {}}

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))

    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < args.tokens:
        lengths.append(int(rng.integers(args.seq_len // 12, args.seq_len * 3 // 4)))
    for folder in args.storage.split(","):
        root = Path(folder)
        shutil.rmtree(root, ignore_errors=True)
        t0 = time.perf_counter()
        write_zarr_cache(root / "cache", lengths, args.layers, args.hidden, 0)
        t_zarr = time.perf_counter() - t0
        t0 = time.perf_counter()
        write_per_file(root / "files", lengths, args.layers, args.hidden, 0)
        t_files = time.perf_counter() - t0
        on_disk = not folder.startswith("/dev/shm")
        if on_disk:
            evict(root)
        from dflash_offline.cache.reader import CacheReader

        reader = CacheReader(str(root / "cache"))
        refs = [(n, k, int(reader.shard(n).offsets[k])) for n in reader.shard_names for k in range(len(reader.shard(n)))]
        r = {"tokens": sum(lengths), "samples": len(lengths), "write_s_zarr": t_zarr, "write_s_files": t_files}
        dt, nb = read_loader(_Samples(str(root / "cache"), refs), args.workers)
        r["zarr_samples_GB_per_s"] = nb / dt / 1e9
        if on_disk:
            evict(root)
        dt, nb = read_loader(_Direct(str(root / "cache"), refs, lengths), args.workers)
        r["direct_samples_GB_per_s"] = nb / dt / 1e9
        if on_disk:
            evict(root)
        files = sorted((root / "files").iterdir(), key=lambda p: int(p.stem.split("_")[1]))
        dt, nb = read_loader(_Files(files), args.workers)
        r["per_file_GB_per_s"] = nb / dt / 1e9
        if on_disk:
            evict(root)
        r["rows_zarr"] = rows_throughput(str(root / "cache"), args.seq_len, args.num_anchors, args.workers, 10**6, True)
        if on_disk:
            evict(root)
        r["rows"] = rows_throughput(str(root / "cache"), args.seq_len, args.num_anchors, args.workers, 10**6)
        r["rows_vs_trainer"] = r["rows"]["context_tokens_per_s"] / TRAINER_CTX_TOKENS_PER_S
        r["zarr_vs_per_file"] = r["zarr_samples_GB_per_s"] / r["per_file_GB_per_s"]
        r["direct_vs_per_file"] = r["direct_samples_GB_per_s"] / r["per_file_GB_per_s"]
        res["storage"][folder] = r
        save()
        print(f"{folder}: samples via Zarr {r['zarr_samples_GB_per_s']:.2f} GB/s, via chunk files "
              f"{r['direct_samples_GB_per_s']:.2f} GB/s, per-file torch.load {r['per_file_GB_per_s']:.2f} GB/s "
              f"(chunk files / torch.load {r['direct_vs_per_file']:.2f}x); trainer rows "
              f"{r['rows']['context_tokens_per_s']:,.0f} context tokens/s (via Zarr "
              f"{r['rows_zarr']['context_tokens_per_s']:,.0f}) = {r['rows_vs_trainer']:.1f}x what one H200 "
              f"trains on", flush=True)
        shutil.rmtree(root, ignore_errors=True)

    # Scaling: cost per token and host memory as the cache grows 10x.
    folder = Path(args.storage.split(",")[0]) / "scale"
    for mult in (1, 10):
        shutil.rmtree(folder, ignore_errors=True)
        lens = []
        r2 = np.random.default_rng(1)
        while sum(lens) < args.scale_tokens * mult:
            lens.append(int(r2.integers(args.seq_len // 12, args.seq_len * 3 // 4)))
        write_zarr_cache(folder, lens, 1, args.scale_hidden, 1, per_shard=64)
        steps = max(8, args.scale_tokens // args.seq_len // 2)  # the same number of rows at both sizes
        import subprocess

        # A fresh process per size, so peak RSS belongs to that size alone.
        for via_zarr in (False, True):
            code = ("import json,sys; sys.path.insert(0, %r); from benchmarks.reader_throughput import rows_throughput; "
                    "print(json.dumps(rows_throughput(%r, %d, %d, %d, %d, %r)))" % (
                        str(Path(__file__).resolve().parent.parent), str(folder), args.seq_len, args.num_anchors,
                        args.workers, steps, via_zarr))
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r["us_per_context_token"] = 1e6 / r["context_tokens_per_s"]
            path = "zarr" if via_zarr else "chunk files"
            res["scaling"][f"{mult}x" + ("-zarr" if via_zarr else "")] = r
            save()
            print(f"cache {mult}x ({r['samples']} samples, {r['shards']} shards), rows via {path}: "
                  f"{r['us_per_context_token']:.2f} us per context token, peak RSS {r['peak_rss_mb_self']:.0f} MB "
                  f"(trainer-side process), {r['peak_rss_mb_children']:.0f} MB (largest loader process)", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
