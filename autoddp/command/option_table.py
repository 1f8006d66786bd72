"""The option table of README.md and docs/command.md, made from the one list of options
(``autoddp.options``): the decorator's name, the command's flags, the default and the help of each."""

from __future__ import annotations

import dataclasses
from typing import Any

from autoddp import options


def readme_table() -> str:
    """The option table of README.md and docs/command.md, made from ``options``
    (``tests/unit/test_options.py`` compares them)."""
    rows = ["| `@distributed(...)` | `autoddp` flag | default | what it does |", "|---|---|---|---|"]
    for field in dataclasses.fields(options.Options):
        meta = field.metadata
        cells = [f"`{field.name}=`", _flag_cell(meta["flags"]), _default_cell(field.default, meta["help"])]
        rows.append(f"| {' | '.join(cells)} | {_help_cell(meta['help'])} |")
    for flag in options.COMMAND_ONLY:
        cells = ["", _flag_cell(flag.flags), _default_cell(flag.default, flag.help)]
        rows.append(f"| {' | '.join(cells)} | {_help_cell(flag.help)} |")
    return "\n".join(rows)


def _flag_cell(flags: tuple[str, ...]) -> str:
    return ", ".join(f"`{f}`" for f in flags if "_" not in f) if flags else "(decorator only)"


def _default_cell(default: Any, text: str) -> str:
    said = text.partition("  [default: ")[2]
    return said.rstrip("]") if said else f"`{default!r}`"


def _help_cell(text: str) -> str:
    return text.split("  [default:")[0].replace("|", "\\|")
