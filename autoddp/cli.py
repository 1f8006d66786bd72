"""The ``autoddp`` command: run a script once per device, config-free, with torchrun's flags.

Its flags are made from ``autoddp.options`` (the decorator's options that a command line can
carry, and the command's own), and its values are checked by building the same ``Options``
the decorator builds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from autoddp import launch, options
from autoddp.command import arguments, runs, torchrun_flags
from autoddp.command.arguments import fail
from autoddp.core.errors import ConfigurationError
from autoddp.launch import door
from autoddp.launch import plan as launch_plan
from autoddp.launch.request import Script

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
    master, master_addr, master_port = flags["master"], flags["master_addr"], flags["master_port"]
    given = (  # one machine: its store's place, and the option that named it
        master or flags["rdzv_endpoint"],
        master_addr,
        master_port,
        "master" if master else "rdzv_endpoint",
    )
    if master is None and master_addr is not None:
        master = f"{master_addr}:{master_port or 29500}"
    nproc, endpoint = flags["nproc"], flags["rdzv_endpoint"]
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
    count = arguments.process_count(nproc)
    try:
        plan = launch_plan.plan(
            flags["nnodes"],
            flags["node_rank"],
            master,
            endpoint,
            flags["rdzv_backend"],
            flags["rdzv_id"],
            flags["rdzv_conf"],
            flags["local_addr"],
            flags["join_timeout"],
        )
        store = launch_plan.one_node_store(*given)  # (before the options: it names --rdzv-endpoint)
        settings = _options(flags, count, master)  # (after the plan: it names --rdzv-endpoint)
        settings.output.shown(count)  # local ranks: the same on one machine and on each of several
    except ConfigurationError as error:
        fail(arguments.as_flags(str(error)))
    request = settings.request(
        nodes=plan, store=store, monitor_interval=flags["monitor_interval"], role=flags["role"]
    )
    argv = [*_runner_flags(settings), *(["--module"] if flags["as_module"] else []), script, *script_args]
    target = Script(tuple(argv))
    line = arguments.process_line(nproc, count, script_args)
    if line and not flags["quiet"] and launch.way(request, target) == door.WORKERS:
        click.echo(line, err=True)
    sys.exit(runs.run(request, target))


def _options(flags: dict[str, Any], count: int, master: str | None) -> options.Options:
    """The decorator's ``Options`` from the command's flags: the same checks, the same defaults."""
    shared = {f.name for f in dataclasses.fields(options.Options)} & set(flags)
    values = {name: flags[name] for name in shared}
    endpoint = flags["rdzv_endpoint"]
    values.update(
        nproc=count,
        fsdp_blocks=tuple(b.strip() for b in (flags["fsdp_blocks"] or "").split(",") if b.strip()),
        ddp={"find_unused_parameters": True} if flags["find_unused_parameters"] else None,
        master=master or endpoint,
        rdzv_backend=flags["rdzv_backend"] or ("c10d" if endpoint and not master else None),
    )
    return options.Options(**values)


def _runner_flags(settings: options.Options) -> list[str]:
    """What the workers' script runner (``in_rank.worker.script``) is told: capture, the run's options."""
    run = dataclasses.asdict(dataclasses.replace(settings.run_options, capture=True))
    default = dataclasses.asdict(options.Options().run_options)
    return [
        *([] if settings.capture else ["--no-capture"]),
        *(["--run-options", json.dumps(run)] if run != default else []),
        *(["--timeout", repr(settings.timeout)] if settings.timeout is not None else []),
    ]


if __name__ == "__main__":
    main()
