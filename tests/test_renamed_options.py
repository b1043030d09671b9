"""Options renamed so that one name has one meaning (capture_layers / capture_count for what
extract captures, drafter_layers for the drafter's depth, target_layers for the target layers a
drafter reads): the earlier names still work, as flags, recipe keys and in checkpoints, with one
warning line; both names at once are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT, TRAIN, run_cli
from dflash_offline import cli
from dflash_offline.config import ExtractConfig
from dflash_offline.evaluate.config import EvalConfig
from dflash_offline.sizing_config import PlanConfig
from dflash_offline.train.config import TrainConfig
from dflash_offline.options import load_recipe, renamed
from dflash_offline.runtime.errors import UserError

RENAMED = {
    ExtractConfig: {"layers": "capture_layers", "num_layers": "capture_count"},
    PlanConfig: {"layers": "capture_layers", "num_layers": "capture_count"},
    TrainConfig: {"layers": "target_layers", "num_layers": "drafter_layers"},
    EvalConfig: {"device": "devices"},  # one name for the device option in every command
}


@pytest.mark.parametrize("cls", list(RENAMED), ids=lambda c: c.__name__)
def test_each_earlier_name_is_a_hidden_option_of_its_field(cls):
    assert renamed(cls) == RENAMED[cls]
    name = {ExtractConfig: "extract", PlanConfig: "plan", TrainConfig: "train", EvalConfig: "eval"}[cls]
    hidden = {p.name: p for p in cli.main.commands[name].params if p.hidden}
    assert set(hidden) == {cli._WAS + old for old in RENAMED[cls]}
    for old in RENAMED[cls]:
        assert hidden[cli._WAS + old].opts == ["--" + old.replace("_", "-")]
    shown = cli.main.commands[name].get_help(cli.click.Context(cli.main.commands[name]))
    assert "--num-layers" not in shown and "--layers " not in shown and "--device " not in shown


def test_earlier_flags_give_the_same_config_with_one_warning(capsys):
    import dflash_offline.options as options

    options._warned.clear()
    got = cli._renamed_given(TrainConfig, {"cache": "c", cli._WAS + "num_layers": 3, cli._WAS + "layers": [1, 2]})
    assert got == {"cache": "c", "drafter_layers": 3, "target_layers": [1, 2]}
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: --num-layers is now --drafter-layers (same meaning); the old name still works but will be "
                   "removed", "warning: --layers is now --target-layers (same meaning); the old name still works but "
                   "will be removed"]
    with pytest.raises(UserError, match=r"^--num-layers and --drafter-layers are one option .*give --drafter-layers only"):
        cli._renamed_given(TrainConfig, {"drafter_layers": 2, cli._WAS + "num_layers": 3})


def test_plan_with_earlier_flags_equals_the_new_ones(tiny_dense, tiny_data):
    """Through the real command line: the same plan, one warning line per earlier flag, and both
    spellings of one option refused in one line."""
    base = ["plan", "--target", tiny_dense, "--data", tiny_data, "--json"]
    new = run_cli(base + ["--capture-layers", "2,4"])
    old = run_cli(base + ["--layers", "2,4"])
    assert new.returncode == old.returncode == 0, old.stderr
    assert json.loads(new.stdout) == json.loads(old.stdout) and json.loads(old.stdout)["layer_ids"] == [2, 4]
    assert new.stderr == "" and old.stderr.splitlines() == [
        "warning: --layers is now --capture-layers (same meaning); the old name still works but will be removed"]
    old = run_cli(base + ["--num-layers", "3"])
    assert old.returncode == 0 and json.loads(old.stdout)["layer_ids"] == json.loads(
        run_cli(base + ["--capture-count", "3"]).stdout)["layer_ids"]
    both = run_cli(base + ["--layers", "2,4", "--capture-layers", "2,4"])
    assert both.returncode == 2 and both.stderr.splitlines() == [
        "error: --layers and --capture-layers are one option (--layers is its earlier name); give --capture-layers only"]


def test_the_device_option_is_devices_everywhere_and_device_still_works(tiny_dense, tmp_path):
    """eval and verify --content took --device where every other command takes --devices: both now
    take --devices; --device (and an eval recipe's `device` key) still work, with one warning line."""
    warn = "warning: --device is now --devices (same meaning); the old name still works but will be removed"
    for cmd in (["eval", "--target", tiny_dense, "--drafter", tmp_path / "none", "--cache", tmp_path / "none"],
                ["verify", tmp_path / "none", "--content", "1", "--target", tiny_dense]):
        name = cmd[0]
        assert "--devices" in run_cli([name, "--help"]).stdout
        new, old = run_cli([*cmd, "--devices", "7"]), run_cli([*cmd, "--device", "7"])
        assert new.returncode == old.returncode != 0, (new.stderr, old.stderr)
        # the old name reaches the same check with its value (the cache, the export or GPU 7 refused the same)
        assert old.stderr.splitlines() == [warn, *new.stderr.splitlines()], (name, old.stderr, new.stderr)
        assert warn not in new.stderr
    recipe = tmp_path / "eval.toml"
    recipe.write_text('device = "0"\n')
    assert load_recipe(recipe, EvalConfig)["devices"] == "0"


def _with_earlier_keys(text: str, cls: type) -> str:
    """A recipe as it was written before the renames: each renamed key under its earlier name."""
    back = {new: old for old, new in renamed(cls).items()}
    lines = []
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip()
        lines.append(line.replace(key, back[key], 1) if "=" in line and key in back else line)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("recipe", sorted((ROOT / "stages").glob("*/*.toml")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stage_recipes_with_their_earlier_keys_load_the_same(recipe, tmp_path, capsys):
    from dflash_offline.config import GenerateConfig, PrepareConfig
    from dflash_offline.evaluate.config import EvalConfig

    cls = {"extract": ExtractConfig, "train": TrainConfig, "generate": GenerateConfig, "prepare": PrepareConfig,
           "eval": EvalConfig}[recipe.stem]
    old = tmp_path / recipe.name
    old.write_text(_with_earlier_keys(recipe.read_text(), cls))
    assert dict(load_recipe(old, cls)) == dict(load_recipe(recipe, cls))
    renamed_here = old.read_text() != recipe.read_text()
    assert ("warning: --config" in capsys.readouterr().err) == renamed_here


def test_a_recipe_with_both_names_of_one_option_is_refused(tmp_path):
    recipe = tmp_path / "train.toml"
    recipe.write_text("num-layers = 2\ndrafter_layers = 3\n")
    with pytest.raises(UserError) as e:
        load_recipe(recipe, TrainConfig)
    assert str(e.value) == (f"--config {recipe}: key 'num-layers' and key 'drafter_layers' are one option (key "
                            "'num-layers' is its earlier name); give key 'drafter_layers' only")


def test_one_warning_names_the_earlier_key_as_written(tmp_path, capsys):
    recipe = tmp_path / "train.toml"
    recipe.write_text("num-layers = 2\n")
    assert load_recipe(recipe, TrainConfig)["drafter_layers"] == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: --config {recipe}: key 'num-layers' is now key 'drafter_layers' (same meaning); the "
                   "old name still works but will be removed"]


def test_a_value_from_an_earlier_key_is_named_as_written(tmp_path):
    from dflash_offline.options import merge

    recipe = tmp_path / "train.toml"
    recipe.write_text('cache = "c"\ntarget = "t"\nout = "o"\nlayers = [3, 3]\n')
    cfg = merge(TrainConfig, load_recipe(recipe, TrainConfig), {})
    with pytest.raises(UserError, match=rf"^--config {recipe}: key 'layers' \[3, 3\]: give distinct layer ids"):
        cfg.validate()


def test_a_checkpoint_saved_under_the_earlier_names_resumes(tiny_dense, arith_cache, tmp_path):
    """A checkpoint written before the renames (its saved config has num_layers and layers)
    resumes, and is still refused with another drafter depth, named by its current name."""
    out = tmp_path / "run"
    args = ["train", "--target", tiny_dense, "--cache", arith_cache, "--out", out, *TRAIN, "--epochs", "1"]
    r = run_cli(args + ["--max-steps", "2", "--checkpoint-every", "2"], timeout=600)
    assert r.returncode == 0, r.stderr
    state = Path(out) / "step-2" / "state.json"
    s = json.loads(state.read_text())
    s["config"]["num_layers"] = s["config"].pop("drafter_layers")
    s["config"]["layers"] = s["config"].pop("target_layers")
    state.write_text(json.dumps(s))
    wrong = run_cli([a if a != "2" or args[i - 1] != "--drafter-layers" else "3" for i, a in enumerate(args)]
                    + ["--max-steps", "4"], timeout=600)
    assert wrong.returncode == 2 and "made with drafter_layers = 2, this run has 3" in wrong.stderr, wrong.stderr
    r = run_cli(args + ["--max-steps", "4"], timeout=600)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in (Path(out) / "logs" / "train-launcher.log").read_text()
