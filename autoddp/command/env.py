"""``autoddp env``: the report to paste into a bug report, as a click command of its own."""

from __future__ import annotations

import click

from autoddp.command import arguments, report
from autoddp.command.arguments import fail
from autoddp.core.errors import ConfigurationError


@click.command(
    "autoddp env", cls=arguments.OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.option(
    "-n",
    "--nproc-per-node",
    "--nproc_per_node",
    "--nproc",
    "nproc",
    metavar="N",
    help="The processes the report is for, as the run's -n (default: one per GPU, else one).",
)
@click.option(
    "--master",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "master",
    metavar="HOST:PORT",
    help="Node 0's address: the report names this machine's network interface towards it.",
)
def env(nproc: str | None, master: str | None) -> None:
    """Print versions (torch with its support verdict), GPUs, the detected launcher and why, and
    what the decorator and the command would do here: one block to paste into a bug report.

    A script named env runs as ./env.
    """
    try:
        asked = arguments.process_count(nproc) if nproc else None
        click.echo(report.describe(master=master, nproc=asked))
    except ConfigurationError as error:
        fail(str(error))
