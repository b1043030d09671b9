"""benchmarks/pycode_quality.py's pure parts: how a drafter's decode figures over prompt slices
merge into one (pooled as the reference counts tau), and how a variant names its data."""

from __future__ import annotations

import sys

import pytest

from conftest import benchmark_module


def _module():
    return benchmark_module("pycode_quality")


def _slice(rounds, committed, accepted, per_prompt, lossless=True, confidence=None):
    d = {"rounds": rounds, "tokens": committed, "tau": committed / rounds, "tau_per_prompt": per_prompt,
         "accept_rate": [sum(a >= j for a in accepted) / rounds for j in (1, 2)], "lossless": lossless}
    if confidence is not None:
        d["confidence"] = confidence
    return {"num_prompts": len(per_prompt), "device": "cpu", "torch": "x", "drafters": [d]}


def test_slices_merge_as_one_decode_of_all_prompts():
    """Two slices give the figures one decode of all their rounds gives: tau pooled over every
    round, the per-slot share over every round, the per-prompt mean over every prompt; lossless only
    if each slice is; a DSpark calibration weighted by the slots each slice verified."""
    mod = _module()
    a = _slice(4, 10, [2, 1, 0, 1], [3.0, 2.0],
               confidence={"predicted": [0.8, 0.6], "observed": [0.7, 0.5], "verified": [4, 3]})
    b = _slice(2, 8, [2, 2], [4.0], lossless=False,
               confidence={"predicted": [0.5, 0.4], "observed": [1.0, 1.0], "verified": [2, 2]})
    m = mod.merge_decode([a, b])
    assert m["prompts"] == 3 and m["rounds"] == 6 and m["tokens"] == 18
    assert m["tau_pooled"] == pytest.approx(18 / 6)
    assert m["tau_per_prompt_mean"] == pytest.approx(3.0)
    accepted = [2, 1, 0, 1, 2, 2]
    assert m["accept_rate"] == pytest.approx([sum(x >= j for x in accepted) / 6 for j in (1, 2)])
    assert m["lossless"] is False
    assert m["confidence"]["verified"] == [6, 5]
    assert m["confidence"]["predicted"] == pytest.approx([(0.8 * 4 + 0.5 * 2) / 6, (0.6 * 3 + 0.4 * 2) / 5])
    assert m["confidence"]["observed"] == pytest.approx([(0.7 * 4 + 2) / 6, (0.5 * 3 + 2) / 5])
    assert "confidence" not in mod.merge_decode([_slice(1, 2, [1], [2.0])])  # DFlash: none


def test_a_variant_names_the_temperature_of_its_data():
    mod = _module()
    assert mod.data_temperature("dspark-cl", 1.0) == 1.0
    assert mod.data_temperature("dflash@t0", 1.0) == 0.0
    assert mod.data_temperature("tv@t0.6", 0.0) == 0.6
    with pytest.raises(SystemExit, match="the suffix after @ is tT"):
        mod.data_temperature("tv@hot", 1.0)


def test_the_dflash_recipe_keeps_its_earlier_preset_name(capsys):
    """`default` named the DFlash recipe before DSpark became the fixture's default: the commands in
    docs/benchmarks.md still run, under their own name, with a note on stderr."""
    mod = _module()
    got = mod.parse_variants("dspark-cl,default@t0")
    assert got == {"dspark-cl": mod.PRESETS["dspark-cl"], "default@t0": mod.PRESETS["dflash"]}
    assert "'default' is now named 'dflash'" in capsys.readouterr().err
    assert mod.parse_variants("dflash") == {"dflash": []}
    with pytest.raises(SystemExit, match="unknown preset"):
        mod.parse_variants("defaults")


def test_variants_combine_presets_and_name_groups():
    """`a+b` is a's options then b's (train keeps the last of a repeated option); a group stands for
    its members; @tT still names the data's temperature."""
    mod = _module()
    got = mod.parse_variants("dspark-cl+tap-full+init-attn@t0")
    assert got == {"dspark-cl+tap-full+init-attn@t0": mod.PRESETS["dspark-cl"] + ["--target-layers", "3,7",
                                                                               "--init-layers", "3,3,3,3,7,7,7,7"]}
    taps = mod.parse_variants("taps")
    assert list(taps) == mod.GROUPS["taps"] and len(taps) == 6
    assert len({mod.last_value(o, "--target-layers") for o in taps.values()}) == 6  # six distinct tap sets
    assert list(mod.parse_variants("warm,dflash")) == [*mod.GROUPS["warm"], "dflash"]
    with pytest.raises(SystemExit, match="unknown preset 'tap-ful' in 'dspark-cl\\+tap-ful'"):
        mod.parse_variants("dspark-cl+tap-ful")


def test_a_variant_that_would_fail_after_extraction_is_refused_first():
    mod = _module()
    recipe = ["--drafter-layers", "8", "--lr", "1e-3"]
    mod.check_variants(mod.parse_variants("taps"), recipe, "0,1,2,3,4,5,6,7")
    with pytest.raises(SystemExit, match=r"reads layers 1,3,5,7, and --capture 1,2,3,4,5,6 does not hold them all"):
        mod.check_variants(mod.parse_variants("taps"), recipe, "1,2,3,4,5,6")
    with pytest.raises(SystemExit, match=r"starts 8 layers \(--init-layers 3,3,3,3,7,7,7,7\) of a drafter of 5"):
        mod.check_variants(mod.parse_variants("dspark-cl+init-attn"), recipe + ["--drafter-layers", "5"], "3,7")
    assert mod.last_value(["--lr", "1", "--lr", "2"], "--lr") == "2" and mod.last_value([], "--lr") is None


def test_trainers_run_n_at_a_time_and_a_failure_stops_the_others(tmp_path, capsys):
    """run_all: never more than `limit` alive at once (each child records the others it saw alive),
    and when one fails the ones still running are stopped, not left holding the device."""
    import subprocess
    import time

    pq = benchmark_module("pycode_quality")
    marks = tmp_path / "alive"
    marks.mkdir()
    child = ("import os, sys, time; d = sys.argv[1]; me = os.path.join(d, sys.argv[2]); open(me, 'w').close(); "
             "time.sleep(0.6); n = len(os.listdir(d)); os.remove(me); print(n); sys.exit(int(sys.argv[3]))")

    def start(name, code=0):
        return lambda: subprocess.Popen([sys.executable, "-c", child, str(marks), name, str(code)],
                                        stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT)

    names = [f"v{i}" for i in range(5)]
    logs = {n: tmp_path / f"{n}.log" for n in names}
    took = pq.run_all({n: start(n) for n in names}, logs, limit=2)
    assert set(took) == set(names)
    assert max(int(logs[n].read_text()) for n in names) <= 2

    started = {}  # the survivors: started through run_all, found stopped afterwards

    def long(name):
        def go():
            started[name] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            return started[name]
        return go

    logs = {**{n: tmp_path / f"{n}.log" for n in ("a", "b")}, "bad": tmp_path / "bad.log"}
    t0 = time.time()
    with pytest.raises(SystemExit, match=r"bad failed with exit code 3 \(2 others stopped\)"):
        pq.run_all({"a": long("a"), "b": long("b"), "bad": start("bad", 3)}, logs)
    assert time.time() - t0 < 30
    assert all(p.poll() is not None for p in started.values())
