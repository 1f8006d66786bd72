"""The command's arguments checked before anything starts, every problem said in one line.

A usage error is one line on stderr that names the problem and the fix, then exit status 2:
click's own (a bad choice, a missing value) included, which it would print as a four-line block.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

import click

from autoddp.command import torchrun_flags
from autoddp.core._warn import say
from autoddp.core.environment import hardware


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr naming the problem and the fix, then exit (2: usage error)."""
    say(f"error: {message}")
    sys.exit(code)


class OneLineCommand(click.Command):
    """A click command whose usage errors are one line, like every other error of autoddp's."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as error:
            text = error.format_message().rstrip(".")
            fail(f"{text[:1].lower()}{text[1:]} (see {self.name} --help)")  # autoddp, autoddp env


def as_flags(message: str) -> str:
    """A check's message in the command's words: ``max_restarts=-1`` as ``--max-restarts -1``."""
    from autoddp import options

    for flag in options.command_flags():
        spelled = next(f for f in flag.flags if f.startswith("--") and "_" not in f).split("/")[0]
        message = re.sub(rf"\b{flag.name}=(?=[,\s]|$)", spelled, message)
        message = re.sub(rf"\b{flag.name}=", spelled + " ", message)
    return message


def refuse_environment(environ: Mapping[str, str]) -> None:
    """A torchrun ``PET_`` variable for a flag autoddp refuses is a usage error, like the flag."""
    refused = torchrun_flags.refused_in(environ)
    if refused:
        fail(refused)


def choice(flag: str, value: str | None, allowed: tuple[str, ...]) -> str | None:
    """``value`` if it is one of ``allowed`` (or None); else a usage error, with torchrun's own
    values that autoddp does not take named as such."""
    if value is None or value in allowed:
        return value
    instead = torchrun_flags.REFUSED_VALUES.get((flag, value))
    if instead:
        fail(f"{flag} {value} is torchrun's, not taken by autoddp: {instead}")
    fail(f"{flag} {value!r} is not one of {', '.join(allowed)}")


def process_count(value: str | None) -> int:
    """The number of processes ``--nproc-per-node`` asks for here (one per GPU by default)."""
    gpus = hardware.gpu_count()
    if value is None:  # autoddp's default: one per GPU, else one process
        return gpus or 1
    if value == "gpu":
        if gpus == 0:
            fail("--nproc-per-node=gpu but no GPU is visible; give a number, e.g. -n 2")
        return gpus
    if value in ("auto", "cpu"):  # as torchrun: auto is one per GPU, else one per core; cpu one per core
        return gpus if value == "auto" and gpus else hardware.cpu_count()
    if ("--nproc-per-node", value) in torchrun_flags.REFUSED_VALUES:  # xpu
        choice("--nproc-per-node", value, ())
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        fail(f"--nproc-per-node={value!r} is not a positive whole number (or 'auto', 'gpu', 'cpu')")
    if gpus and count > gpus:
        fail(f"--nproc-per-node={count} but only {gpus} GPU(s) are visible; use at most {gpus}")
    return count


_COUNT_FLAGS = ("-n", "--nproc-per-node", "--nproc_per_node", "--nproc")


def process_line(value: str | None, count: int, script_args: tuple[str, ...]) -> str | None:
    """The line that says how many processes run and why, when the user did not choose; or None."""
    at = next((i for i, a in enumerate(script_args) if a.split("=", 1)[0] in _COUNT_FLAGS), None)
    misplaced = None if at is None else " ".join(script_args[at : at + (1 if "=" in script_args[at] else 2)])
    after = (
        f"; {misplaced!r} after the script is the script's own argument: put autoddp's options "
        "before the script"
        if misplaced
        else ""
    )
    if value not in (None, "auto", "gpu", "cpu") and not after:
        return None
    gpus = hardware.gpu_count()
    if value == "cpu" or (value == "auto" and gpus == 0):
        why = f"one per CPU core (--nproc-per-node {value}, as torchrun)" + after
    elif gpus == 0:
        why = "no GPU found" + (after or ": pass -n N before the script for N processes on the CPU")
    else:
        why = ("one per visible GPU" if gpus > 1 else "on the one visible GPU") + after
    return f"autoddp: {count} process{'es' if count > 1 else ''}, {why}"


def check_target(target: str | None, as_module: bool, known: list[str]) -> None:
    """The script (or module) exists; a flag in its place is an unknown option, named as such."""
    if target is None:
        fail("no script given: autoddp [OPTIONS] script.py [ARGS]... (see autoddp --help)")
    if target.startswith("-") and not os.path.exists(target):
        refused = torchrun_flags.refusal(target)
        if refused:
            fail(refused)
        close = difflib.get_close_matches(target.split("=", 1)[0], known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        fail(f"unknown option {target!r}{hint} (autoddp's options come before the script; see --help)")
    if as_module:
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            fail(f"no module named {target!r} importable from {os.getcwd()}; check the name and folder")
    elif not os.path.exists(target):
        fail(f"no such script: {target!r} (looked in {os.getcwd()})")
    elif os.path.isdir(target) and not os.path.exists(os.path.join(target, "__main__.py")):
        fail(f"{target!r} is a folder without __main__.py; give the script to run inside it")
