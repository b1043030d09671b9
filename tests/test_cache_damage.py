"""Damaged caches and the folders next to them, met through the real command line: each is one line
(what is wrong, where, how to fix it), exit 2, never a traceback or a library's exception; nothing
the tool did not write is deleted. Every damaged input is built for real: a copy of the session's
cache (made by `extract`) with manifest.json edited or a chunk byte flipped, real `prepare` and
`generate` outputs."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import _chat
from conftest import extract_args, run_cli, tree_digest

FIX = "restore manifest.json from a copy, or extract into a new --cache"
READERS = (["verify"], ["inspect", "--no-stats"], ["status"])


def _copy(valid_cache: Path, tmp_path: Path, name: str = "cache") -> Path:
    cache = tmp_path / name
    shutil.copytree(valid_cache, cache)
    return cache


class _Whole:
    """What an edit returns to replace the whole manifest (an edit's other return values, such as
    what dict.pop gives back, are ignored: it changed the manifest in place)."""

    def __init__(self, value):
        self.value = value


def _edited(valid_cache: Path, tmp_path: Path, edit) -> Path:
    """A copy of the session's cache whose manifest.json `edit` changed in place (or replaced: _Whole)."""
    cache = _copy(valid_cache, tmp_path)
    m = json.loads((cache / "manifest.json").read_text())
    got = edit(m)
    (cache / "manifest.json").write_text(json.dumps(got.value if isinstance(got, _Whole) else m))
    return cache


def _refused(args, line: str) -> None:
    """The command exits 2 having printed exactly `error: line` and nothing else."""
    r = run_cli(args)
    assert (r.returncode, r.stderr, r.stdout) == (2, f"error: {line}\n", ""), (args, r.returncode, r.stderr, r.stdout)


def _set_shard(key, value):
    def edit(m):
        m["shards"][0][key] = value
    return edit


# ----------------------------------------------------------------------------------------------
# 3, 4: every reader refuses a damaged manifest by one shared check, naming the key


DAMAGED = {
    "format": (lambda m: m.update(format="something/else"), None),
    "status": (lambda m: m.update(status="weird"), 'status is "weird", not "extracting" or "complete"'),
    "hidden-dtype": (lambda m: m["capture"].update(hidden_dtype="int3"),
                     'capture.hidden_dtype is "int3", not "bfloat16" or "float8_e4m3fn"'),
    "topk": (lambda m: m["capture"].update(topk=-4), "capture.topk is -4, not an integer >= 0"),
    "ids-reversed": (_set_shard("sample_ids", [[10, 2]]), "shards[0] (shard-000000): sample_ids holds [10, 2], not an id "
                     "range [first, last] with 0 <= first <= last <= 9223372036854775807"),
    "ids-past-int64": (_set_shard("sample_ids", [[2 ** 63, 2 ** 63]]), "shards[0] (shard-000000): sample_ids holds "
                       "[9223372036854775808, 9223372036854775808], not an id range [first, last] with 0 <= first <= "
                       "last <= 9223372036854775807"),
    "ids-negative": (_set_shard("sample_ids", [[-1, 3]]), "shards[0] (shard-000000): sample_ids holds [-1, 3], not an "
                     "id range [first, last] with 0 <= first <= last <= 9223372036854775807"),
    "ids-unsorted": (_set_shard("sample_ids", [[5, 6], [1, 2]]),
                     "shards[0] (shard-000000): sample_ids is not sorted ([1, 2] follows [5, 6])"),
    "name-a-path": (_set_shard("name", "../../../etc"), "shards[0] is named \"../../../etc\", not a shard name "
                    "(letters, digits, '.', '_' and '-', not a path)"),
    "checksum-form": (_set_shard("checksum", "md5:abc"),
                      'shards[0] (shard-000000): checksum is "md5:abc", not crc32c: or sha256: and 64 hex digits'),
    "tokens-negative": (_set_shard("tokens", -5), "shards[0] (shard-000000): tokens is -5, not an integer >= 0"),
    "releasing-a-path": (lambda m: m.update(releasing=["../x"]), 'releasing is not a list of shard names (it holds '
                         '["../x"])'),
    # 4: a missing key is named
    "no-shards": (lambda m: m.pop("shards"), "no shards"),
    "no-status": (lambda m: m.pop("status"), "no status"),
    "no-version": (lambda m: m.pop("version"), "no version"),
    "shard-no-name": (lambda m: m["shards"][0].pop("name"), "shards[0] has no name"),
    "shard-no-checksum": (lambda m: m["shards"][0].pop("checksum"), "shards[0] (shard-000000) lacks integer samples, "
                          "tokens, bytes, a checksum or its sample_ids: no checksum"),
    "shard-no-sample-ids": (lambda m: m["shards"][0].pop("sample_ids"), "shards[0] (shard-000000) lacks integer "
                            "samples, tokens, bytes, a checksum or its sample_ids: no sample_ids"),
    "shard-bytes-text": (_set_shard("bytes", "lots"), 'shards[0] (shard-000000) lacks integer samples, tokens, bytes, '
                         'a checksum or its sample_ids: bytes is "lots"'),
    "capture-no-hidden-dtype": (lambda m: m["capture"].pop("hidden_dtype"), "capture has no hidden_dtype"),
    "a-list": (lambda m: _Whole([]), "the file holds a list, not an object"),
    "version-text": (lambda m: m.update(version="1"), 'version is "1", not 1'),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_manifest_is_one_line_naming_the_key(valid_cache, tmp_path, case):
    edit, says = DAMAGED[case]
    cache = _edited(valid_cache, tmp_path, edit)
    before = tree_digest(cache)
    url = f"{cache}/manifest.json"
    if case == "format":
        line = (f'{url}: not a dflash-offline cache manifest (format "something/else", not "dflash-offline/cache"): '
                f"damaged or another program's file; {FIX}")
    else:
        line = f"{url}: damaged or not a dflash-offline manifest ({says}); {FIX}"
    for cmd in READERS:
        _refused([*cmd, cache], line)
    assert tree_digest(cache) == before  # nothing written, nothing deleted


def test_a_newer_version_says_so(valid_cache, tmp_path):
    cache = _edited(valid_cache, tmp_path, lambda m: m.update(version=99))
    line = (f"{cache}/manifest.json: cache format version 99 but this tool writes 1: the cache was written by a newer "
            "dflash-offline; upgrade dflash-offline to read it, or extract into a new --cache (see "
            "docs/cache-format.md)")
    for cmd in READERS:
        _refused([*cmd, cache], line)


def test_a_shard_name_that_is_a_path_is_never_followed(valid_cache, tmp_path):
    """`inspect` with its statistics (which read shard data) refuses before opening any shard."""
    outside = tmp_path / "outside.zarr"
    shutil.copytree(valid_cache / "shards" / "shard-000000.zarr", outside)
    cache = _edited(valid_cache, tmp_path, _set_shard("name", "../../outside"))
    r = run_cli(["inspect", cache])
    assert r.returncode == 2 and r.stderr.startswith(f"error: {cache}/manifest.json: damaged") and not r.stdout, r


def test_nan_in_the_manifest_is_not_json(valid_cache, tmp_path):
    cache = _copy(valid_cache, tmp_path)
    text = (cache / "manifest.json").read_text()
    m = json.loads(text)
    (cache / "manifest.json").write_text(text.replace(f'"tokens":{m["plan"]["tokens"]}', '"tokens":NaN', 1))
    assert "NaN" in (cache / "manifest.json").read_text()
    line = f"{cache}/manifest.json: not valid JSON (NaN is not a JSON number); the cache is damaged: {FIX}"
    for cmd in READERS:
        _refused([*cmd, cache], line)


# ----------------------------------------------------------------------------------------------
# 2: manifest.json that is a folder, a cache path that is a device


def test_manifest_json_that_is_a_folder(valid_cache, tmp_path):
    cache = _copy(valid_cache, tmp_path)
    (cache / "manifest.json").unlink()
    (cache / "manifest.json").mkdir()
    line = (f"{cache}/manifest.json: a folder, not the manifest file; damaged or not a dflash-offline cache: {FIX}")
    for cmd in READERS:
        _refused([*cmd, cache], line)
    assert (cache / "manifest.json").is_dir()


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_a_device_is_not_a_cache_folder():
    what = "a cache folder (the one with manifest.json)"
    for cmd in ("verify", "inspect"):
        _refused([cmd, "/dev/null"], f"{cmd} /dev/null: not a folder (a device, a socket or a broken link); give {what}")
    _refused(["status", "/dev/null"], f"status /dev/null: not a folder (a device, a socket or a broken link); give "
             f"{what}, a training run folder (OUT of train), a generate or a prepare output folder")


def test_a_cache_path_through_a_device_is_one_line():
    """The library's reader too (notebooks: open_cache), not only the commands' path checks."""
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.runtime.errors import UserError

    with pytest.raises(UserError, match=r"^/dev/null: not a folder; give a cache folder \(the one with manifest.json\)$"):
        CacheReader("/dev/null")


# ----------------------------------------------------------------------------------------------
# 5: a chunk whose bytes changed


def _flip_chunks(shard: Path, array: str) -> None:
    """Flip the first byte of every chunk file of one array (its CRC32C no longer matches)."""
    for f in sorted((shard / array / "c").rglob("*")):
        if f.is_file():
            b = bytearray(f.read_bytes())
            b[0] ^= 0xFF
            f.write_bytes(bytes(b))


def test_a_tampered_chunk_is_a_damaged_shard_in_one_line(valid_cache, tmp_path):
    cache = _copy(valid_cache, tmp_path)
    m = json.loads((cache / "manifest.json").read_text())
    entry = m["shards"][1]
    name, sample_id = entry["name"], entry["sample_ids"][0][0]
    _flip_chunks(cache / "shards" / f"{name}.zarr", "hidden")
    verify = f"run `dflash-offline verify {cache}` to find every damaged shard and how to re-make it, or extract into a new cache"
    crc = "a chunk of its data fails its CRC32C check: its bytes changed on storage"
    _refused(["inspect", cache, "--no-stats", "--sample", sample_id],
             f"{cache}: shard {name} is damaged, sample {sample_id} cannot be read ({crc}); {verify}")
    # The statistics read every sample of a cache this small: the damaged shard is met there too.
    _refused(["inspect", cache], f"{cache}: shard {name} is damaged, the per-layer statistics cannot be computed "
             f"({crc}); {verify}")
    # A sample of an intact shard still reads.
    other = m["shards"][0]["sample_ids"][0][0]
    r = run_cli(["inspect", cache, "--no-stats", "--sample", other])
    assert r.returncode == 0 and f"sample {other} (shard-000000)" in r.stdout, r.stderr
    r = run_cli(["verify", cache])
    assert r.returncode == 1 and f"damaged: {name}: unreadable" in r.stderr, r.stderr


def test_a_missing_chunk_file_is_a_damaged_shard(valid_cache, tmp_path):
    cache = _copy(valid_cache, tmp_path)
    m = json.loads((cache / "manifest.json").read_text())
    entry = m["shards"][0]
    chunks = sorted(f for f in (cache / "shards" / "shard-000000.zarr" / "hidden" / "c").rglob("*") if f.is_file())
    chunks[0].unlink()
    sample_id = entry["sample_ids"][0][0]
    _refused(["inspect", cache, "--no-stats", "--sample", sample_id],
             f"{cache}: shard shard-000000 is damaged, sample {sample_id} cannot be read (hidden: 1 of its "
             f"{len(chunks)} chunk files are missing); run `dflash-offline verify {cache}` to find every damaged shard "
             "and how to re-make it, or extract into a new cache")


# ----------------------------------------------------------------------------------------------
# 6: a shard folder that holds something extract did not write is not debris


def test_only_what_zarr_writes_is_shard_debris(valid_cache, tmp_path):
    from dflash_offline.cache.debris import foreign_in_shards

    cache = tmp_path / "c"
    shutil.copytree(valid_cache / "shards" / "shard-000000.zarr", cache / "shards" / "tmp-shard-000003.zarr")
    shutil.copytree(valid_cache / "shards" / "shard-000001.zarr", cache / "shards" / "shard-000001.zarr")
    # An unfinished Zarr write leaves NAME.<32 hex>.partial files: debris as well.
    (cache / "shards" / "shard-000001.zarr" / "zarr.0123456789abcdef0123456789abcdef.partial").write_bytes(b"{")
    (cache / "shards" / "shard-000001.zarr" / "hidden" / "c" / "0.0123456789abcdef0123456789abcdef.partial").write_bytes(b"")
    assert foreign_in_shards(str(cache)) is None
    (cache / "shards" / "shard-000001.zarr" / "hidden" / "notes.txt").write_text("mine")
    assert foreign_in_shards(str(cache)) == "shards/shard-000001.zarr/hidden/notes.txt"
    assert foreign_in_shards(str(cache), committed={"shard-000001"}) is None  # committed: not debris, not looked at
    (cache / "shards" / "shard-000001.zarr" / "hidden" / "notes.txt").unlink()
    (cache / "shards" / "tmp-shard-000003.zarr" / "link").symlink_to(tmp_path)
    assert foreign_in_shards(str(cache)) == "shards/tmp-shard-000003.zarr/link"
    (cache / "shards" / "tmp-shard-000003.zarr" / "link").unlink()
    (cache / "shards" / "README").write_text("mine")
    assert foreign_in_shards(str(cache)) == "shards/README"
    assert foreign_in_shards(str(cache), committed=set()) is None  # beside a manifest: names outside the plan stay


def test_a_user_file_in_a_shard_folder_is_never_deleted(tiny_dense, tiny_data, valid_cache, tmp_path):
    cache = tmp_path / "cache"
    shard = cache / "shards" / "shard-000000.zarr"
    shutil.copytree(valid_cache / "shards" / "shard-000000.zarr", shard)
    (shard / "mydata").write_text("not extract's")
    before = tree_digest(cache / "shards")
    bad = "shards/shard-000000.zarr/mydata"
    _refused(extract_args(tiny_dense, tiny_data, cache),
             f"--cache {cache}: the folder exists, is not empty and is not a cache (no manifest.json; it holds {bad}, "
             f"which extract does not write); choose a new or empty folder, or move {bad} out of it (nothing is "
             "overwritten)")
    assert tree_digest(cache / "shards") == before and (shard / "mydata").read_text() == "not extract's"
    assert not (cache / "manifest.json").exists()


def test_a_user_file_in_an_uncommitted_shard_folder_of_a_cache_is_never_deleted(tiny_dense, tiny_data, valid_cache,
                                                                                tmp_path):
    """A resume deletes the folders of shards the manifest does not list (a killed run's): one that
    holds something else is refused, the manifest and every file unchanged."""
    def uncommit_first(m):
        m["shards"] = m["shards"][1:]
        m["status"] = "extracting"
        m.pop("completed", None)
        m["totals"] = {k: sum(s[k] for s in m["shards"]) for k in ("samples", "tokens", "bytes")}

    cache = _edited(valid_cache, tmp_path, uncommit_first)
    (cache / "shards" / "shard-000000.zarr" / "mydata").write_text("not extract's")
    before = tree_digest(cache)
    bad = "shards/shard-000000.zarr/mydata"
    _refused(extract_args(tiny_dense, tiny_data, cache),
             f"--cache {cache}: {bad} was not written by extract (an uncommitted shard folder holds only Zarr metadata "
             "and chunks), and resuming would delete it as debris of an interrupted run; move it out of the cache "
             "(nothing was changed)")
    assert tree_digest(cache) == before


def test_debris_of_a_killed_first_run_is_still_removed(tiny_dense, tiny_data, valid_cache, tmp_path):
    """What Zarr writes, and only that, is debris: a first run's leftover shard folders do not stop
    the next run, which writes the cache as if they had never been there."""
    cache = tmp_path / "cache"
    shutil.copytree(valid_cache / "shards" / "shard-000000.zarr", cache / "shards" / "tmp-shard-000000.zarr")
    shutil.copytree(valid_cache / "shards" / "shard-000001.zarr", cache / "shards" / "shard-000001.zarr")
    r = run_cli(extract_args(tiny_dense, tiny_data, cache))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((cache / "manifest.json").read_text())["status"] == "complete"
    assert not (cache / "shards" / "tmp-shard-000000.zarr").exists()
    assert run_cli(["verify", cache]).returncode == 0


# ----------------------------------------------------------------------------------------------
# 1: status of a prepare output


@pytest.fixture(scope="module")
def prepared(tiny_dense, tmp_path_factory) -> Path:
    """A real `prepare` output with both splits (training rows kept, 30% held out)."""
    top = tmp_path_factory.mktemp("prepared")
    target = _chat.make_chat_target(tiny_dense, top / "target")
    rng = random.Random(0)
    data = _chat.write_jsonl(top / "chats.jsonl", [{"id": i, "messages": _chat.random_conversation(rng)}
                                                    for i in range(24)])
    out = top / "out"
    r = run_cli(["prepare", "--target", target, "--data", data, "--out", out, "--responses", "keep",
                 "--eval-fraction", "0.3", "--max-len", "100000", "--no-progress"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "train" / "manifest.json").is_file() and (out / "eval" / "manifest.json").is_file()
    return out


def _split_line(folder: Path) -> str:
    m = json.loads((folder / "manifest.json").read_text())
    t = m["totals"]
    return (f"  {m['plan']['split']}: {len(m['parts'])}/{m['plan']['num_parts']} parts committed: "
            f"{t['conversations']} conversations -> {t['rows']} training rows, {t['tokens']} tokens "
            f"({t['trained_tokens']} trained, {t['truncated']} rows truncated) ({folder})")


def test_status_of_a_prepare_output(prepared):
    m = json.loads((prepared / "train" / "manifest.json").read_text())
    dropped = dict(m["counts"]["dropped"])
    for split in ("train", "eval"):
        for part in json.loads((prepared / split / "manifest.json").read_text())["parts"]:
            for why, n in part["dropped"].items():
                dropped[why] = dropped.get(why, 0) + n
    read = f"  {m['counts']['records_read']} records read; dropped: " + (
        ", ".join(f"{n} {why}" for why, n in sorted(dropped.items(), key=lambda kv: -kv[1])) or "none")
    r = run_cli(["status", prepared])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:4] == [f"prepared {prepared}: complete", _split_line(prepared / "train"),
                         _split_line(prepared / "eval"), read], r.stdout
    assert lines[4].startswith("  prepare ") and " done; phase done" in lines[4], r.stdout
    assert lines[-1] == "  last error: none", r.stdout
    # One split folder: that split, with the run's process and last error from OUT/logs.
    r = run_cli(["status", prepared / "train"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:2] == [f"prepared {prepared / 'train'}: complete", _split_line(prepared / "train")], r.stdout
    assert lines[-1] == "  last error: none", r.stdout
    st = json.loads(run_cli(["status", prepared, "--json"]).stdout)
    assert st["kind"] == "prepare" and st["status"] == "complete" and list(st["splits"]) == ["train", "eval"], st
    assert st["splits"]["train"]["totals"] == m["totals"] and st["splits"]["train"]["kind"] == "completions", st
    st = json.loads(run_cli(["status", prepared / "eval", "--json"]).stdout)
    assert st["kind"] == "prepare" and list(st["splits"]) == ["eval"], st


def test_status_of_a_folder_holding_a_prepare_output(prepared, valid_cache, tmp_path):
    top = tmp_path / "top"
    top.mkdir()
    (top / "cache").symlink_to(valid_cache)
    (top / "prepared").symlink_to(prepared)
    r = run_cli(["status", top])
    assert r.returncode == 0, r.stderr
    blocks = r.stdout.rstrip("\n").split("\n\n")
    assert [b.splitlines()[0].split(":")[0] for b in blocks] == [f"cache {top}/cache", f"prepared {top}/prepared"]
    sts = json.loads(run_cli(["status", top, "--json"]).stdout)
    assert [(st["kind"], st["path"]) for st in sts] == [("cache", f"{top}/cache"), ("prepare", f"{top}/prepared")]


def test_inspect_of_a_prepare_output_says_what_it_is(prepared):
    _refused(["inspect", prepared / "train"], f"{prepared / 'train'}: a prepare output (rows for `generate --prompts` "
             f"or `extract --data`, as Parquet parts), not a cache; see `dflash-offline status {prepared / 'train'}`")


# ----------------------------------------------------------------------------------------------
# 7: a later success supersedes an earlier error in `status`


def test_a_success_after_a_failed_run_clears_the_last_error(tiny_dense, tmp_path):
    rng = np.random.default_rng(0)
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": pa.array(np.arange(100, 104), pa.int64()),
                             "input_ids": pa.array([rng.integers(2, 512, size=6).tolist() for _ in range(4)],
                                                   pa.list_(pa.int32()))}), prompts)
    out = tmp_path / "gen"
    args = ["generate", "--target", tiny_dense, "--prompts", prompts, "--out", out, "--no-progress",
            "--ignore-eos"]
    # A run that fails once its part is committed: the failure is the last thing that happened there.
    r = run_cli([*args, "--max-new-tokens", "6"], env={"DFLASH_OFFLINE_RAISE_AT": "part-committed:1"})
    assert r.returncode == 1 and "injected failure at part-committed" in r.stderr, r.stderr
    st = json.loads(run_cli(["status", out, "--json"]).stdout)
    assert st["verdict"] == "complete" and "InjectedFault" in st["last_error"]["error"], st
    # A rerun refused in its preflight writes nothing there (not even a log line): still the failure.
    before = tree_digest(out, exclude=())
    r = run_cli([*args, "--max-new-tokens", "7"])
    assert r.returncode == 2 and "settings.max_new_tokens" in r.stderr, r.stderr
    assert tree_digest(out, exclude=()) == before
    r = run_cli([*args, "--max-new-tokens", "6"])
    assert r.returncode == 0 and "already complete" in r.stdout, r.stderr[-3000:]
    st = json.loads(run_cli(["status", out, "--json"]).stdout)
    assert st["last_error"] is None, st
    r = run_cli(["status", out])
    assert r.returncode == 0 and r.stdout.rstrip("\n").splitlines()[-1] == "  last error: none", r.stdout
