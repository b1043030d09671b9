"""Option values: TOML recipes read and checked, merged with the command line, and the range
checks every stage's `validate()` runs.

A recipe (`stages/<deployment>/<stage>.toml`) uses the config dataclass's field names; a wrong key
or type is one line naming the file and the key, and a value out of range one line naming the
command-line option, before any work starts. Command-line values win over the recipe, the recipe
over the defaults (`merge`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import tomllib
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from dflash_offline.runtime.errors import UserError

# Sizes and counts beyond 2^50 are typos; numpy and torch would overflow on them mid-run.
_LARGEST = 1 << 50


def as_flag(name: str) -> str:
    """An option's name as its flag (`max_len` -> `--max-len`): how a message names a value when
    no config says where it came from (`where` does when one does)."""
    return "--" + name.replace("_", "-")


def opt(default: Any = None, help: str = "", *, factory=None, flag: str | None = None,
        choices: tuple[str, ...] | None = None, size: bool = False, is_flag: bool = False,
        default_text: str | None = None, resume: bool = False, old: tuple[str, ...] = ()) -> Any:
    """A config field that is also a command-line option (cli.py builds the option from it).

    help: the option's help, without its default (added from the field's default, or
    `default_text` where the default is a rule in words, e.g. "the DFlash rule"); flag: the option's
    spelling where it is not --field-name (a recipe uses the field's name); choices: the values it
    takes; size: a byte size (64GB, 512MiB); is_flag: a plain on-switch (no --no- form); resume:
    part of a training run's identity (a checkpoint resumes only with the same value); old: the
    field's earlier names, still read from recipes, flags and checkpoints with a one-line warning
    (`renamed`)."""
    meta = {"help": help, "flag": flag, "choices": choices, "size": size, "is_flag": is_flag,
            "default_text": default_text, "resume": resume, "old": tuple(old)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a config dataclass that are command-line options: its own in order, then
    those it inherits (options shared by several commands, e.g. sampling.SamplingOptions)."""
    own = vars(cls).get("__annotations__", {})
    fields = [f for f in dataclasses.fields(cls) if "help" in f.metadata]
    return [f for f in fields if f.name in own] + [f for f in fields if f.name not in own]


def flag_of(f: dataclasses.Field) -> str:
    """The option a field is set by: its own spelling, or --field-name."""
    return f.metadata.get("flag") or as_flag(f.name)


def renamed(cls: type) -> dict[str, str]:
    """{earlier name: field name} of a config dataclass's renamed fields (opt's `old`)."""
    return {o: f.name for f in dataclasses.fields(cls) for o in f.metadata.get("old", ())}


def under_current_names(cls: type, values: dict[str, Any], spell=None, where: str = "") -> dict[str, Any]:
    """`values`, keyed by field names or a field's earlier names (opt's `old`), with each earlier
    name moved to its field's: the one reading of `old` that flags (cli.py), recipes
    (`load_recipe`) and a checkpoint's saved config (train/resume.py) share.

    spell(name): how the source writes a name (`--num-layers`; a recipe's `key 'num_layers'`, after
    `where`, "--config FILE: "), for one warning line per earlier name used and the one-line refusal
    of both names at once. Without it (a checkpoint's saved config) the move is quiet, and a config
    saved under both names keeps the current one's value."""
    out = dict(values)
    for was, name in renamed(cls).items():
        if was not in out:
            continue
        value = out.pop(was)
        if name in out:
            if spell is None:
                continue
            raise UserError(f"{where}{spell(was)} and {spell(name)} are one option ({spell(was)} is its earlier "
                            f"name); give {spell(name)} only")
        if spell is not None:
            warn_renamed(where + spell(was), spell(name))
        out[name] = value
    return out


_warned: set[str] = set()


def warn_renamed(was: str, now: str) -> None:
    """One line on stderr, once per process and name: an earlier name was used (it still works)."""
    if was not in _warned:
        _warned.add(was)
        print(f"warning: {was} is now {now} (same meaning); the old name still works but will be removed",
              file=sys.stderr, flush=True)


class Recipe(dict):
    """A recipe's values by field name, and the file they were read from (`load_recipe`)."""

    path: Path | None = None
    written: dict[str, str] = {}  # field name -> the key as the file spells it (an earlier name, dashes)


@dataclass(frozen=True)
class Origins:
    """Where a config's values came from, for messages about them (`where`, `also`): the recipe
    file and the key it spells each of its values under. Values typed on the command line, and
    defaults, have no entry: a message names them by their flag."""

    recipe: Path | None = None
    keys: dict[str, str] = field(default_factory=dict)  # field name -> the key as the recipe spells it

    def of(self, name: str) -> str | None:
        return f"--config {self.recipe}: key {self.keys[name]!r}" if name in self.keys else None

    def without(self, names) -> "Origins":
        """These origins, less the values `names` (set anew, by the program: named by their flags)."""
        return Origins(self.recipe, {k: v for k, v in self.keys.items() if k not in names})


@dataclass
class Configured:
    """The base of every command's config: built knowing where its values came from (`merge` and
    `replaced` pass `origins`). `origins` is a constructor argument only, not a field: not an
    option, not in `dataclasses.asdict`, so never in a checkpoint's saved settings."""

    origins: InitVar[Origins | None] = None

    def __post_init__(self, origins: Origins | None) -> None:
        self._origins = origins or Origins()


def where(cfg, name: str) -> str:
    """How an option got its value, for a message about it: the recipe key and file it was read
    from (`merge` records them), else its flag (the one the user typed, or would type)."""
    origins = getattr(cfg, "_origins", None)
    origin = origins.of(name) if origins is not None else None
    if origin:
        return origin
    fields = {f.name: f for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else {}
    return flag_of(fields[name]) if name in fields else as_flag(name)


def also(cfg, name: str) -> str:
    """`where`, for a second option named in a message about a first: a recipe key without its
    file again ("key 'block_size'"), a flag as typed."""
    origin = where(cfg, name)
    origins = getattr(cfg, "_origins", None)
    recipe = f"--config {origins.recipe if origins is not None else None}: "
    return origin[len(recipe):] if origin.startswith(recipe) else origin


def replaced(cfg, **changes):
    """dataclasses.replace that keeps where the unchanged values came from (`where`)."""
    if not isinstance(cfg, Configured):
        return dataclasses.replace(cfg, **changes)
    return dataclasses.replace(cfg, origins=cfg._origins.without(changes), **changes)


def _integer(cfg, name: str) -> int | None:
    """The option's value, refused in one line unless it is an integer (or None)."""
    v = getattr(cfg, name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise UserError(f"{where(cfg, name)} must be an integer, got {v!r}")
    if v is not None and abs(v) > _LARGEST:
        raise UserError(f"{where(cfg, name)} {v} is too large (at most 2^50 = {_LARGEST})")
    return v


def check_positive(cfg, *names: str) -> None:
    """Each named integer option is > 0 (None, where an option allows it, means unset)."""
    for name in names:
        v = _integer(cfg, name)
        if v is not None and v <= 0:
            raise UserError(f"{where(cfg, name)} must be positive, got {v}")


def check_at_least(cfg, name: str, low: int, why: str) -> None:
    """An integer option >= low (None = unset); `why` says what the low end means."""
    v = _integer(cfg, name)
    if v is not None and v < low:
        raise UserError(f"{where(cfg, name)} must be >= {low} ({why}), got {v}")


def check_number(cfg, name: str, low: float, high: float = math.inf, *, open_low: bool = False,
                 open_high: bool = False, must: str, why: str = "") -> None:
    """A float option within [low, high] (ends open as asked; None = unset); NaN and non-numbers are
    refused. `must` names the range in words ("positive", "in [0, 1)"), `why` what goes wrong outside."""
    v = getattr(cfg, name)
    if v is None:
        return
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
    if not (ok and (v > low if open_low else v >= low) and (v < high if open_high else v <= high)):
        raise UserError(f"{where(cfg, name)} must be {must}, got {v!r}" + (f" ({why})" if why else ""))


def check_choices(cfg) -> None:
    """Every option field declared with `choices` holds one of them (None = unset). The command line
    enforces them too; recipes and configs built in code reach only this check."""
    for f in dataclasses.fields(cfg):
        choices, v = f.metadata.get("choices"), getattr(cfg, f.name)
        if choices and v is not None and v not in choices:
            raise UserError(f"{where(cfg, f.name)} {v!r}: choose {', '.join(choices[:-1])} or {choices[-1]}")


def parse_int_list(text: str | list | None, option: str = "--capture-layers") -> list[int] | None:
    """`"1,9,17"` or `[1, 9, 17]` -> [1, 9, 17]; None or "" or "auto" -> None."""
    if text is None or (isinstance(text, str) and text.strip() in ("", "auto")):
        return None
    if isinstance(text, list):
        items = text
    else:
        items = [s for s in str(text).replace(" ", "").split(",") if s]
    try:
        return [int(s) for s in items]
    except (TypeError, ValueError):
        raise UserError(f"{option} {text!r}: expected comma-separated integers like 1,9,17,25,33") from None


_KIND = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
         "list[int]": "a list of integers (or a string like \"1,2,3\")", "list[str]": "a string or a list of strings"}


def _recipe_value(path: Path, key: str, value: Any, annotation: str) -> Any:
    """`value` checked against the field's annotation (the dataclasses' string annotations: a few
    plain forms), so a wrong type is one line naming the file and key here, not a TypeError in a
    worker after the work began. Integers are accepted where a number is expected."""
    kinds = [k.strip() for k in annotation.split("|") if k.strip() != "None"]
    for kind in kinds:
        if kind == "bool" and isinstance(value, bool):
            return value
        if isinstance(value, bool):
            continue
        if kind == "int" and isinstance(value, int):
            return value
        if kind == "float" and isinstance(value, (int, float)):
            return float(value)
        if kind == "str" and isinstance(value, str):
            return value
        if kind == "list[int]" and (isinstance(value, str) or (isinstance(value, list) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value))):
            return value
        if kind == "list[str]" and (isinstance(value, str) or (isinstance(value, list) and all(
                isinstance(v, str) for v in value))):
            return value
        if kind not in _KIND:  # a form this check does not know: leave it to the field's own validation
            return value
    want = " or ".join(_KIND[k] for k in kinds)
    got = f"{type(value).__name__} {value!r}" if not isinstance(value, (dict, list)) or len(repr(value)) < 60 \
        else type(value).__name__
    raise UserError(f"--config {path}: key {key!r} must be {want}, got {got}")


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value) -> int:
    """A size in bytes: 123456, 64GB, 1.5T, 512MiB (k/M/G/T are powers of 1000, KiB/MiB/GiB/TiB of
    1024); ValueError naming the examples otherwise. The command line and recipes read the same."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{value!r} is not a size (examples: 2000000000, 64GB, 1.5T, 512MiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def load_recipe(path: str | Path, cls: type, ignore: type | None = None) -> Recipe:
    """Read a TOML recipe into {field: value}; unknown keys are an error naming the key and file.
    Keys that are fields of `ignore` (not of `cls`) are dropped: `plan` reads extract's recipe
    (the only caller that passes `ignore`, with ExtractConfig)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"--config {path}: file not found") from None
    except UnicodeDecodeError:
        raise UserError(f"--config {path}: not a text file (not UTF-8); give a TOML recipe") from None
    except OSError as e:
        raise UserError(f"--config {path}: cannot read it ({e.strerror or e}); give a TOML recipe file") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"--config {path}: not valid TOML ({e})") from None
    # The options only: a field without one (train's final_checkpoint, for benchmarks) is not a
    # setting a user makes, and a recipe that set it would change a run no --help describes.
    fields = {f.name: f for f in cli_fields(cls)}
    skip = {f.name for f in dataclasses.fields(ignore)} | set(renamed(ignore)) if ignore is not None else set()
    written = {key.replace("-", "_"): key for key in raw}  # a name -> the key as the file spells it
    named = under_current_names(cls, {key.replace("-", "_"): value for key, value in raw.items()},
                                lambda name: f"key {written.get(name, name)!r}", f"--config {path}: ")
    for was, name in renamed(cls).items():  # a value's messages name the key as written
        if was in written and name not in written:
            written[name] = written[was]
    out: dict[str, Any] = {}
    for name, value in named.items():
        key = written[name]
        if name in skip and name not in fields:
            continue
        if name not in fields:
            # An option spelled otherwise than its field (eval's --drafter fills `drafters`).
            spelled = {flag_of(f)[2:].replace("-", "_"): f.name for f in cli_fields(cls) if f.metadata.get("flag")}
            if name in spelled:
                raise UserError(f"--config {path}: unknown key {key!r}: in a recipe the option --{name} is the key "
                                f"{spelled[name]!r}")
            close = difflib.get_close_matches(name, sorted(fields), n=3, cutoff=0.6)
            raise UserError(
                f"--config {path}: unknown key {key!r}; "
                + (f"did you mean {' or '.join(map(repr, close))}?" if close else
                   f"the keys are the command's options with _ for - (dflash-offline "
                   f"{cls.__name__.removesuffix('Config').lower()} --help lists them)")
                + (" (the other keys of an extract recipe are ignored)" if ignore is not None else "")
            )
        if fields[name].metadata.get("size") and isinstance(value, str):  # "64GB", as --max-bytes takes it
            try:
                value = parse_size(value)
            except ValueError as e:
                raise UserError(f"--config {path}: key {key!r}: {e}") from None
        out[name] = _recipe_value(path, key, value, str(fields[name].type))
    # Relative paths in a recipe are relative to the directory the command runs in, like CLI paths.
    for name, value in out.items():
        kind = str(fields[name].type)
        if isinstance(value, str) and kind.startswith("list[str]"):  # one path where a list of paths is expected
            out[name] = [value]
        elif "list[int]" in kind:  # ids as a list or as "1,9,17", as the option takes them
            out[name] = parse_int_list(value, option=f"--config {path}: key {written[name]!r}")
    recipe = Recipe(out)
    recipe.path, recipe.written = path, written
    return recipe


def merge(cls: type, recipe: dict[str, Any], cli_given: dict[str, Any]):
    """Defaults < recipe < values given on the command line. The config remembers which values
    came from the recipe (`where` names their key and file in a message about them)."""
    values = {**recipe, **cli_given}
    path = getattr(recipe, "path", None)
    if path is None or not issubclass(cls, Configured):  # a plain dataclass: messages name flags only
        return cls(**values)
    keys = getattr(recipe, "written", {})
    return cls(**values, origins=Origins(path, {k: keys.get(k, k) for k in recipe if k not in cli_given}))
