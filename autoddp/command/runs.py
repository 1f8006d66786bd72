"""The command's two ways to run a script: workers on this machine, or this node's share of many.

Each returns the command's exit status and turns what went wrong into lines a user can act on:
a usage problem found at start (a taken port) as one error line, a worker's failure as the line
that names its rank (the worker printed its own traceback above it, when it had one).
"""

from __future__ import annotations

import dataclasses
import signal

import click

from autoddp.command.arguments import as_flags, fail
from autoddp.core import environment
from autoddp.core._warn import one_line, say
from autoddp.core.errors import ConfigurationError, NodesError, RemoteTraceback, WorkerError
from autoddp.in_rank.hang import record as hang_record
from autoddp.in_rank.run_folder import transport
from autoddp.launch import in_place, local, nodes
from autoddp.launch import output as launch_output
from autoddp.launch import plan as launch_plan
from autoddp.launch.contract import DEFAULT_ROLE


@dataclasses.dataclass(frozen=True)
class Run:
    """What the command starts, however it starts it: ``nproc`` processes of ``argv`` (the
    script runner's flags, the script and its arguments), their output, restarts and watch."""

    nproc: int
    argv: list[str]
    output: launch_output.Output
    max_restarts: int = 0
    monitor_interval: float = 0.1
    hang_report: float = hang_record.DEFAULT_SECONDS
    role: str = DEFAULT_ROLE
    start_method: str = "auto"  # (one machine)
    store: tuple[str, int | None] = (environment.LOOPBACK, None)  # (one machine) where its store listens


def run_nodes(plan: launch_plan.Nodes, run: Run) -> int:
    """This machine's share of a multi-node run, through elastic's agent and rendezvous."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    try:
        with transport.run_folder() as folder:
            nodes.run_agent(
                plan,
                run.nproc,
                ["-m", "autoddp.in_rank.worker.script", *run.argv],
                folder=folder,
                output=run.output,
                max_restarts=run.max_restarts,
                monitor_interval=run.monitor_interval,
                hang_report=run.hang_report,
                role=run.role,
            )
    except RendezvousTimeoutError:
        fail(
            f"the other machines did not all join the rendezvous at {plan.endpoint} within its join timeout "
            f"({plan.join_timeout:g} s): start autoddp on every machine, or raise --join-timeout SECONDS",
            code=1,
        )
    except SignalException as error:
        say(f"{error.sigval.name} received: stopped all workers on this node")
        return 128 + int(error.sigval)
    except BaseException as error:
        if isinstance(error, ConfigurationError) and getattr(error, "autoddp_rank", None) is None:
            fail(as_flags(str(error)))  # before anything started: node 0's address, say
        return _failed(error)
    return 0


def run_here(run: Run) -> int:
    """Run the script once per process on this machine; the exit status of the command."""
    env = environment.detect()
    if env.launched:
        # Already one process of a distributed run (srun, mpirun, torchrun): no second layer.
        try:
            in_place.exec_script(run.argv, env.world())
        except ConfigurationError as error:
            fail(str(error))
    try:
        local.launch_script(
            run.argv,
            nproc=run.nproc,
            max_restarts=run.max_restarts,
            poll_seconds=run.monitor_interval,
            output=run.output,
            hang_report=run.hang_report,
            start_method=run.start_method,
            role=run.role,
            store=run.store,
        )
    except BaseException as error:
        if isinstance(error, ConfigurationError) and getattr(error, "autoddp_rank", None) is None:
            fail(as_flags(str(error)), code=1)  # found before any worker ran (a taken port): no traceback
        return _failed(error)
    return 0


def _failed(error: BaseException) -> int:
    """The command's exit status for a run that failed, after the lines that say how."""
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C: the workers are stopped and one line was printed
        return 128 + int(signal.SIGINT)
    if isinstance(error, SystemExit):  # a rank called sys.exit(code): the launcher said so in one line
        return error.code if isinstance(error.code, int) else 1
    if isinstance(error, (WorkerError, NodesError)):  # no traceback to point at
        say(str(error))
    elif isinstance(error, Exception) and getattr(error, "autoddp_node", None) is not None:
        if isinstance(error.__cause__, RemoteTraceback):  # printed on that node only: shown here
            click.echo(str(error.__cause__).strip("\n"), err=True)
        say(f"{one_line(error)} (on node {error.autoddp_node})")
    elif isinstance(error, Exception):  # a worker failed: it printed its own traceback
        say(f"{one_line(error)} (its traceback is above)")
    else:
        raise error
    _notes(error)
    return 1


def _notes(error: BaseException) -> None:
    """What autoddp found out about a failure (the late rank a rank aborted waiting for, ...)."""
    for note in getattr(error, "__notes__", ()):
        if note.startswith("autoddp:"):
            click.echo(note, err=True)
