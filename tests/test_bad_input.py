"""Bad input to `dflash-offline extract` is refused before any work: exit code 2, exactly one line on
stderr (`error: ...`) that names the problem (file and row for data, the field for a mismatching
cache), an existing valid cache left byte for byte as it was (logs/ aside), and no shard folder
created anywhere.

Each case runs the command twice, in parallel: pointed at the session's valid cache, and (for
problems that do not depend on an existing cache) at a fresh cache location.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli, tree_digest

VOCAB = 512  # dflash_offline.tiny.TINY_VOCAB

# --------------------------------------------------------------------------------------------
# Writing bad Parquet files


def ilist(rows, t=pa.int32()):
    return pa.array(rows, type=pa.list_(t))


def good_rows(n: int, seed: int = 0, lo: int = 6, hi: int = 16):
    """n short rows of valid token ids (never longer than --max-len) and matching loss masks."""
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(n):
        t = int(rng.integers(lo, hi + 1))
        ids.append(rng.integers(2, VOCAB, size=t).tolist())
        p = t // 2
        masks.append([0] * p + [1] * (t - p))
    return ids, masks


def write_parquet(path: Path, row_group_size: int | None = None, **columns) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


# --------------------------------------------------------------------------------------------
# Cases


@dataclass
class Bad:
    """What a case changes in the command, and the substrings its one error line must contain."""

    expect: list[str]
    opts: dict = field(default_factory=dict)  # replaces base options: --name value (a list repeats it)
    extra: list = field(default_factory=list)  # appended arguments


@dataclass
class Setup:
    tmp: Path
    fx: Callable[[str], object]  # request.getfixturevalue


# -- data ------------------------------------------------------------------------------------


def missing_input_ids(s: Setup) -> Bad:
    ids, masks = good_rows(4)
    f = write_parquet(s.tmp / "no-input-ids.parquet", tokens=ilist(ids), loss_mask=ilist(masks, pa.int8()),
                      id=pa.array(range(4), pa.int64()))
    return Bad(opts={"data": [f]}, expect=["no-input-ids.parquet", "missing column 'input_ids'"])


def no_mask_column(s: Setup) -> Bad:
    ids, _ = good_rows(4)
    f = write_parquet(s.tmp / "no-mask.parquet", input_ids=ilist(ids), id=pa.array(range(4), pa.int64()))
    return Bad(opts={"data": [f]}, expect=["no-mask.parquet", "'loss_mask'", "'prompt_len'"])


def loss_mask_length_mismatch(s: Setup) -> Bad:
    ids, masks = good_rows(6)
    masks[3] = masks[3][:-2]  # row 3 sits in the second row group: its number must be file-global
    f = write_parquet(s.tmp / "mask-len.parquet", row_group_size=2, input_ids=ilist(ids),
                      loss_mask=ilist(masks, pa.int8()))
    return Bad(opts={"data": [f]},
               expect=["mask-len.parquet", "row 3", f"loss_mask has {len(ids[3]) - 2} entries", f"input_ids has {len(ids[3])}"])


def token_out_of_vocab(s: Setup) -> Bad:
    ids, masks = good_rows(6)
    ids[3][4] = VOCAB
    f = write_parquet(s.tmp / "oov.parquet", row_group_size=2, input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()))
    return Bad(opts={"data": [f]}, expect=["oov.parquet", "row 3", f"token id {VOCAB}", "vocabulary"])


def negative_token(s: Setup) -> Bad:
    ids, masks = good_rows(4)
    ids[1][0] = -5
    f = write_parquet(s.tmp / "negative-token.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()))
    return Bad(opts={"data": [f]}, expect=["negative-token.parquet", "row 1", "token id -5"])


def empty_row(s: Setup) -> Bad:
    ids, masks = good_rows(4)
    ids[2], masks[2] = [], []
    f = write_parquet(s.tmp / "empty-row.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()))
    return Bad(opts={"data": [f]}, expect=["empty-row.parquet", "row 2", "empty"])


def input_ids_not_integers(s: Setup) -> Bad:
    ids, masks = good_rows(4)
    f = write_parquet(s.tmp / "float-ids.parquet", input_ids=ilist([[float(x) for x in r] for r in ids], pa.float32()),
                      loss_mask=ilist(masks, pa.int8()))
    return Bad(opts={"data": [f]}, expect=["float-ids.parquet", "'input_ids'", "list of integers"])


def loss_mask_values(s: Setup) -> Bad:
    ids, masks = good_rows(4)
    masks[2][-1] = 2
    f = write_parquet(s.tmp / "mask-values.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()))
    return Bad(opts={"data": [f]}, expect=["mask-values.parquet", "loss_mask", "row 2"])


def not_parquet(s: Setup) -> Bad:
    f = s.tmp / "not-parquet.parquet"
    f.write_bytes(b"input_ids,loss_mask\n1 2 3,0 1 1\n")
    return Bad(opts={"data": [f]}, expect=["not-parquet.parquet", "not a readable Parquet file"])


def conversations_not_prepared(s: Setup) -> Bad:
    f = s.tmp / "chats.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    return Bad(opts={"data": [f]}, expect=["chats.jsonl", "not a readable Parquet file", "dflash-offline prepare"])


def truncated_parquet(s: Setup) -> Bad:
    ids, masks = good_rows(8)
    f = write_parquet(s.tmp / "truncated.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()))
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])
    return Bad(opts={"data": [f]}, expect=["truncated.parquet", "not a readable Parquet file"])


def data_missing(s: Setup) -> Bad:
    f = s.tmp / "does-not-exist.parquet"
    return Bad(opts={"data": [f]}, expect=["does-not-exist.parquet", "no such file"])


def data_folder_empty(s: Setup) -> Bad:
    d = s.tmp / "empty-folder"
    d.mkdir()
    (d / "notes.txt").write_text("no parquet here\n")
    return Bad(opts={"data": [d]}, expect=["empty-folder", "no *.parquet"])


def duplicate_ids_across_files(s: Setup) -> Bad:
    ids, masks = good_rows(4, seed=1)
    a = write_parquet(s.tmp / "part-a.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()),
                      id=pa.array([0, 1, 2, 3], pa.int64()))
    ids, masks = good_rows(4, seed=2)
    b = write_parquet(s.tmp / "part-b.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()),
                      id=pa.array([3, 4, 5, 6], pa.int64()))
    return Bad(opts={"data": [a, b]}, expect=["id 3", "part-a.parquet row 3", "part-b.parquet row 0", "unique"])


def prompt_len_too_long(s: Setup) -> Bad:
    ids, _ = good_rows(4)
    pl = [len(r) // 2 for r in ids]
    pl[2] = 99
    f = write_parquet(s.tmp / "prompt-len.parquet", input_ids=ilist(ids), prompt_len=pa.array(pl, pa.int64()))
    return Bad(opts={"data": [f]}, expect=["prompt-len.parquet", "row 2", "prompt_len 99", f"[0, {len(ids[2])}]"])


def negative_row_id(s: Setup) -> Bad:
    ids, masks = good_rows(4)
    f = write_parquet(s.tmp / "negative-id.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()),
                      id=pa.array([0, -1, 2, 3], pa.int64()))
    return Bad(opts={"data": [f]}, expect=["negative-id.parquet", "row 1", "id -1"])


# -- target, layers, devices, options ---------------------------------------------------------


def target_without_config(s: Setup) -> Bad:
    d = s.tmp / "target-no-config"
    d.mkdir()
    shutil.copy(Path(s.fx("tiny_dense")) / "model.safetensors", d)
    return Bad(opts={"target": d}, expect=["target-no-config", "no config.json"])


def target_without_weights(s: Setup) -> Bad:
    d = s.tmp / "target-no-weights"
    d.mkdir()
    shutil.copy(Path(s.fx("tiny_dense")) / "config.json", d)
    return Bad(opts={"target": d}, expect=["target-no-weights", "no *.safetensors"])


def target_zero_layers(s: Setup) -> Bad:
    d = s.tmp / "target-no-layers"
    shutil.copytree(Path(s.fx("tiny_dense")), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 0
    (d / "config.json").write_text(json.dumps(cfg))
    return Bad(opts={"target": d}, expect=["target-no-layers", "num_hidden_layers is 0", "no decoder layers"])


def target_weights_without_layers(s: Setup) -> Bad:
    """config.json says 8 decoder layers; the weights hold only the embedding and the head."""
    from safetensors.numpy import load_file, save_file

    d = s.tmp / "target-no-layer-weights"
    d.mkdir()
    shutil.copy(Path(s.fx("tiny_dense")) / "config.json", d)
    w = load_file(str(Path(s.fx("tiny_dense")) / "model.safetensors"))
    save_file({k: v for k, v in w.items() if ".layers." not in k}, str(d / "model.safetensors"))
    return Bad(opts={"target": d}, expect=["target-no-layer-weights", "no tensor for model.layers.0."])


def layer_out_of_range(s: Setup) -> Bad:
    return Bad(opts={"capture-layers": "1,3,8"}, expect=["--capture-layers", "layer 8 does not exist", "0..7"])


def missing_gpu(s: Setup) -> Bad:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 3:
        pytest.skip("this machine has a CUDA device 3")
    return Bad(opts={"devices": "3"}, expect=["--devices", "GPU 3", "--devices cpu"])


def bad_devices_spec(s: Setup) -> Bad:
    return Bad(opts={"devices": "gpu0"}, expect=["--devices", "'gpu0'", "not a GPU index"])


def max_bytes_too_small(s: Setup) -> Bad:
    # The budget bounds the cache on storage (workers pause while it is full), so only a budget
    # that cannot hold the largest shard is refused.
    per_token = 5 * 64 * 2 + 4 * 6 + 5  # 5 default layers x hidden 64 in bf16 + top-4 + ids + mask
    return Bad(opts={"max-bytes": "1000"},
               expect=["--max-bytes 1.00 kB cannot hold one shard", f"x {per_token} bytes/token", "--shard-tokens"])


def batch_tokens_below_max_len(s: Setup) -> Bad:
    return Bad(opts={"batch-tokens": "64"}, expect=["--batch-tokens 64", "--max-len 128"])


def config_unknown_key(s: Setup) -> Bad:
    f = s.tmp / "recipe-typo.toml"
    f.write_text('topk = 4\ntokp = 8\n')
    return Bad(extra=["--config", f], expect=["--config", "recipe-typo.toml", "unknown key 'tokp'"])


def config_not_toml(s: Setup) -> Bad:
    f = s.tmp / "recipe-broken.toml"
    f.write_text('topk = [4\n')
    return Bad(extra=["--config", f], expect=["--config", "recipe-broken.toml", "not valid TOML"])


# -- an existing cache made with other settings ------------------------------------------------


def other_topk(s: Setup) -> Bad:
    return Bad(opts={"topk": "8"}, expect=["capture.topk", "= 4", "8"])


def other_layers(s: Setup) -> Bad:
    return Bad(opts={"capture-layers": "1,3,5"}, expect=["capture.layer_ids", "[1, 2, 3, 4, 5]", "[1, 3, 5]"])


def other_max_len(s: Setup) -> Bad:
    return Bad(opts={"max-len": "256"}, expect=["capture.max_len", "128", "256"])


def other_max_len_truncating(s: Setup) -> Bad:
    return Bad(opts={"max-len": "100"}, expect=["capture.max_len", "128", "100"])


def other_shard_tokens(s: Setup) -> Bad:
    return Bad(opts={"shard-tokens": "2048"}, expect=["plan.shard_tokens", "1024", "2048"])


def other_target_config(s: Setup) -> Bad:
    return Bad(opts={"target": s.fx("target_other_config")}, expect=["target.config_sha256"])


def other_target_weight_dtype(s: Setup) -> Bad:
    return Bad(opts={"target": s.fx("target_fp16_weights")}, expect=["target.weights_fingerprint"])


def other_target_seed(s: Setup) -> Bad:
    return Bad(opts={"target": s.fx("target_other_seed")}, expect=["target.weights_fingerprint"])


def other_data_rows(s: Setup) -> Bad:
    from dflash_offline.tiny import make_tiny_data

    f = make_tiny_data(s.tmp / "fewer-rows.parquet", rows=40, max_len=120)
    return Bad(opts={"data": [f]}, expect=["source.rows", "48", "40"])


def other_data_content(s: Setup) -> Bad:
    from dflash_offline.tiny import make_tiny_data

    f = make_tiny_data(s.tmp / "other-content.parquet", rows=48, max_len=120, seed=1)
    return Bad(opts={"data": [f]}, expect=["source.files"])


def max_len_cuts_every_completion(s: Setup) -> Bad:
    rng = np.random.default_rng(0)
    ids = [rng.integers(2, VOCAB, size=30).tolist() for _ in range(4)]
    masks = [[0] * 20 + [1] * 10 for _ in range(4)]  # every completion starts at position 20
    f = write_parquet(s.tmp / "long-prompts.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()))
    return Bad(opts={"data": [f], "max-len": "16"},
               expect=["--max-len 16", "cuts every row's completion away", "position 20"])


def rows_past_the_target_context(s: Setup) -> Bad:
    ids, masks = good_rows(4)
    ids[2] = np.random.default_rng(1).integers(2, VOCAB, size=1100).tolist()  # tiny targets: 1024 positions
    masks[2] = [0] * 100 + [1] * 1000
    f = write_parquet(s.tmp / "past-context.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()))
    return Bad(opts={"data": [f], "max-len": "2048", "batch-tokens": "2048"},
               expect=["1 rows are longer than the target's context (1024 positions", "1100 tokens",
                       "past-context.parquet row 2", "--max-len 1024"])


def generated_by_another_target(s: Setup) -> Bad:
    """A generate folder (its manifest, written as generate writes it) whose completions another
    model wrote: the target's weights fingerprint differs."""
    from dflash_offline.rows.parts import FORMAT, VERSION

    ids, masks = good_rows(4)
    d = s.tmp / "generated"
    write_parquet(d / "part-00000.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()),
                  id=pa.array(range(4), pa.int64()))
    (d / "manifest.json").write_text(json.dumps({
        "format": FORMAT, "version": VERSION, "status": "complete", "chat": None,
        "target": {"path": "/models/another", "model_type": "qwen3", "vocab_size": VOCAB,
                   "weights_fingerprint": "0" * 64},
        "plan": {"num_parts": 1}, "parts": [{"name": "part-00000", "file": "part-00000.parquet"}]}))
    return Bad(opts={"data": [d]}, expect=["--data", "generated", "another model wrote", "/models/another",
                                           "*.parquet"])


# (id, build, also run against a fresh cache, marks)
CASES = [
    ("missing-input_ids", missing_input_ids, True, ()),
    ("no-loss_mask-or-prompt_len", no_mask_column, True, ()),
    ("loss_mask-length-mismatch", loss_mask_length_mismatch, True, ()),
    ("token-id-outside-vocab", token_out_of_vocab, True, ()),
    ("negative-token-id", negative_token, True, ()),
    ("empty-row", empty_row, True, ()),
    ("input_ids-not-integers", input_ids_not_integers, True, ()),
    ("loss_mask-values-not-0-1", loss_mask_values, True,
     ()),
    ("not-parquet", not_parquet, True, ()),
    ("conversations-not-prepared", conversations_not_prepared, True, ()),
    ("truncated-parquet", truncated_parquet, True, ()),
    ("data-path-missing", data_missing, True, ()),
    ("data-folder-without-parquet", data_folder_empty, True, ()),
    ("duplicate-ids-across-files", duplicate_ids_across_files, True, ()),
    ("prompt_len-beyond-row", prompt_len_too_long, True, ()),
    ("negative-row-id", negative_row_id, True,
     ()),
    ("max-len-cuts-every-completion", max_len_cuts_every_completion, True, ()),
    ("rows-past-the-target-context", rows_past_the_target_context, True, ()),
    ("generated-by-another-target", generated_by_another_target, True, ()),
    ("target-without-config", target_without_config, True, ()),
    ("target-without-safetensors", target_without_weights, True, ()),
    ("target-zero-decoder-layers", target_zero_layers, True, ()),
    ("target-weights-without-decoder-layers", target_weights_without_layers, True, ()),
    ("layer-out-of-range", layer_out_of_range, True, ()),
    ("devices-gpu-missing", missing_gpu, True, ()),
    ("devices-unparseable", bad_devices_spec, True, ()),
    ("max-bytes-too-small", max_bytes_too_small, True, ()),
    ("batch-tokens-below-max-len", batch_tokens_below_max_len, True, ()),
    ("config-unknown-key", config_unknown_key, True, ()),
    ("config-not-toml", config_not_toml, True, ()),
    ("cache-other-topk", other_topk, False, ()),
    ("cache-other-layers", other_layers, False, ()),
    ("cache-other-max-len", other_max_len, False, ()),
    ("cache-other-max-len-truncating", other_max_len_truncating, False,
     ()),
    ("cache-other-shard-tokens", other_shard_tokens, False, ()),
    ("cache-other-target-config", other_target_config, False, ()),
    ("cache-other-target-weights-dtype", other_target_weight_dtype, False, ()),
    ("cache-other-target-same-shapes-other-weights", other_target_seed, False,
     ()),
    ("cache-other-data-rows", other_data_rows, False, ()),
    ("cache-other-data-content", other_data_content, False, ()),
]


# --------------------------------------------------------------------------------------------
# Fixtures: other targets (each differs from tiny_dense in one identity field)


@pytest.fixture(scope="session")
def target_other_config(tmp_path_factory, tiny_dense) -> Path:
    """tiny_dense's weights with a config.json that differs in a value that changes no shape."""
    d = tmp_path_factory.mktemp("target-other-config") / "target"
    shutil.copytree(tiny_dense, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


@pytest.fixture(scope="session")
def target_fp16_weights(tmp_path_factory, tiny_dense) -> Path:
    """tiny_dense's config.json with its weights stored as float16 (other safetensors headers)."""
    from safetensors.numpy import load_file, save_file

    d = tmp_path_factory.mktemp("target-fp16") / "target"
    d.mkdir()
    shutil.copy(Path(tiny_dense) / "config.json", d)
    tensors = load_file(str(Path(tiny_dense) / "model.safetensors"))
    save_file({k: v.astype(np.float16) for k, v in tensors.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    return d


@pytest.fixture(scope="session")
def target_other_seed(tmp_path_factory) -> Path:
    """The same architecture as tiny_dense with other random weights (seed 1)."""
    from dflash_offline.tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("target-seed1") / "target", kind="qwen3", seed=1)


# --------------------------------------------------------------------------------------------
# The test


def tree_listing(path: Path, exclude=("logs",)) -> set[str]:
    """Every file and folder under `path` (relative), outside the excluded top-level folders."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(path):
        rel = Path(dirpath).relative_to(path)
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames if d not in exclude]
        out.update((rel / n).as_posix() for n in dirnames + filenames)
    return out


def build_args(base: dict, bad: Bad, cache: Path) -> list[str]:
    opts = {**base, **bad.opts, "cache": cache}
    args = ["extract"]
    for name, value in opts.items():
        for v in (value if isinstance(value, list) else [value]):
            args += [f"--{name}", str(v)]
    return args + ["--no-progress", *[str(a) for a in bad.extra]]


def assert_refused(r, bad: Bad, where: str) -> None:
    context = f"[{where}] rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 2, context
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr; {context}"
    line = lines[0]
    assert line.startswith("error:") and line[len("error:"):].strip(), context
    for s in bad.expect:
        assert s in line, f"{s!r} not in the error line {line!r}"
    assert r.stdout.strip() == "", context


@pytest.mark.parametrize(
    "build,fresh", [pytest.param(b, f, id=i, marks=m) for i, b, f, m in CASES]
)
def test_bad_input_is_refused(build, fresh, tmp_path, request, tiny_dense, tiny_data, valid_cache):
    bad = build(Setup(tmp=tmp_path, fx=request.getfixturevalue))
    base = {"target": tiny_dense, "data": [tiny_data], "devices": "cpu", "topk": "4", "max-len": "128",
            "batch-tokens": "512", "shard-tokens": "1024"}
    fresh_cache = tmp_path / "fresh-cache"

    before, listing = tree_digest(valid_cache), tree_listing(valid_cache)
    with ThreadPoolExecutor(2) as pool:
        on_valid = pool.submit(run_cli, build_args(base, bad, valid_cache), timeout=120)
        on_fresh = pool.submit(run_cli, build_args(base, bad, fresh_cache), timeout=120) if fresh else None
        r_valid = on_valid.result()
        r_fresh = on_fresh.result() if on_fresh else None

    # The existing cache: byte for byte as it was, no new file or folder (logs/ aside).
    assert tree_digest(valid_cache) == before
    assert tree_listing(valid_cache) == listing
    assert_refused(r_valid, bad, "existing cache")

    if r_fresh is not None:
        assert_refused(r_fresh, bad, "fresh cache")
        # Nothing but (possibly) the process logs: no manifest, no shards/ folder.
        left = set(os.listdir(fresh_cache)) if fresh_cache.exists() else set()
        assert left <= {"logs"}, f"a refused run left {sorted(left)} in a fresh cache"


def test_same_command_on_complete_cache_changes_nothing(tiny_dense, tiny_data, valid_cache):
    """The control: the command that made the cache, run again, succeeds and leaves it unchanged."""
    from conftest import extract_args

    before, listing = tree_digest(valid_cache), tree_listing(valid_cache)
    r = run_cli(extract_args(tiny_dense, tiny_data, valid_cache), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cache: complete" in r.stdout
    assert tree_digest(valid_cache) == before
    assert tree_listing(valid_cache) == listing


def test_weight_shape_mismatch_refused_before_workers(tiny_dense, tiny_data, tmp_path):
    """A checkpoint whose tensors do not fit its config.json is refused in preflight, in one line,
    naming the tensor, before any worker loads weights."""
    import json as _json
    import shutil as _shutil

    bad = tmp_path / "bad-target"
    _shutil.copytree(tiny_dense, bad)
    cfg = _json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    (bad / "config.json").write_text(_json.dumps(cfg))
    cache = tmp_path / "cache"
    r = run_cli(["extract", "--target", str(bad), "--data", str(tiny_data), "--cache", str(cache), "--topk", "0"])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "mlp" in r.stderr and "implies" in r.stderr
    assert not (cache / "logs" / "extract-rank0.log").exists()  # no worker started


# --------------------------------------------------------------------------------------------
# Cases that need a cache location of their own


@pytest.mark.parametrize("damage", ["not-json", "no-shards-field"])
def test_corrupted_manifest_is_refused_and_left_alone(damage, tiny_dense, tiny_data, valid_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(valid_cache, cache)
    m = (cache / "manifest.json").read_text()
    (cache / "manifest.json").write_text(m[: len(m) // 2] if damage == "not-json"
                                         else json.dumps({k: v for k, v in json.loads(m).items() if k != "shards"}))
    before, listing = tree_digest(cache), tree_listing(cache)
    from conftest import extract_args

    for args in (extract_args(tiny_dense, tiny_data, cache), ["verify", cache], ["inspect", cache]):
        r = run_cli(args, timeout=120)
        assert_refused(r, Bad(expect=["manifest.json", "restore manifest.json from a copy"]), f"{damage} {args[0]}")
    assert tree_digest(cache) == before and tree_listing(cache) == listing


def test_unwritable_cache_location_is_refused(tiny_dense, tiny_data, tmp_path):
    """A --cache below a regular file (root ignores permission bits, so a mode would not do)."""
    from conftest import extract_args

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = run_cli(extract_args(tiny_dense, tiny_data, blocker / "cache"), timeout=120)
    assert_refused(r, Bad(expect=["--cache", "a-file/cache", "cannot write there", "a-file is not a folder",
                                  "choose a writable location"]), "cache")
    r = run_cli(extract_args(tiny_dense, tiny_data, tmp_path / "cache", "--log-dir", blocker / "logs"), timeout=120)
    assert_refused(r, Bad(expect=["--log-dir", "a-file/logs", "cannot write the log folder there"]), "log folder")
    assert not (tmp_path / "cache").exists()
    assert blocker.read_text() == "not a folder"


def test_over_long_rows_are_truncated_with_one_warning(tiny_dense, tiny_data, tmp_path):
    """Rows longer than --max-len are kept, cut to their first --max-len tokens, with one warning."""
    from conftest import extract_args

    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.rows.reader import scan

    cache = tmp_path / "cache"
    r = run_cli(extract_args(tiny_dense, tiny_data, cache, "--max-len", "64"), timeout=300)
    assert r.returncode == 0, r.stderr
    lengths = scan([str(tiny_data)], VOCAB).lengths
    n_long = int((lengths > 64).sum())
    assert n_long > 0
    assert r.stderr.strip().splitlines() == [
        f"warning: {n_long} of {len(lengths)} samples are longer than --max-len 64 and are truncated"]
    got = {s.sample_id: len(s.input_ids) for s in CacheReader(str(cache)).samples()}
    assert max(got.values()) == 64 and len(got) == len(lengths)


def test_rows_whose_completion_max_len_cuts_away_are_counted(tiny_dense, tmp_path):
    """Rows cut by --max-len before their completion starts are kept (their prompts are context),
    and the warning says how many keep nothing to train on."""
    from conftest import extract_args

    rng = np.random.default_rng(0)
    ids = [rng.integers(2, VOCAB, size=n).tolist() for n in (30, 30, 12, 12)]
    masks = [[0] * 20 + [1] * 10, [0] * 20 + [1] * 10, [0] * 6 + [1] * 6, [0] * 6 + [1] * 6]
    f = write_parquet(tmp_path / "mixed.parquet", input_ids=ilist(ids), loss_mask=ilist(masks, pa.int8()))
    r = run_cli(extract_args(tiny_dense, f, tmp_path / "cache", "--max-len", "16"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == [
        "warning: 2 of 4 samples are longer than --max-len 16 and are truncated; 2 of them keep no token to train "
        "on (their completions start past it)"]


TRAIN_OPTS = ["--seq-len", "128", "--num-anchors", "8", "--block-size", "8", "--global-batch-tokens", "128",
              "--drafter-layers", "1", "--loader-workers", "0", "--no-progress", "--epochs", "1"]


def train_no_mask_token(s: Setup, out: Path) -> tuple[list, Bad]:
    return ["--out", out], Bad(expect=["declares no mask token", "--mask-token-id"])


def train_other_target(s: Setup, out: Path) -> tuple[list, Bad]:
    from dflash_offline.tiny import make_tiny_target

    other = make_tiny_target(s.tmp / "other-target", kind="qwen3", seed=5)
    return ["--out", out, "--target", other, "--mask-token-id", "1"], Bad(expect=["another target"])


def train_out_unwritable(s: Setup, out: Path) -> tuple[list, Bad]:
    blocker = s.tmp / "a-file"
    blocker.write_text("x")
    return ["--out", blocker / "run", "--mask-token-id", "1"], Bad(expect=["--out", "cannot write its log folder"])


def train_mask_token_out_of_vocab(s: Setup, out: Path) -> tuple[list, Bad]:
    return ["--out", out, "--mask-token-id", str(VOCAB)], Bad(expect=["--mask-token-id", str(VOCAB)])


def train_step_rounded_then_too_big(s: Setup, out: Path) -> tuple[list, Bad]:
    # --global-batch-tokens is rounded to whole rows (a warning) and then needs more rows than the
    # cache has (the refusal): the refusal is the one line.
    return (["--out", out, "--mask-token-id", "1", "--global-batch-tokens", "100000"],
            Bad(expect=["fewer than one step needs"]))


@pytest.mark.parametrize("build", [train_no_mask_token, train_other_target, train_out_unwritable,
                                   train_mask_token_out_of_vocab, train_step_rounded_then_too_big],
                         ids=["no-mask-token", "cache-from-other-target", "out-unwritable", "mask-token-out-of-vocab",
                              "step-rounded-then-too-big"])
def test_train_bad_input_is_refused(build, tiny_dense, valid_cache, tmp_path, request):
    out = tmp_path / "run"
    extra, bad = build(Setup(tmp=tmp_path, fx=request.getfixturevalue), out)
    before = tree_digest(valid_cache)
    args = ["train", "--target", tiny_dense, "--cache", valid_cache, *TRAIN_OPTS, *extra]
    r = run_cli(args, timeout=120)
    assert_refused(r, bad, build.__name__)
    assert tree_digest(valid_cache) == before
    left = set(os.listdir(out)) if out.exists() else set()
    assert left <= {"logs"}, f"a refused run left {sorted(left)} in its run folder"
