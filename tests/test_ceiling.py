"""The implied speed-up on a big target (dflash_offline/evaluate/ceiling.py): the formula on
hand-computed values, the table of measured shapes (load, find, format, refusals), and the
measuring script's CPU smoke run (`decode_speed.py --ceiling --tiny`) writing a file the table
reader reads."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dflash_offline.evaluate.ceiling import (MeasuredShape, ceiling_speedup, extend_to_layers, find_shape,
                                             format_implied, implied_speedup, load_shapes, verify_width_shape)
from dflash_offline.runtime.errors import UserError

ROOT = Path(__file__).resolve().parent.parent

# t_1 = 10 ms, t_B = 12 ms, t_draft = 3 ms: a round costs 15 ms.
SHAPE = MeasuredShape(name="big-27b", description="a test shape", hardware="NVIDIA H200", dtype="bfloat16",
                      block_size=16, context=1024, target_1_ms=10.0, target_block_ms=12.0, draft_ms=3.0,
                      command="python benchmarks/decode_speed.py --ceiling --device 0")


def test_formula_on_hand_computed_values():
    assert implied_speedup(4, SHAPE) == pytest.approx(4 * 10 / 15)  # 2.667
    assert implied_speedup(1, SHAPE) == pytest.approx(10 / 15)  # nothing accepted: slower than the target alone
    assert ceiling_speedup(SHAPE) == pytest.approx(16 * 10 / 15)  # 10.667
    assert implied_speedup(16, SHAPE) == ceiling_speedup(SHAPE)
    for tau in (0.5, 16.5, float("nan")):
        with pytest.raises(ValueError, match="tau"):
            implied_speedup(tau, SHAPE)
    # Linear in the layer count through two measured points: 3 ms with 4 layers, 5 ms with 8 -> 0.5 ms a
    # layer over a 1 ms intercept (embedding and LM head), 33 ms with 64.
    assert extend_to_layers(3.0, 5.0, 4, 8, 64) == pytest.approx(33.0)
    assert extend_to_layers(3.0, 5.0, 4, 8, 8) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        extend_to_layers(3.0, 5.0, 8, 4, 64)


def test_shape_refuses_nonsense_times():
    with pytest.raises(ValueError, match="draft_ms"):
        replace(SHAPE, draft_ms=0.0)
    with pytest.raises(ValueError, match="block_size"):
        replace(SHAPE, block_size=1)


def test_load_find_format(tmp_path):
    table = tmp_path / "table.json"
    other = replace(SHAPE, name="big-27b-b8", block_size=8, target_block_ms=11.0)
    table.write_text(json.dumps({"about": "test", "shapes": [SHAPE.to_dict(), {**other.to_dict(), "later": 1}]}))
    assert load_shapes(table) == [SHAPE, other]  # fields a later version adds are ignored
    # decode_speed.py --out: the records under "ceiling"
    out = tmp_path / "out.json"
    out.write_text(json.dumps({"device": "cuda:0", "ceiling": {"shapes": [SHAPE.to_dict()], "implied": {}}}))
    assert load_shapes(out) == [SHAPE]
    assert find_shape("BIG-27B", table) == SHAPE
    assert find_shape("big-27b-b8", table).block_size == 8
    line = format_implied(4.0, SHAPE)
    assert line == ("implied on big-27b (NVIDIA H200, bfloat16, kernel times, context 1024): 2.67x at tau 4.00 "
                    "(ceiling at tau = 16: 10.7x)")
    assert "drafts blocks of 8" in format_implied(4.0, SHAPE, drafter_block_size=8)
    assert "drafts blocks" not in format_implied(4.0, SHAPE, drafter_block_size=16)
    assert format_implied(float("nan"), SHAPE).endswith("no tau to scale")
    extended = replace(SHAPE, extrapolated_from_layers=[4, 8])
    assert "extended from 4 and 8 layers" in format_implied(4.0, extended)


def test_unknown_name_and_bad_tables(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"shapes": [SHAPE.to_dict()]}))
    with pytest.raises(UserError) as e:
        find_shape("llama-70b", table)
    msg = str(e.value)
    assert msg.startswith("--implied-for llama-70b:") and "known: big-27b" in msg
    assert "benchmarks/decode_speed.py --ceiling" in msg
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"shapes": []}))
    with pytest.raises(UserError, match="known: none yet"):
        find_shape("big-27b", empty)
    bad = tmp_path / "bad.json"
    for text, words in ((json.dumps({"shapes": [{"name": "x", "block_size": 16}]}), "has no context"),
                        ("{not json", "not a readable JSON"), (json.dumps({"rows": []}), "no list of measured shapes"),
                        (json.dumps({"shapes": [{**SHAPE.to_dict(), "target_1_ms": -1}]}), "target_1_ms")):
        bad.write_text(text)
        with pytest.raises(UserError, match=words):
            load_shapes(bad)
    with pytest.raises(UserError, match="no such file"):
        load_shapes(tmp_path / "missing.json")


def test_committed_table_loads():
    shapes = load_shapes()  # dflash_offline/evaluate/ceilings.json
    assert len({s.name for s in shapes}) == len(shapes)
    assert all(s.timing == "kernel" for s in shapes)  # no CPU smoke numbers in the committed table


def test_decode_speed_ceiling_smoke(tmp_path):
    """The measuring script end to end on CPU (tiny shapes, wall times), through the linear
    extension from fewer layers; its --out file is a table load_shapes reads. (Its tiny mode also
    runs part 1, which tests/test_benchmark_smoke.py checks.)"""
    out = tmp_path / "ceiling.json"
    r = subprocess.run([sys.executable, "benchmarks/decode_speed.py", "--ceiling", "--tiny", "--ceiling-layers", "4",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (shape,) = load_shapes(out)
    assert (shape.name, shape.timing, shape.block_size, shape.extrapolated_from_layers) == ("tiny", "wall", 4, [4, 8])
    assert shape.draft_context_ms and shape.draft_context_ms > 0
    assert "--ceiling" in shape.command and shape.command.endswith("--out ceiling.json")  # the file's name alone
    assert find_shape("tiny", out) == shape
    assert format_implied(3.0, shape).startswith("implied on tiny (CPU, float32, wall times, context 32): ")
    assert "| tiny | 4 |" in r.stdout and "tau * t_1 / (t_draft + t_B)" in r.stdout


def test_a_dspark_round_is_priced_as_a_verify_of_b_plus_one():
    """DSpark drafts B a round, so its verify covers B + 1 tokens: t_(B+1) from the widths measured
    for the same target (one --block-sizes run), linear between the nearest two, or one token past
    the largest; the drafter's time is the block's; other widths are refused with the command."""
    b8 = replace(SHAPE, name="big-27b-b8", block_size=8, target_block_ms=11.2, draft_ms=2.9)
    other = replace(SHAPE, name="other", description="another target", block_size=8, target_block_ms=1.0)
    table = [b8, SHAPE, other]
    w17 = verify_width_shape(SHAPE, 17, table)
    assert w17.block_size == 17 and w17.target_block_ms == pytest.approx(12.0 + (12.0 - 11.2) / 8)
    assert w17.draft_ms == SHAPE.draft_ms and w17.target_1_ms == SHAPE.target_1_ms
    assert implied_speedup(17, w17) == pytest.approx(17 * 10 / (3.0 + 12.1))  # B + 1 committed at best
    w9 = verify_width_shape(b8, 9, table)
    assert w9.target_block_ms == pytest.approx(11.2 + 0.1)  # between 8 and 16
    assert verify_width_shape(SHAPE, 16, table) is SHAPE
    line = format_implied(9.0, w17, 17)
    assert line.endswith("(ceiling at tau = 17: 11.3x); verify of 17 tokens extrapolated by one token from widths 8 "
                         "and 16"), line
    for width, table_ in ((18, table), (17, [SHAPE, other])):  # two past the largest; one width measured
        with pytest.raises(UserError, match=r"--implied-for big-27b: a verify of \d+ tokens is not priced .*"
                                            r"--ceiling --block-sizes 16,\d+"):
            verify_width_shape(SHAPE, width, table_)
