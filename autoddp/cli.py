"""The ``autoddp`` command: run a script once per device, config-free, with torchrun's flags.

Its flags are made from ``autoddp.options`` (the decorator's options that a command line can
carry, and the command's own), and its values are checked by building the same ``Options``
the decorator builds.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from autoddp import launch, options
from autoddp.command import arguments, flags_launch, runs, torchrun_flags
from autoddp.command.arguments import fail
from autoddp.launch import door
from autoddp.launch import plan as launch_plan

_CONTEXT = {
    "help_option_names": ["-h", "--help"],
    "ignore_unknown_options": True,
    "allow_interspersed_args": False,
}


class _Seconds(click.FloatRange):
    """A number of seconds in a range, never NaN (click's range lets NaN through: it compares
    false to every bound); ``inf`` only where ``infinite`` (it means "never")."""

    def __init__(self, *, infinite: bool, **bounds: Any) -> None:
        super().__init__(**bounds)
        self.infinite = infinite

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds) or (math.isinf(seconds) and not self.infinite):
            self.fail(f"{value!r} is not a {'' if self.infinite else 'finite '}number of seconds", param, ctx)
        return seconds


#: Flags whose values are checked more narrowly than their type says (click's own one-line error).
_RANGES = {
    "max_restarts": click.IntRange(min=0),
    "monitor_interval": _Seconds(min=0.01, infinite=False),
    "node_rank": click.IntRange(min=0),
    "master_port": click.IntRange(1, 65535),
    "hang_report": _Seconds(min=0, infinite=True),
    "timeout": _Seconds(min=0, min_open=True, infinite=True),
}


#: The shells click writes the command's completion script for (torchrun's: bash, zsh, tcsh).
_SHELLS = ("bash", "zsh", "fish")


def _print_completion(context: click.Context, _: click.Parameter, shell: str | None) -> None:
    """torchrun's ``--print-completion SHELL``: the command's completion script on stdout, then exit."""
    if shell is None or context.resilient_parsing:
        return
    if shell not in _SHELLS:
        fail(
            f"--print-completion {shell!r}: autoddp's completion scripts (click's) are for "
            f"{', '.join(_SHELLS)}; use one of those"
        )
    from click.shell_completion import get_completion_class

    click.echo(get_completion_class(shell)(main, {}, "autoddp", "_AUTODDP_COMPLETE").source())
    context.exit()


def _flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Every flag of ``autoddp.options``, in its order (click lists them as applied, last first)."""
    for flag in reversed(options.command_flags()):
        settings = {**flag.click, **({"type": _RANGES[flag.name]} if flag.name in _RANGES else {})}
        shown = "[default:" not in flag.help and not any(flag.default is v for v in (None, False, ()))
        default = None if flag.default == () else flag.default  # (click would read () as text)
        envvar = torchrun_flags.environment_name(flag.flags)  # PET_NPROC_PER_NODE, as torchrun reads it
        command = click.option(
            *flag.flags,
            flag.name,
            default=default,
            show_default=shown,
            help=flag.help,
            envvar=envvar,
            **settings,
        )(command)
    return command


@click.command("autoddp", cls=arguments.OneLineCommand, context_settings=_CONTEXT)
@_flags
@click.argument("script", required=False, metavar="SCRIPT")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
@click.version_option(package_name="autoddp", prog_name="autoddp")
@click.option(
    "--print-completion",
    "--print_completion",
    metavar="bash|zsh|fish",
    is_eager=True,
    expose_value=False,
    callback=_print_completion,
    help="Print the command's shell completion script to stdout and exit, as torchrun's.",
)
def main(script: str | None, script_args: tuple[str, ...], **flags: Any) -> None:
    """Run SCRIPT once per device, each process ready for torch.distributed.

    An unmodified single-GPU script becomes distributed: the model its optimizer trains is
    wrapped in DDP, its shuffled DataLoaders are sharded (ordered ones, for evaluation, stay
    whole) and torch.save to a path is written once, by rank 0 (--no-capture turns this off).
    A torchrun-style script that sets up torch.distributed itself is left alone: every process
    gets every variable torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT, ...) with torchrun's values; ARGS reach
    the script untouched. Functions decorated with @autoddp.distributed run in place in each
    process. A failing process stops all of them and the command exits non-zero with that
    process's traceback. torchrun's flags work as in torchrun, or stop with one line saying
    what autoddp does instead.

    `autoddp env [-n N] [--master HOST:PORT]` prints a report to paste into a bug report:
    versions, GPUs, the detected launcher and why, and what the decorator and this command
    would do here (`autoddp env --help`).
    """
    nproc, endpoint, master = flags["nproc"], flags["rdzv_endpoint"], flags_launch.master_of(flags)
    if script == "env" and not flags["as_module"] and not os.path.exists("env"):
        from autoddp.command.env import env

        before = [
            *(["-n", nproc] if nproc else []),
            *(["--master", master or endpoint] if master or endpoint else []),
        ]
        env.main([*before, *script_args], prog_name="autoddp env")  # (exits)
    arguments.refuse_environment(os.environ)
    arguments.choice("--rdzv-backend", flags["rdzv_backend"], launch_plan.RDZV_BACKENDS)
    arguments.choice("--start-method", flags["start_method"], ("auto", "fork", "spawn"))
    arguments.check_target(
        script, flags["as_module"], [o for p in main.params for o in p.opts + p.secondary_opts]
    )
    request, target = flags_launch.launch_of(flags, script, script_args)
    line = arguments.process_line(nproc, request.nproc, script_args)
    if line and not flags["quiet"] and launch.way(request, target) == door.WORKERS:
        click.echo(line, err=True)
    sys.exit(runs.run(request, target))


if __name__ == "__main__":
    main()
