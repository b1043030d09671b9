"""Looking at caches and runs: the notebook API (`open_cache`, no torch), `inspect`, `status` of a
complete cache, a cache mid-extraction (running and killed) and a training run that crashed, and
docs/inspect.ipynb executed against a tiny cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, extract_args, run_cli, run_tree


def test_open_cache_reads_what_was_written(valid_cache, tiny_data):
    import pyarrow.parquet as pq
    import zarr

    from dflash_offline import open_cache

    cache = open_cache(str(valid_cache))
    m = json.loads((valid_cache / "manifest.json").read_text())
    shards = cache.shards
    assert list(shards["shard"]) == [s["name"] for s in m["shards"]]
    assert shards["samples"].sum() == m["totals"]["samples"] and shards["tokens"].sum() == m["totals"]["tokens"]
    src = pq.read_table(tiny_data).to_pydict()
    assert sorted(cache.sample_ids.tolist()) == sorted(src["id"])
    for sid in (0, 17, 47):
        s = cache.sample(sid)
        row = src["id"].index(sid)
        np.testing.assert_array_equal(s.input_ids, np.asarray(src["input_ids"][row][:128], np.int32))
        np.testing.assert_array_equal(s.loss_mask, np.asarray(src["loss_mask"][row][:128], np.uint8))
        # Hidden states: exactly the stored bf16 words widened to float32, per layer.
        g = zarr.open_group(str(valid_cache / "shards" / f"{s.shard}.zarr"), mode="r")
        k = int(np.flatnonzero(g["sample_ids"][:] == sid)[0])
        a, b = g["sample_offsets"][k], g["sample_offsets"][k + 1]
        bits = g["hidden"][a:b]
        for j, lid in enumerate(cache.layer_ids):
            want = (bits[:, j].astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(s.hidden[lid], want)
        assert s.topk_ids.shape == (len(s), 4) and s.topk_logprobs.dtype == np.float32
    with pytest.raises(Exception, match="no committed sample with id 999"):
        cache.sample(999)


def test_layer_stats_and_outlier_channels(tmp_path):
    """A cache written with the project's writer, holding planted heavy channels: the statistics
    equal numpy's over the same values and name exactly the planted channels."""
    from dflash_offline import open_cache
    from dflash_offline.cache.location import Location
    from dflash_offline.cache.manifest import ManifestStore, new_manifest
    from dflash_offline.cache.shards import publish_shard, tmp_shard_rel
    from dflash_offline.cache.writer import ShardLayout, ShardWriter

    rng = np.random.default_rng(0)
    H, layers, planted = 32, [1, 3], {1: [5], 3: [7, 20]}
    loc = Location(str(tmp_path / "cache"))
    store = ManifestStore(loc)
    store.init_or_check(new_manifest(
        target={"path": "synthetic", "model_type": "qwen3", "num_layers": 4, "hidden_size": H, "vocab_size": 100,
                "config_sha256": "x", "weights_fingerprint": "y"},
        capture={"layer_ids": layers, "topk": 0, "hidden_dtype": "bfloat16", "max_len": 64},
        source={"files": [], "rows": 6}, plan={"shard_tokens": 0, "sort_window": 0, "num_shards": 1}))
    loc.makedirs("shards")
    w = ShardWriter(loc, tmp_shard_rel("shard-000000"), ShardLayout(tokens=6 * 40, cache_layers=2, hidden_size=H,
                                                                     topk=0, chunk_tokens=64, layer_ids=layers))
    values = []
    for sid in range(6):
        x = rng.standard_normal((40, 2, H)).astype(np.float32)
        for j, lid in enumerate(layers):
            x[:, j, planted[lid]] *= 50.0
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncate to bf16
        values.append((bits.astype(np.uint32) << 16).view(np.float32))
        w.append(sid, rng.integers(0, 100, 40).astype(np.int32), np.ones(40, np.uint8), bits, None, None)
    publish_shard(store, w.close("shard-000000"))
    allv = np.concatenate(values)
    stats = open_cache(str(tmp_path / "cache")).layer_stat_records(max_tokens=10_000)
    for j, r in enumerate(stats):
        x = allv[:, j].astype(np.float64)
        assert r["layer"] == layers[j] and r["tokens"] == 240
        assert r["mean"] == pytest.approx(x.mean()) and r["std"] == pytest.approx(x.std())
        assert r["absmax"] == pytest.approx(np.abs(x).max())
        assert sorted(r["outlier_channels"]) == planted[layers[j]]
    # A bounded read: asking for fewer tokens reads fewer.
    assert open_cache(str(tmp_path / "cache")).layer_stat_records(max_tokens=50)[0]["tokens"] == 50


def test_open_cache_never_imports_torch(valid_cache):
    code = ("import sys, dflash_offline as d; c = d.open_cache(sys.argv[1]); s = c.sample(int(c.sample_ids[0])); "
            "c.layer_stats(); c.shards; print(c.summary()); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]")
    r = subprocess.run([sys.executable, "-c", code, str(valid_cache)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "per layer" in r.stdout


def test_notebook_executes(valid_cache, monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.setenv("DFLASH_CACHE", str(valid_cache))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws headless
    nb = nbformat.read(ROOT / "docs" / "inspect.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "torch imported: False" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2  # both figures drawn


def test_inspect_command(valid_cache):
    r = run_cli(["inspect", valid_cache, "--sample", "5"])
    assert r.returncode == 0, r.stderr
    m = json.loads((valid_cache / "manifest.json").read_text())
    assert f"complete, {len(m['shards'])}/{len(m['shards'])} shards, 48 samples" in r.stdout
    assert "shard-000000" in r.stdout and "outlier channels" in r.stdout
    assert "sample 5 (shard-" in r.stdout and "layer   5: norm mean" in r.stdout
    r = run_cli(["inspect", valid_cache.parent, "--no-stats"])  # the folder that holds it: its summary
    assert r.returncode == 0 and r.stdout.startswith(f"<cache {valid_cache}: complete"), (r.stdout, r.stderr)
    r = run_cli(["inspect", valid_cache, "--sample", "999999"])  # refused before the summary and its reads
    assert r.returncode == 2 and r.stdout == "" and "no committed sample with id 999999" in r.stderr, r.stderr


def test_status_of_a_complete_cache(tiny_dense, tiny_data, valid_cache_as_made, tmp_path):
    # A cache of its own, as the session's extract (extract_args) made it: the shared one also logs
    # the refused runs of other tests.
    valid_cache = tmp_path / "cache"
    shutil.copytree(valid_cache_as_made, valid_cache)
    r = run_cli(["status", valid_cache])
    assert r.returncode == 0, r.stderr
    assert "complete" in r.stdout.splitlines()[0] and "last error: none" in r.stdout
    assert "extract-launcher" in r.stdout and " done;" in r.stdout
    st = json.loads(run_cli(["status", valid_cache, "--json"]).stdout)
    assert st["kind"] == "cache" and st["debris"] == [] and st["shards_committed"] == st["shards_planned"]
    # --no-progress (in extract_args): the launcher counts the tokens itself, not with the disabled bar.
    hb = json.loads((valid_cache / "logs" / "extract-launcher.heartbeat.json").read_text())
    assert hb["tokens_done"] == hb["tokens_todo"] == st["totals"]["tokens"] > 0, hb
    # A refused rerun leaves the cache complete and writes nothing there, not even its log (the
    # reason is the terminal's line): status is as it was.
    r = run_cli(extract_args(tiny_dense, tiny_data, valid_cache, "--topk", "2"))
    assert r.returncode == 2 and "capture.topk" in r.stderr
    r = run_cli(["status", valid_cache])
    assert "complete" in r.stdout.splitlines()[0]
    assert "last error: none" in r.stdout, r.stdout


def test_status_mid_extraction_running_then_killed(tiny_dense, tiny_data, tmp_path):
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["DFLASH_OFFLINE_STALL_AT"] = "shard-committed:2"
    proc = subprocess.Popen([sys.executable, "-m", "dflash_offline", *map(str, extract_args(tiny_dense, tiny_data, cache))],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline, st = time.time() + 180, None
        while time.time() < deadline:
            if (cache / "manifest.json").exists():
                st = json.loads(run_cli(["status", cache, "--json"]).stdout)
                # The stall holds the writer thread; the forward loop goes on beating until its
                # queue fills, so wait on the commits, not on the phase text.
                if st["shards_committed"] >= 2 and st["verdict"] == "extracting":
                    break
            time.sleep(1)
        assert st is not None and st["verdict"] == "extracting", run_cli(["status", cache]).stdout
        r = run_cli(["status", cache])
        assert "extracting" in r.stdout and "2/" in r.stdout and "running" in r.stdout, r.stdout
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for _ in range(20):  # SIGKILL lands asynchronously
        r = run_cli(["status", cache])
        if "interrupted" in r.stdout:
            break
        time.sleep(0.5)
    assert r.returncode == 0
    assert "interrupted: run the same extract command again to resume" in r.stdout, r.stdout
    assert "died (process gone without a word: killed?)" in r.stdout


def test_status_of_a_run_that_crashed(valid_cache, tiny_dense, tmp_path):
    out = tmp_path / "run"
    r = run_cli(["train", "--target", tiny_dense, "--cache", valid_cache, "--out", out, "--seq-len", "128",
                 "--num-anchors", "8", "--block-size", "8", "--global-batch-tokens", "128", "--mask-token-id", "1",
                 "--drafter-layers", "1", "--checkpoint-every", "2", "--loader-workers", "0", "--no-progress"],
                env={"DFLASH_OFFLINE_RAISE_AT": "train-step:3"})
    assert r.returncode == 1 and "injected failure at train-step" in r.stderr, r.stderr
    r = run_cli(["status", out])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "stopped before the end: run the same train command again to resume from step-2" in lines[0], r.stdout
    assert "checkpoints: step-2; export: no" in r.stdout
    assert "train-launcher" in r.stdout and "failed: InjectedFault: injected failure at train-step" in r.stdout
    assert "last error: dflash_offline.runtime.faults.InjectedFault: injected failure at train-step" in r.stdout
    assert "train-launcher.log" in r.stdout
    # The traceback is in the log file, for whoever reads it later.
    assert "Traceback" in (out / "logs" / "train-launcher.log").read_text()


def test_status_of_a_killed_run_names_its_last_step(valid_cache, tiny_dense, tmp_path):
    """SIGKILL right after step 5: the heartbeat (written at most every 2 s) may name an earlier
    step; status shows the step the metrics prove was taken, for the run and for its process."""
    out = tmp_path / "run"
    r = run_cli(["train", "--target", tiny_dense, "--cache", valid_cache, "--out", out, "--seq-len", "128",
                 "--num-anchors", "8", "--block-size", "8", "--global-batch-tokens", "128", "--mask-token-id", "1",
                 "--drafter-layers", "1", "--checkpoint-every", "100", "--loader-workers", "0", "--no-progress"],
                env={"DFLASH_OFFLINE_KILL_AT": "train-step:5"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    st = json.loads(run_cli(["status", out, "--json"]).stdout)
    last = st["last_metrics"]["step"]
    assert last >= 4, st  # the lines of the steps before the kill are whole
    launcher = next(p for p in st["processes"] if p["name"] == "train-launcher")
    assert launcher["state"] == "died" and launcher["step"] >= last, (launcher, last)


def test_stage_after_stage_in_one_process_is_done_not_died(tiny_dense, tiny_data, tmp_path):
    """The demo runs extract, then train, in one process: opening the next stage's log finishes
    the previous stage's heartbeat as done (it returned), so status does not call it killed."""
    cache = tmp_path / "cache"
    script = (
        "import sys\n"
        "from dflash_offline.extract import launcher as extract\n"
        "from dflash_offline.runtime import logs\n"
        "from dflash_offline.config import ExtractConfig\n"
        "extract.run(ExtractConfig(target=sys.argv[1], data=[sys.argv[2]], cache=sys.argv[3], topk=4, max_len=128,\n"
        "                          batch_tokens=512, shard_tokens=1024, progress=False))\n"
        "logs.open_process_log(sys.argv[4], 'next-stage', console=False)\n"
        "logs.finish_heartbeat('done')\n"
    )
    r = run_tree([sys.executable, "-c", script, str(tiny_dense), str(tiny_data), str(cache), str(tmp_path / "logs")],
                 timeout=300)
    assert r.returncode == 0, r.stderr
    st = json.loads(run_cli(["status", cache, "--json"]).stdout)
    launcher = next(p for p in st["processes"] if p["name"] == "extract-launcher")
    assert launcher["state"] == "done", launcher
    assert st["verdict"] == "complete"
    r = run_cli(["status", cache])
    assert "died" not in r.stdout and " done;" in r.stdout, r.stdout


def _demo_like_folder(top, valid_cache):
    """The demo's --out as `dflash-offline demo` leaves it: cache/, train/ (a run), generated/ (a
    complete generate output), tiny-target/ and data, built from the session's cache."""
    from dflash_offline.rows.parts import new_manifest

    top.mkdir()
    (top / "cache").symlink_to(valid_cache)
    (top / "train" / "step-3").mkdir(parents=True)
    (top / "train" / "metrics.jsonl").write_text(
        json.dumps({"step": 3, "loss": 2.5, "acc_slot1": 0.25, "tau": 1.5, "step_time": 0.1}) + "\n")
    (top / "tiny-target").mkdir()
    (top / "tiny-target" / "config.json").write_text("{}")
    (top / "prompts-train.parquet").write_bytes(b"")
    (top / "generated").mkdir()
    m = new_manifest(target={}, settings={}, source={}, plan={"num_parts": 0})
    (top / "generated" / "manifest.json").write_text(json.dumps({**m, "status": "complete"}))
    return top


def _without_ages(text: str) -> str:
    return re.sub(r"last heartbeat \S+( min| h)? ago", "last heartbeat ... ago", text)


def test_status_of_a_folder_shows_each_thing_it_holds(valid_cache, tmp_path):
    """`status` of the demo's top folder (cache/, train/, generated/, tiny-target/, data) shows the
    status of each cache, run and generate output, in that order, each block as `status` of that
    folder prints it; --json gives the list."""
    top = _demo_like_folder(tmp_path / "demo", valid_cache)
    r = run_cli(["status", top])
    assert r.returncode == 0, r.stderr
    blocks = r.stdout.rstrip("\n").split("\n\n")
    assert [b.splitlines()[0].split(":")[0] for b in blocks] == \
        [f"cache {top}/cache", f"run {top}/train", f"generated {top}/generated"], r.stdout
    for sub, block in zip(("cache", "train", "generated"), blocks):
        alone = run_cli(["status", top / sub])
        assert alone.returncode == 0, alone.stderr
        assert _without_ages(block) == _without_ages(alone.stdout.rstrip("\n")), (block, alone.stdout)
    sts = json.loads(run_cli(["status", top, "--json"]).stdout)
    assert [(st["kind"], st["path"]) for st in sts] == \
        [("cache", f"{top}/cache"), ("run", f"{top}/train"), ("generate", f"{top}/generated")], sts
    # A folder holding none of them stays an error, in one line.
    for nothing in (top / "tiny-target", tmp_path / "empty"):
        nothing.mkdir(exist_ok=True)
        r = run_cli(["status", nothing])
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "neither a cache (manifest.json), a training run folder" in r.stderr, r.stderr
    r = run_cli(["status", tmp_path / "no-such-thing"])  # mistyped: said so, and what status reads
    assert r.returncode == 2 and r.stderr.strip() == (f"error: {tmp_path / 'no-such-thing'}: no such file or folder; give "
                                                      "a cache, a training run folder, or a generate or prepare output "
                                                      "(or a folder holding them)"), r.stderr


def test_inspect_of_a_folder_summarises_each_cache_and_verify_names_them(valid_cache, tmp_path):
    top = _demo_like_folder(tmp_path / "demo", valid_cache)
    (top / "cache2").symlink_to(valid_cache)
    r = run_cli(["inspect", top, "--no-stats", "--sample", "5"])
    assert r.returncode == 0, r.stderr
    alone = run_cli(["inspect", top / "cache", "--no-stats", "--sample", "5"]).stdout
    assert r.stdout == alone + "\n" + alone.replace(f"{top}/cache", f"{top}/cache2"), r.stdout
    assert r.stdout.count("sample 5 (shard-") == 2
    r = run_cli(["inspect", top, "--no-stats", "--sample", "999999"])  # in no cache: refused before any summary
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert f"no committed sample with id 999999 in {top}/cache, {top}/cache2" in r.stderr, r.stderr
    # verify keeps its one-line pointer.
    (top / "cache2").unlink()
    r = run_cli(["verify", top])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"it holds the cache {top}/cache and the run {top}/train: dflash-offline verify {top}/cache" \
        in r.stderr, r.stderr
    # Runs only: no cache to inspect or verify; both say how to look at the runs.
    (top / "cache").unlink()
    (top / "train2").mkdir()
    (top / "train2" / "metrics.jsonl").write_text("")
    for command in ("verify", "inspect"):
        r = run_cli([command, top])
        assert r.returncode == 2 and f"holds no cache but the runs {top}/train, {top}/train2" in r.stderr, r.stderr
        assert f"dflash-offline status {top}/train" in r.stderr


def _process_columns(text: str) -> list[tuple[int, int]]:
    """(offset of `pid`, offset of the state) on each process line of a status block."""
    found = [re.match(r"  \S+ +(pid) \d+ +(\S)", ln) for ln in text.splitlines()]
    return [(f.start(1), f.start(2)) for f in found if f]


def test_status_columns_line_up_whatever_the_names_and_pids(valid_cache):
    """Process names longer than 18 characters (extract-rank0-writer0) and pids of any width keep
    the pid and state columns aligned on every process line."""
    from dflash_offline.status_records import CacheStatus

    procs = [{"name": name, "pid": pid, "state": state, "phase": "extract", "age_s": 1.0, "error": "OSError: x"}
             for name, pid, state in [("extract-launcher", 8590, "done"), ("extract-rank0-writer0", 8592, "done"),
                                      ("extract-rank0", 123456, "failed"), ("extract-rank12-writer3", 77, "died")]]
    st = CacheStatus(path="c", status="complete", verdict="complete", shards_committed=1, shards_planned=1,
                     totals={"samples": 1, "tokens": 1, "bytes": 1}, shards_released=0, occupancy_bytes=1,
                     budget_bytes=None, in_flight=[], consumers={}, debris=[], missing_shards=[], processes=procs,
                     last_error=None)
    cols = _process_columns(st.text())
    assert len(cols) == 4 and len(set(cols)) == 1, st.text()
    assert cols[0] == (2 + len("extract-rank12-writer3") + 1, 2 + len("extract-rank12-writer3") + 5 + 6 + 1)
    # The real thing: the session's cache, with its launcher, rank and writer processes.
    r = run_cli(["status", valid_cache])
    cols = _process_columns(r.stdout)
    assert len(cols) >= 3 and len(set(cols)) == 1, r.stdout


def test_a_finished_process_is_in_phase_done(tmp_path):
    """A run that finished shows `done; phase done`, not the last phase it beat (held-out
    evaluation); a failed process keeps the phase it failed in. A heartbeat written before the
    phase was reset reads as done too."""
    from dflash_offline.runtime.logs import HEARTBEAT_SUFFIX, Heartbeat
    from dflash_offline.status import run_status

    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "metrics.jsonl").write_text(
        json.dumps({"step": 4, "loss": 2.5, "acc_slot1": 0.25, "tau": 1.5, "step_time": 0.1}) + "\n")
    for name, state in (("train-launcher", "done"), ("train-rank1", "failed")):
        hb = Heartbeat(out / "logs" / f"{name}{HEARTBEAT_SUFFIX}", name, out / "logs" / f"{name}.log")
        hb.beat("train", step=3)
        hb.beat("held-out evaluation", step=4)
        hb.finish(state, None if state == "done" else "RuntimeError: boom")
    written = json.loads((out / "logs" / f"train-launcher{HEARTBEAT_SUFFIX}").read_text())
    assert written["state"] == "done" and written["phase"] == "done", written
    st = run_status(str(out))
    assert {p["name"]: p["phase"] for p in st.processes} == \
        {"train-launcher": "done", "train-rank1": "held-out evaluation"}, st.processes
    text = st.text()
    assert "done; phase done, step 4" in text and "failed: RuntimeError: boom; phase held-out evaluation" in text, text
    # A heartbeat file as earlier versions left it: done, with the last phase of the work.
    (out / "logs" / f"train-launcher{HEARTBEAT_SUFFIX}").write_text(json.dumps({**written, "phase": "held-out evaluation"}))
    assert run_status(str(out)).processes[0]["phase"] == "done"


def test_notebook_finds_the_demo_cache_from_docs(valid_cache, tmp_path, monkeypatch):
    """Started in docs/ (Jupyter's folder for the notebook), without DFLASH_CACHE, the notebook
    finds ../runs/demo/cache; with no cache anywhere it says how to make one."""
    import nbclient
    import nbformat

    monkeypatch.delenv("DFLASH_CACHE", raising=False)
    nb = nbformat.read(ROOT / "docs" / "inspect.ipynb", as_version=4)
    nb.cells = nb.cells[:2]  # the introduction and the cell that opens the cache
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "runs" / "demo").mkdir(parents=True)
    (repo / "runs" / "demo" / "cache").symlink_to(valid_cache)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(repo / "docs")}}).execute()
    shown = nb.cells[1].outputs[0]["data"]["text/plain"]
    assert shown.startswith("<cache ../runs/demo/cache: complete"), shown
    for c in nb.cells:
        c.get("outputs", []).clear()
    with pytest.raises(nbclient.exceptions.CellExecutionError) as e:
        nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert "no cache at runs/demo/cache or ../runs/demo/cache" in str(e.value)
    assert "dflash-offline demo --out runs/demo" in str(e.value) and "DFLASH_CACHE" in str(e.value)


def test_a_complete_manifest_edited_by_hand_is_named_not_read_in_part(valid_cache, tmp_path):
    """verify's advice for a damaged shard is to delete its entry and extract again; a manifest
    that still says complete without that entry (or with totals that are not its shards' sums) is
    refused by every reader, and status calls it damaged, instead of training on part of the cache."""
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.runtime.errors import UserError

    cache = tmp_path / "cache"
    shutil.copytree(valid_cache, cache)
    path = cache / "manifest.json"
    m = json.loads(path.read_text())
    assert m["status"] == "complete" and len(m["shards"]) >= 2
    edited = {**m, "shards": m["shards"][1:]}
    path.write_text(json.dumps(edited))
    says = f"lists {len(m['shards']) - 1} of the {m['plan']['num_shards']} planned shards"
    r = run_cli(["verify", cache])
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    st = json.loads(run_cli(["status", cache, "--json"]).stdout)
    assert st["verdict"].startswith("damaged: manifest.json: it says complete") and says in st["verdict"], st
    path.write_text(json.dumps({**m, "totals": {**m["totals"], "samples": m["totals"]["samples"] + 1}}))
    with pytest.raises(UserError, match="are not the sums of its shards"):
        CacheReader(str(cache))


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.update(totals={}), "totals lacks integer samples, tokens and bytes"),
    (lambda m: m.update(shards="x"), "shards is not a list"),
    (lambda m: m["shards"][0].pop("name"), "shards[0] has no name"),
    (lambda m: m["shards"][0].pop("checksum"), "lacks integer samples, tokens, bytes, a checksum or its sample_ids"),
    (lambda m: m.pop("capture"), "no capture"),
    (lambda m: m["plan"].update(num_shards="5"), "plan.num_shards is not an integer"),
    (lambda m: m.pop("target"), "no target"),
    (lambda m: m["target"].update(hidden_size="64x"), "target lacks a model_type and integer num_layers"),
    (lambda m: m["capture"].update(layer_ids=[1.5, 2]), "capture.layer_ids is not a list of integers (it holds [1.5, 2])"),
    (lambda m: m["shards"][0].update(sample_ids=[["a", "b"]]), "sample_ids is not a list of [first, last] integer"),
])
def test_a_malformed_manifest_is_one_line_not_a_key_error(valid_cache, tmp_path, edit, says):
    """Valid JSON of the wrong shape is named as a damaged manifest by every command that reads it."""
    cache = tmp_path / "cache"
    shutil.copytree(valid_cache, cache)
    m = json.loads((cache / "manifest.json").read_text())
    edit(m)
    (cache / "manifest.json").write_text(json.dumps(m))
    every = (["verify", cache], ["status", cache], ["inspect", cache, "--no-stats"])
    for cmd in every if "totals" in says else every[:1]:  # the same read for all three: all once
        r = run_cli(cmd)
        assert r.returncode == 2 and "damaged or not a dflash-offline manifest" in r.stderr and says in r.stderr, \
            (cmd, r.stderr)


def test_a_file_this_user_may_not_read_is_one_line(valid_cache, tmp_path):
    """Permission denied (here on manifest.json) is one line naming the path, exit 2, not an
    exception name. As root, file permissions bind only without the override capabilities."""
    cache = tmp_path / "cache"
    shutil.copytree(valid_cache, cache)
    (cache / "manifest.json").chmod(0)
    cmd = [sys.executable, "-m", "dflash_offline", "status", str(cache)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: permissions cannot bind")
        cmd = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
               "--bounding-set=-dac_override,-dac_read_search", *cmd]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if "Operation not permitted" in r.stderr and "setpriv" in r.stderr:
        pytest.skip("setpriv may not drop capabilities here")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"error: {cache / 'manifest.json'}: permission denied; give this user access to it, " \
                               "or choose another path"


def test_an_unknown_sample_id_names_the_nearest_ones(tiny_dense, tmp_path):
    """A chat cache's ids are sparse (3, 6, 9, ...): the refusal says which ids there are near the one asked."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from conftest import extract_args
    from dflash_offline.tiny import make_tiny_data

    rows = make_tiny_data(tmp_path / "rows.parquet", rows=6, max_len=40)
    t = pq.read_table(rows)
    pq.write_table(t.set_column(t.schema.get_field_index("id"), "id", pa.array([3, 6, 9, 12, 15, 2 ** 40 + 3], pa.int64())),
                   rows)
    assert run_cli(extract_args(tiny_dense, rows, tmp_path / "cache")).returncode == 0
    r = run_cli(["inspect", tmp_path / "cache", "--sample", "8", "--text"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.strip().endswith(f"no committed sample with id 8; its 6 ids run from 3 to {2 ** 40 + 3} (not every "
                                     "number is one); the nearest: 6, 9"), r.stderr
