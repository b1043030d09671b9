"""The CLI and the config dataclasses tell one story: every option of a stage's command is a field
of its config, and every literal `[default: X]` in an option's help is that field's default, so a
default changed in one place cannot silently disagree with the other."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dflash_offline import cli
from dflash_offline.config import ExtractConfig, GenerateConfig, PrepareConfig
from dflash_offline.evaluate.config import EvalConfig
from dflash_offline.sizing_config import PlanConfig
from dflash_offline.train.config import TrainConfig

COMMANDS = {"train": TrainConfig, "extract": ExtractConfig, "eval": EvalConfig, "generate": GenerateConfig,
            "plan": PlanConfig, "prepare": PrepareConfig}
NOT_FIELDS = {"config_file", "as_json"}  # the recipe file itself; plan's output format


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _literal(text: str, value):
    """The help's default text as the field's type, or None when it is prose (e.g. 'the DFlash rule')."""
    first = text.split(",")[0].split(" = ")[0].strip()
    if isinstance(value, bool):
        return {"on": True, "off": False}.get(first)
    if isinstance(value, (int, float)):
        try:
            return type(value)(float(first)) if isinstance(value, float) else int(first)
        except ValueError:
            return None
    if isinstance(value, str) and re.fullmatch(r"[\w.\-]+", first):
        return first
    return None


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_a_config_field_with_the_default_its_help_states(name):
    cls = COMMANDS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    checked = 0
    for p in cli.main.commands[name].params:
        if p.name in NOT_FIELDS or p.hidden:  # hidden: a renamed option's earlier spelling (tested below)
            continue
        assert p.name in fields, f"{name} --{p.name.replace('_', '-')} is not a field of {cls.__name__}"
        m = re.search(r"\[default: ([^\]]+)\]", p.help or "")
        value = _default(fields[p.name])
        if m is None or value is None or value is dataclasses.MISSING:
            continue
        stated = _literal(m.group(1), value)
        if stated is not None:
            assert stated == value, f"{name} --{p.name}: help says [default: {m.group(1)}], {cls.__name__} has {value!r}"
            checked += 1
    assert checked >= 2  # the test reads the defaults it means to check


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_recipe_key_spelled_as_its_option_names_the_right_key(name, tmp_path):
    """Where an option's flag is not its config field's name (eval --drafter -> drafters), a recipe
    that uses the flag's spelling is told the key, not just that the key is unknown."""
    from dflash_offline.options import load_recipe
    from dflash_offline.runtime.errors import UserError

    cls = COMMANDS[name]
    for p in cli.main.commands[name].params:
        flag = p.opts[0].lstrip("-").replace("-", "_")
        if p.name in NOT_FIELDS or flag == p.name or p.hidden:
            continue
        recipe = tmp_path / f"{flag}.toml"
        recipe.write_text(f'{flag} = "x"\n')
        with pytest.raises(UserError, match=f"the option --{flag} is the key '{p.name}'"):
            load_recipe(recipe, cls)


def test_a_recipe_size_reads_like_the_option(tmp_path):
    """`max_bytes = "64GB"` in a recipe is what `--max-bytes 64GB` is; a non-size is one line."""
    from dflash_offline.options import load_recipe
    from dflash_offline.runtime.errors import UserError

    for text, want in (('"64GB"', 64 * 10**9), ('"1.5T"', 15 * 10**11), ('"512MiB"', 512 * 2**20), ("1000", 1000)):
        (tmp_path / "r.toml").write_text(f"max_bytes = {text}\n")
        assert load_recipe(tmp_path / "r.toml", ExtractConfig) == {"max_bytes": want}
        assert cli.ByteSize().convert(text.strip('"'), None, None) == want
    (tmp_path / "r.toml").write_text('max_bytes = "64 apples"\n')
    with pytest.raises(UserError, match="key 'max_bytes': '64 apples' is not a size"):
        load_recipe(tmp_path / "r.toml", ExtractConfig)


def _stage_params(name: str):
    """The options a stage's --help shows (not a renamed option's hidden earlier spelling)."""
    return [p for p in cli.main.commands[name].params if p.name not in NOT_FIELDS and not p.hidden]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_options_are_built_from_the_config_fields(name):
    """Every option of a stage command is one `opt(...)` field of its config, in field order, and
    the option says what the field says: spelling, help, choices, default text; its click default
    is None (so a recipe is not overridden by a default the user never typed)."""
    from dflash_offline.options import cli_fields, flag_of

    fields = cli_fields(COMMANDS[name])
    params = _stage_params(name)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        assert p.opts[0] == flag_of(f)
        assert p.help == f.metadata["help"] + (f"  [default: {cli.default_text(f)}]" if cli.default_text(f) else "")
        if f.metadata["choices"]:
            assert tuple(p.type.choices) == f.metadata["choices"]
        assert (p.multiple or p.default is None) and not p.show_default


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_states_no_object_repr(name):
    """A field with a default factory (a repeatable option) states no default: its help once
    showed `[default: <dataclasses._MISSING_TYPE object at 0x...>]`."""
    from click.testing import CliRunner

    out = CliRunner().invoke(cli.main, [name, "--help"], terminal_width=200).output
    assert "--" in out and " object at 0x" not in out and "MISSING" not in out, out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_no_default_is_written_twice(name):
    """A default is stated in words (`default_text`) only where it is a rule, never the field's own
    value written again (which could drift from it)."""
    for f in dataclasses.fields(COMMANDS[name]):
        text = f.metadata.get("default_text")
        value = _default(f)
        if text is None or value in (None, dataclasses.MISSING):
            continue
        assert _literal(text, value) != value, f"{name} {f.name}: default_text {text!r} repeats the default {value!r}"


def test_cli_declares_no_stage_option_by_hand():
    """cli.py holds no option block of a stage command: only options that fill no config field
    (plan's --json) are declared there."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(cli.__file__).read_text())
    by_hand = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name.rstrip("_") in COMMANDS:
            by_hand[fn.name.rstrip("_")] = [d.args[0].value for d in fn.decorator_list
                                            if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "option"]
    assert by_hand == {"prepare": [], "extract": [], "train": [], "eval": [], "plan": ["--json"], "generate": []}


def test_resume_identity_is_field_metadata():
    """The settings a resumed run must share with its checkpoint are the fields marked resume=True."""
    from dflash_offline.train.resume import RESUME_KEYS

    marked = [f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("resume")]
    assert list(RESUME_KEYS) == marked
    assert {"block_size", "target_layers", "lr", "seed", "drafter_layers", "follow"} <= set(RESUME_KEYS)
    assert not {"out", "devices", "progress", "log_every", "eval_cache"} & set(RESUME_KEYS)


def test_adding_an_option_is_one_field(tmp_path):
    """The "how to extend" example (docs/architecture.md): a config dataclass with `opt` fields is
    a command: typed values, lists of ids, sizes, choices, switches, a flag spelled otherwise than
    its field, help with the default, and a recipe that the command line overrides."""
    from click.testing import CliRunner

    from dflash_offline.options import load_recipe, merge, opt

    @dataclasses.dataclass
    class ToyConfig:
        steps: int = opt(10, "Optimizer steps.")
        rate: float = opt(0.5, "Learning rate.")
        layers: list[int] | None = opt(None, "Layer ids, e.g. 1,2,3.", default_text="all")
        budget: int | None = opt(None, "Bytes on storage (e.g. 64GB).", size=True)
        mode: str = opt("fast", "How to run.", choices=("fast", "exact"))
        check: bool = opt(True, "Check the result.")
        files: list[str] = opt(factory=list, help="Input files; repeat.", flag="--file")
        hidden: int = 3  # not an option: no opt()

    seen = {}

    @cli.click.command()
    @cli.config_options(ToyConfig)
    @cli.click.pass_context
    def toy(ctx, config_file, **options):
        recipe = load_recipe(config_file, ToyConfig) if config_file else {}
        seen["cfg"] = merge(ToyConfig, recipe, cli._given(ctx, **options))

    recipe = tmp_path / "toy.toml"
    recipe.write_text('steps = 7\nmode = "exact"\n')
    run = CliRunner().invoke(toy, ["--config", str(recipe), "--steps", "12", "--layers", "1,3", "--budget", "2GB",
                                   "--no-check", "--file", "a", "--file", "b"])
    assert run.exit_code == 0, run.output
    assert seen["cfg"] == ToyConfig(steps=12, rate=0.5, layers=[1, 3], budget=2 * 10**9, mode="exact", check=False,
                                    files=["a", "b"])
    helptext = CliRunner().invoke(toy, ["--help"], terminal_width=200).output
    assert "--steps INTEGER" in helptext and "[default: 10]" in helptext and "[default: all]" in helptext
    assert "--check / --no-check" in helptext and "--mode [fast|exact]" in helptext and "--hidden" not in helptext
    bad = CliRunner().invoke(toy, ["--mode", "slow"])
    assert bad.exit_code != 0 and "slow" in bad.output


@pytest.mark.parametrize("name, key, value", [("train", "seq_len", -5), ("extract", "shard_tokens", 0),
                                              ("eval", "max_new_tokens", -1)])
def test_a_bad_recipe_value_is_named_by_its_key_and_file(name, key, value, tmp_path):
    """A value out of range that came from a recipe is reported as that recipe's key, with the
    file, not as a flag the user never typed; the same value typed is reported as the flag."""
    from dflash_offline.options import load_recipe, merge
    from dflash_offline.runtime.errors import UserError

    cls = COMMANDS[name]
    required = {"train": 'cache = "c"\ntarget = "t"\nout = "o"\n', "extract": 'target = "t"\ndata = ["d"]\ncache = "c"\n',
                "eval": 'target = "t"\ndrafters = ["d"]\nprompts = "p"\n'}[name]
    recipe = tmp_path / "r.toml"
    recipe.write_text(required + f"{key} = {value}\n")
    cfg = merge(cls, load_recipe(recipe, cls), {})
    with pytest.raises(UserError) as e:
        cfg.validate()
    assert f"--config {recipe}: key '{key}' must be" in str(e.value) and f"--{key.replace('_', '-')}" not in str(e.value)
    typed = merge(cls, load_recipe(recipe, cls), {key: value})
    with pytest.raises(UserError, match=f"^--{key.replace('_', '-')} must be"):
        typed.validate()


REQUIRED = {"train": {"cache": "c", "target": "t", "out": "o"}, "extract": {"target": "t", "data": ["d"], "cache": "c"},
            "eval": {"target": "t", "drafters": ["d"], "prompts": "p"}, "generate": {"target": "t", "prompts": ["p"], "out": "o"},
            "prepare": {"target": "t", "data": ["d"], "out": "o"}}


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_every_declared_choice_is_checked_for_recipes(name, tmp_path):
    """A value outside a field's declared `choices` is refused by validate() (a recipe does not go
    through click), naming the recipe key and file and listing the choices; each choice passes."""
    from dflash_offline.options import cli_fields, load_recipe, merge
    from dflash_offline.runtime.errors import UserError

    cls = COMMANDS[name]
    fields = [f for f in cli_fields(cls) if f.metadata["choices"]]
    assert fields
    for f in fields:
        for ok in f.metadata["choices"]:
            # train_turns chooses among kept replies: it goes with --responses keep (refused otherwise).
            keep = {"responses": "keep"} if f.name == "train_turns" else {}
            # markov_head shapes DSpark's Markov head: it goes with --method dspark (refused otherwise).
            keep = {"method": "dspark"} if f.name == "markov_head" else keep
            merge(cls, {}, {**REQUIRED[name], **keep, f.name: ok}).validate()
        recipe = tmp_path / f"{f.name}.toml"
        recipe.write_text(f'{f.name} = "bogus"\n')
        with pytest.raises(UserError) as e:
            merge(cls, load_recipe(recipe, cls), REQUIRED[name]).validate()
        msg = str(e.value)
        assert msg.startswith(f"--config {recipe}: key '{f.name}' 'bogus': choose ") and all(c in msg for c in f.metadata["choices"]), msg


def test_every_train_option_belongs_to_one_component_with_its_own_checks():
    """TrainConfig is its components composed (train/config.py PARTS): each field is declared in
    exactly one of them, and each component checks its own fields (`check`), so a bad value is
    refused by the part that owns it, before the checks that span parts."""
    from dflash_offline.runtime.errors import UserError
    from dflash_offline.train.config import PARTS

    owners: dict[str, list[str]] = {}
    for part in PARTS:
        for f in dataclasses.fields(part):
            owners.setdefault(f.name, []).append(part.__name__)
        assert "check" in vars(part), f"{part.__name__} has no checks of its own"
    fields = {f.name for f in dataclasses.fields(TrainConfig) if f.init and not f.name.startswith("_")}
    assert fields == set(owners), fields ^ set(owners)
    assert all(len(o) == 1 for o in owners.values()), {k: o for k, o in owners.items() if len(o) > 1}
    cfg = TrainConfig(cache="c", target="t", out="o", seq_len=8, block_size=16)
    with pytest.raises(UserError, match="--seq-len must exceed --block-size"):
        cfg.validate()  # two parts' fields: the check that spans them
    with pytest.raises(UserError, match="--seq-len must exceed --block-size"):
        cfg.check()  # the composed config's check is all of them, not its first base's
    cfg = TrainConfig(cache="c", target="t", out="o", eval_every=5)
    with pytest.raises(UserError, match="--eval-every sets how often --eval-cache is measured"):
        cfg.validate()


def test_help_reads_in_sections_and_pipeline_order():
    """train --help: its options under headings by what they do, each once; the top level lists the
    commands in pipeline order with whole lines (no alphabetical list cut at "...")."""
    import re

    from conftest import run_cli
    from dflash_offline.train.config import TrainConfig

    r = run_cli(["train", "--help"])
    assert r.returncode == 0, r.stderr
    heads = [line[:-1] for line in r.stdout.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert heads[:9] == ["Recipe", "Run: what it reads and writes, where it runs", "Data: rows, anchors, order, the loader",
                         "Drafter and method: shape, target layers, start, DFlash or DSpark", "Loss",
                         "Optimizer and step", "Length and checkpoints", "Held-out estimate", "Progress and logs"], heads
    flags = re.findall(r"^  (--[a-z0-9-]+)", r.stdout[r.stdout.index("\nRecipe:"):], re.M)  # the options, not the text
    assert sorted(flags) == sorted(set(flags)) and len(flags) > 50  # every option once
    assert {f.metadata.get("flag") or "--" + f.name.replace("_", "-") for f in cli.cli_fields(TrainConfig)} <= set(flags)
    top = run_cli(["--help"]).stdout
    assert "Commands:" not in top and "..." not in top.split("\n", 1)[1]  # (the usage line has its own)
    order = [re.search(rf"^    {c} ", top, re.M).start() for c in ("prepare", "generate", "extract", "train", "export",
                                                                     "eval")]
    assert order == sorted(order)
