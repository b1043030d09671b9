"""Stage two on the CPU: learning, data-parallel equality, exact resume after SIGKILL, refusals, export."""

from __future__ import annotations

import json
import os
import shutil
import signal

import numpy as np
from safetensors.numpy import load_file

from conftest import TRAIN, run_cli, run_tree



def train(tiny_dense, cache, out, *extra, env=None):
    return run_cli(["train", "--target", str(tiny_dense), "--cache", str(cache), "--out", str(out), *TRAIN, *extra],
                   env=env, timeout=600)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def weights(out, step) -> dict:
    return load_file(str(out / f"step-{step}" / "drafter.safetensors"))


def test_training_learns_and_exports(arith_cache, tiny_dense, tmp_path):
    out = tmp_path / "run"
    r = train(tiny_dense, arith_cache, out, "--epochs", "4", "--checkpoint-every", "1000", "--profile-steps", "2")
    assert r.returncode == 0, r.stderr
    m = metrics(out)
    # --profile-steps: steps 6-7 profiled (five after the first), a trace and a table naming the phases.
    table = (out / "profile" / "rank0-steps6-7.txt").read_text()
    for name in ("forward", "loss", "backward", "optimizer"):
        assert f"\n{name} " in table, table[:2000]
    assert json.loads((out / "profile" / "rank0-steps6-7.json").read_text())["traceEvents"]
    first, last = np.mean([x["loss"] for x in m[:3]]), np.mean([x["loss"] for x in m[-3:]])
    assert last < 0.5 * first, (first, last)
    assert np.mean([x["acc_slot1"] for x in m[-3:]]) > np.mean([x["acc_slot1"] for x in m[:3]]) + 0.3
    assert m[-1]["tau"] > 1.5
    assert list((out / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert all(x["recompiles"] == 0 for x in m)  # CPU path: dense SDPA, nothing compiled
    # Export: the serving format, loads back.
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["mask_token_id"] == 1
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings"):
        assert k in cfg, k
    assert cfg["num_hidden_layers"] == 2 and cfg["attention_bias"] is False
    from dflash_offline.drafter.export import load_exported

    d = load_exported(str(out / "export"), str(tiny_dense))
    from safetensors.torch import load_file as load_torch

    exported = load_torch(str(out / "export" / "model.safetensors"))
    assert "fc.weight" in exported and not any("embed" in k or "lm_head" in k for k in exported)
    assert d is not None


def test_resume_after_sigkill_equals_straight_run(arith_cache, tiny_dense, straight_run, tmp_path):
    straight, resumed = straight_run("cpu"), tmp_path / "resumed"
    env = {**os.environ, "DFLASH_OFFLINE_KILL_AT": "checkpoint-saved:1"}
    r = train(tiny_dense, arith_cache, resumed, "--epochs", "2", "--max-steps", "12", "--checkpoint-every", "6", env=env)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert sorted(p.name for p in resumed.iterdir() if p.name.startswith("step-")) == ["step-6"]
    r = train(tiny_dense, arith_cache, resumed, "--epochs", "2", "--max-steps", "12", "--checkpoint-every", "6")
    assert r.returncode == 0, r.stderr
    a, b = metrics(straight), metrics(resumed)
    assert [x["step"] for x in b] == list(range(1, 13))
    assert [x["loss"] for x in a] == [x["loss"] for x in b]  # bit-identical losses
    wa, wb = weights(straight, 12), weights(resumed, 12)
    assert wa.keys() == wb.keys()
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


def test_two_gloo_ranks_equal_one_process(straight_run):
    """Same global batch (512 tokens): one process accumulates 2 rows, two ranks take one each.
    Tolerance: float sums in another order (DDP's all-reduce averages gradients) differ in the last
    bits, so weights agree to 1e-5 relative after 12 AdamW steps, not bit for bit."""
    one, two = straight_run("cpu"), straight_run("cpu,cpu")
    assert (two / "logs" / "train-rank1.log").exists()
    la, lb = [x["loss"] for x in metrics(one)], [x["loss"] for x in metrics(two)]
    assert len(la) == len(lb) == 12
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    wa, wb = weights(one, 12), weights(two, 12)
    for k in wa:
        np.testing.assert_allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_refuses_other_target_missing_shard_corrupted_chunk(arith_cache, tiny_dense, tmp_path):
    from dflash_offline.tiny import make_tiny_target

    other = make_tiny_target(tmp_path / "other", kind="qwen3", seed=5)
    r = train(other, arith_cache, tmp_path / "r1", "--epochs", "1")
    assert r.returncode == 2 and "another target" in r.stderr and r.stderr.count("\n") == 1

    broken = tmp_path / "broken"
    shutil.copytree(arith_cache, broken)
    shutil.rmtree(broken / "shards" / "shard-000001.zarr")
    r = train(tiny_dense, broken, tmp_path / "r2", "--epochs", "1")
    assert r.returncode == 2 and "shard-000001" in r.stderr and "missing" in r.stderr

    corrupt = tmp_path / "corrupt"
    shutil.copytree(arith_cache, corrupt)
    chunk = corrupt / "shards" / "shard-000002.zarr" / "hidden" / "c" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    r = train(tiny_dense, corrupt, tmp_path / "r3", "--epochs", "1", "--verify", "full")
    assert r.returncode == 2 and "shard-000002" in r.stderr and "checksum" in r.stderr
    # Without the full check at start, the chunk's CRC32C stops training when it is read.
    r = train(tiny_dense, corrupt, tmp_path / "r4", "--epochs", "1")
    assert r.returncode == 1 and "shard-000002" in r.stderr and "unreadable" in r.stderr


def test_torchrun_training_equals_launcher_and_export_command(arith_cache, tiny_dense, tmp_path):
    """The same train command under torchrun (2 ranks, gloo) matches our own 2-process launcher
    bit for bit (same rank layout, same reductions); `dflash-offline export` writes a checkpoint's
    drafter that loads back."""
    import sys

    launcher, under = tmp_path / "launcher", tmp_path / "torchrun"
    r = train(tiny_dense, arith_cache, launcher, "--epochs", "1", "--max-steps", "4", "--devices", "cpu,cpu")
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = run_tree(  # on timeout torchrun's ranks are killed too (each runs in a session of its own)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dflash_offline",
         "train", "--target", str(tiny_dense), "--cache", str(arith_cache), "--out", str(under), *TRAIN,
         "--epochs", "1", "--max-steps", "4", "--devices", "cpu"], env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["loss"] for x in metrics(launcher)] == [x["loss"] for x in metrics(under)]
    wa, wb = weights(launcher, 4), weights(under, 4)
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)

    r = run_cli(["export", "--run", str(under), "--step", "4", "--to", str(tmp_path / "exported")])
    assert r.returncode == 0, r.stderr
    from dflash_offline.drafter.export import load_exported

    d = load_exported(str(tmp_path / "exported"), str(tiny_dense))
    assert d.cfg.block_size == 8 and d.cfg.num_hidden_layers == 2
    exported = {k: v.float().numpy() for k, v in d.trainable_state_dict().items()}
    for k, v in wb.items():  # the checkpoint's fp32 weights, rounded to bf16 by the export
        import torch

        np.testing.assert_array_equal(exported[k], torch.from_numpy(v).bfloat16().float().numpy(), err_msg=k)
    r = run_cli(["export", "--run", str(under), "--step", "3"])
    assert r.returncode == 2 and "no such checkpoint" in r.stderr


def test_second_trainer_on_same_out_is_refused(arith_cache, tiny_dense, tmp_path):
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "dflash_offline", "train", "--target", str(tiny_dense), "--cache",
                              str(arith_cache), "--out", str(out), *TRAIN, "--epochs", "50"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "metrics.jsonl").exists():
            time.sleep(0.2)
        assert (out / "metrics.jsonl").exists(), "the first trainer never started"
        r = train(tiny_dense, arith_cache, out, "--epochs", "50")
        assert r.returncode == 2 and "another training run" in r.stderr and r.stderr.count("\n") == 1
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def test_verify_command_names_damaged_shard(arith_cache, tmp_path):
    r = run_cli(["verify", str(arith_cache)])
    assert r.returncode == 0 and "shards match their checksums" in r.stdout
    corrupt = tmp_path / "corrupt"
    shutil.copytree(arith_cache, corrupt)
    chunk = corrupt / "shards" / "shard-000001.zarr" / "hidden" / "c" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[50] ^= 0x01
    chunk.write_bytes(bytes(data))
    r = run_cli(["verify", str(corrupt)])
    assert r.returncode == 1 and "damaged: shard-000001" in r.stderr


def test_resume_with_other_lr_is_refused_before_any_rank_starts(arith_cache, tiny_dense, tmp_path):
    out = tmp_path / "run"
    r = train(tiny_dense, arith_cache, out, "--epochs", "1", "--max-steps", "2")
    assert r.returncode == 0, r.stderr
    r = train(tiny_dense, arith_cache, out, "--epochs", "1", "--max-steps", "4", "--lr", "1e-5", "--devices", "cpu,cpu")
    assert r.returncode == 2 and "lr = 0.003" in r.stderr and r.stderr.count("\n") == 1
    assert not (out / "logs" / "train-rank0.log").exists()  # refused in the launcher


def test_rerun_of_a_finished_run_says_already_complete(arith_cache, tiny_dense, tmp_path):
    out = tmp_path / "run"
    r = train(tiny_dense, arith_cache, out, "--epochs", "1")
    assert r.returncode == 0, r.stderr
    done = metrics(out)[-1]["step"]
    assert f"trained {done}/{done} steps in " in r.stdout, r.stdout
    before = (out / "metrics.jsonl").read_text()
    r = train(tiny_dense, arith_cache, out, "--epochs", "1")
    assert r.returncode == 0, r.stderr
    assert f"already complete: {done}/{done} steps; checkpoints in {out}; export in {out / 'export'}" in r.stdout, \
        r.stdout
    assert "trained" not in r.stdout
    assert (out / "metrics.jsonl").read_text() == before  # nothing trained, nothing logged
    assert [p.name for p in out.glob("step-*")] == [f"step-{done}"]


def test_checkpoints_and_export_are_readable_by_others(arith_cache, tiny_dense, tmp_path):
    """safetensors writes through a 0600 temporary file: the tool gives the files the umask's
    ordinary mode, so a serving process of another user can read the export."""
    import re
    import stat

    def modes(folder):
        return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}

    out = tmp_path / "run"
    old = os.umask(0o022)
    try:
        r = train(tiny_dense, arith_cache, out, "--epochs", "1", "--max-steps", "2", "--checkpoint-every", "1")
        assert r.returncode == 0, r.stderr
        os.umask(0o027)
        r = run_cli(["export", "--run", str(out), "--step", "1", "--to", str(tmp_path / "export-1")])
        assert r.returncode == 0, r.stderr
    finally:
        os.umask(old)
    for folder in (out / "step-1", out / "step-2", out / "export"):
        assert modes(folder) and set(modes(folder).values()) == {0o644}, (folder, modes(folder))
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert set(modes(tmp_path / "export-1").values()) == {0o640}  # the umask is honoured, not overridden
    # The log counts the drafter's parameters in readable units (it used to say 0.00B).
    log = (out / "logs" / "train-launcher.log").read_text()
    assert re.search(r"drafter: \d+\.\d\d[KM] trainable parameters", log), log


def test_human_count():
    from dflash_offline.runtime.units import human_count

    assert [human_count(n) for n in (7, 999, 1234, 999_999, 1_230_000, 2.1e9, 1.84e9)] == \
        ["7", "999", "1.23K", "1.00M", "1.23M", "2.10B", "1.84B"]


def test_settings_that_would_be_adjusted_or_ignored_are_said_on_the_terminal(arith_cache, tiny_dense, tmp_path):
    """A global batch that is not whole rows per rank is rounded, and a profile window past the
    run's last step writes nothing: both are warnings on the terminal, not only a log line."""
    out = tmp_path / "run"
    args = list(TRAIN)
    args[args.index("--global-batch-tokens") + 1] = "300"  # rows of 256 tokens: 2 per step, 512 tokens
    r = run_cli(["train", "--target", str(tiny_dense), "--cache", str(arith_cache), "--out", str(out), *args,
                 "--max-steps", "3", "--profile-steps", "2"], timeout=600)
    assert r.returncode == 0, r.stderr
    assert "--global-batch-tokens 300 is not a multiple of 1 rank(s) x --seq-len 256: each step takes 512" in r.stderr
    assert "--profile-steps 2: the profile covers steps 6..7" in r.stderr and "past this run's last step 3" in r.stderr
    assert not (out / "profile").exists() and len(metrics(out)) == 3
