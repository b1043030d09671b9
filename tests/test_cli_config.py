"""The CLI and the config dataclasses tell one story: every option of a stage's command is a field
of its config, and every literal `[default: X]` in an option's help is that field's default, so a
default changed in one place cannot silently disagree with the other."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dflash_offline import cli
from dflash_offline.config import EvalConfig, ExtractConfig, GenerateConfig, PlanConfig, PrepareConfig, TrainConfig

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
        if p.name in NOT_FIELDS:
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
        if p.name in NOT_FIELDS or flag == p.name:
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
