"""The command's run of a script through the one door (``autoddp.launch.run``), in its own words.

It returns the command's exit status and turns what went wrong into lines a user can act on:
a usage problem found at start (a taken port) as one error line, a worker's failure as the line
that names its rank (the worker printed its own traceback above it, when it had one).
"""

from __future__ import annotations

import signal

import click

from autoddp import launch
from autoddp.command.arguments import as_flags, fail
from autoddp.core._warn import one_line, say
from autoddp.core.errors import ConfigurationError, NodesError, RemoteTraceback, WorkerError
from autoddp.launch.request import Request, Script


def run(request: Request, script: Script) -> int:
    """Run ``script`` as ``request`` asks (in place, this node's share, or workers here); the
    command's exit status."""
    try:
        launch.run(request, script)
    except BaseException as error:
        return _launch_failed(error, request, launch.way(request, script))
    return 0


def _launch_failed(error: BaseException, request: Request, way: str) -> int:
    """A failure before anything started, in one line; else ``_failed``'s lines and status."""
    from autoddp.launch import door

    if way == door.IN_PLACE:  # (this process would have become the script)
        if isinstance(error, ConfigurationError):
            fail(str(error))
        raise error
    # (elastic's, loaded already where it raised: the agent of a run on several machines)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    if isinstance(error, RendezvousTimeoutError):
        nodes = request.nodes
        fail(
            f"the other machines did not all join the rendezvous at {nodes.endpoint} within its join timeout "
            f"({nodes.join_timeout:g} s): start autoddp on every machine, or raise --join-timeout SECONDS",
            code=1,
        )
    if isinstance(error, SignalException):  # (one machine's workers act on a signal themselves)
        say(f"{error.sigval.name} received: stopped all workers on this node")
        return 128 + int(error.sigval)
    if isinstance(error, ConfigurationError) and getattr(error, "autoddp_rank", None) is None:
        # found before anything started: node 0's address (a usage error), a taken port here (no traceback)
        fail(as_flags(str(error)), code=1 if way == door.WORKERS else 2)
    return _failed(error)


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
