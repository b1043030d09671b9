"""The README's first command: the whole job end to end on the embedded default (CPU), whose
drafter must really speed up decoding. (A second run into the same folder says each stage is
complete: the stages' own tests check that, in test_generate.py and test_train.py.)"""

from __future__ import annotations

import json

from conftest import run_cli


def test_demo_drafter_speeds_up_real_decoding(tmp_path):
    out = tmp_path / "demo"
    r = run_cli(["demo", "--out", str(out)], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "all match" in r.stdout and f"export:    {out / 'train' / 'export'}" in r.stdout
    # The figure the demo prints comes from real speculative decoding of held-out prompts.
    report = json.loads((out / "eval.json").read_text())
    e = report["drafters"][0]
    assert report["num_prompts"] == 32 and e["lossless"]
    assert e["tau"] > 4.0, e["tau"]  # block 8: at most 8
    assert e["speedup"] > 1.2, e["speedup"]
    assert f"tau {e['tau']:.2f}" in r.stdout
    train_ids = {row for row in json.loads((out / "generated" / "manifest.json").read_text())["parts"][0]["ids"][0]}
    assert max(train_ids) < 100_000  # held-out prompt ids start at 100000
    metrics = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]
    cfg = json.loads((out / "train" / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    # Every stage's process ended as done (status does not call a finished stage dead).
    st = run_cli(["status", out / "cache", "--json"])
    states = {p["name"]: p["state"] for p in json.loads(st.stdout)["processes"]}
    assert set(states.values()) == {"done"} and "extract-launcher" in states, states
    assert (out / ".dflash-demo").is_file()
    # Its closing lines name the commands that look inside, and each of them works as printed.
    looks = [line.split(":", 1)[1].split("(")[0].split() for line in r.stdout.splitlines()
             if line.strip().startswith(("what each stage did:", "the cache:", "a sample as text:", "a decode as text:"))]
    assert len(looks) == 4 and all(cmd[0] == "dflash-offline" for cmd in looks), r.stdout[-2000:]
    for cmd in looks:
        seen = run_cli(cmd[1:], env={"NO_COLOR": "1"})
        assert seen.returncode == 0, (cmd, seen.stderr[-2000:])
    # The sample as text: the tiny target's tokenizer writes token k+2 of the progression as the number k.
    from dflash_offline import open_cache

    sample = open_cache(str(out / "cache")).sample(int(looks[2][looks[2].index("--sample") + 1]))
    trained = [int(t) for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert all(2 <= t < 34 for t in trained)
    text = run_cli(looks[2][1:], env={"NO_COLOR": "1"}).stdout
    assert "[[ " + " ".join(str(t - 2) for t in trained) + "]]" in text, text
    # Run again into its own folder: every stage says it is complete, the figures are the same run's.
    again = run_cli(["demo", "--out", str(out)], timeout=900)
    assert again.returncode == 0 and "(trained earlier)" in again.stdout, again.stderr[-3000:]


def test_demo_refuses_a_folder_it_did_not_make_before_any_work(tmp_path):
    """A folder holding a user's file, even one named like the demo's, is refused and left as it
    was; so are a file given as --out and a GPU that is not there (before the target is trained)."""
    user = tmp_path / "mine"
    user.mkdir()
    (user / "prompts-train.parquet").write_text("my precious data")
    (user / "README.md").write_text("notes")
    r = run_cli(["demo", "--out", user])
    assert r.returncode == 2 and "is not a demo's" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(p.name for p in user.iterdir()) == ["README.md", "prompts-train.parquet"]
    assert (user / "prompts-train.parquet").read_text() == "my precious data"
    # Only names the demo uses, and a model folder called tiny-target: still the user's, not a demo's.
    named = tmp_path / "named"
    (named / "tiny-target").mkdir(parents=True)
    (named / "tiny-target" / "config.json").write_text("{}")
    (named / "prompts-train.parquet").write_text("my precious data")
    r = run_cli(["demo", "--out", named])
    assert r.returncode == 2 and "is not a demo's" in r.stderr, r.stderr
    assert (named / "prompts-train.parquet").read_text() == "my precious data" and not (named / ".dflash-demo").exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = run_cli(["demo", "--out", afile])
    assert r.returncode == 2 and "exists and is not a folder" in r.stderr and afile.read_text() == "x", r.stderr
    fresh = tmp_path / "fresh"
    r = run_cli(["demo", "--out", fresh, "--devices", "99"])
    assert r.returncode == 2 and "--devices asks for GPU 99" in r.stderr and not fresh.exists(), r.stderr
