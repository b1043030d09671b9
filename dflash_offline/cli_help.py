"""How the command line's --help reads: a stage command's options in sections by what they do (the
components of its config: data, drafter and method, loss, optimizer, ...), and the top level's
commands in pipeline order with their lines whole (cli.py builds the commands)."""

from __future__ import annotations

import click

# Help's section of each component of a config (the dataclass that declares the field), by name.
SECTION_TITLES = {"RunOptions": "Run: what it reads and writes, where it runs",
                  "DataOptions": "Data: rows, anchors, order, the loader",
                  "DrafterOptions": "Drafter and method: shape, target layers, start, DFlash or DSpark",
                  "LossOptions": "Loss", "OptimizerOptions": "Optimizer and step",
                  "CheckpointOptions": "Length and checkpoints", "HeldOutOptions": "Held-out estimate",
                  "ReportOptions": "Progress and logs", "SamplingOptions": "Sampling"}


def section_of(cls: type, f) -> str:
    """The help section of field `f` of config `cls`: the component dataclass that declares it."""
    for base in cls.__mro__:
        if f.name in vars(base).get("__annotations__", {}):
            return SECTION_TITLES.get(base.__name__, "Options")
    return "Options"


class SectionedCommand(click.Command):
    """A command whose --help lists its options in sections, by what they do (the components of
    its config), where a flat list of fifty options was unreadable."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list] = {}
        for p in self.get_params(ctx):
            rec = p.get_help_record(ctx)
            if rec is not None:
                sections.setdefault(getattr(p, "section", "Options"), []).append(rec)
        for title, rows in sections.items():
            with formatter.section(title):
                formatter.write_dl(rows)



# The commands in pipeline order, then those around them (the order --help lists them in).
PIPELINE = ("prepare", "generate", "extract", "train", "export", "eval", "plan", "inspect", "status", "verify", "demo")


class PipelineGroup(click.Group):
    """The top level: commands in pipeline order (not alphabetical), their help lines whole."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.commands, key=lambda c: PIPELINE.index(c) if c in PIPELINE else len(PIPELINE))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        pass  # the group's own help lists them, in order and whole (an alphabetical list cut at "..." read worse)
