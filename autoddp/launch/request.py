"""What a launch is asked for, whichever door asked: one ``Request`` and its target.

Both doors make a ``Request`` from their ``Options`` (``Options.request``: the decorator from its
options, the command from its flags, adding what only a command line says) and hand it to
``autoddp.launch.run`` with what runs: a function call (``in_rank.worker.running.Job``) or a
script (``Script``). This module is light (imported when options are checked): it starts nothing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Union

from autoddp.core.backends import Backend
from autoddp.core.environment import LOOPBACK
from autoddp.core.errors import ConfigurationError
from autoddp.in_rank.hang import record as hang_record
from autoddp.launch.contract import DEFAULT_ROLE
from autoddp.launch.output import Output
from autoddp.launch.plan import Nodes

if TYPE_CHECKING:
    from autoddp.in_rank.worker.running import Job


@dataclasses.dataclass(frozen=True)
class Script:
    """A script run as ``python -m autoddp.in_rank.worker.script ARGV`` would: the runner's flags,
    the script (or ``--module NAME``) and the script's own arguments."""

    argv: tuple[str, ...]


#: What a launch runs: a call of the user's function, or a script.
Target = Union["Job", Script]


@dataclasses.dataclass(frozen=True)
class Request:
    """How a run starts: ``nproc`` processes on this machine (None: one per visible GPU for a
    function's GPU backend, else 1), the machines taking part (``nodes``), where their output
    goes, restarts after a failure, how often they are checked (None: the launcher's own
    interval), the hang report's seconds, whether the step report is said (one machine), the
    workers' role, how they start on one machine and where one machine's store listens (no port:
    a free one)."""

    nproc: int | None = None
    nodes: Nodes = dataclasses.field(default_factory=Nodes)
    output: Output = dataclasses.field(default_factory=Output)
    max_restarts: int = 0
    monitor_interval: float | None = None
    hang_report: float = hang_record.DEFAULT_SECONDS
    step_report: bool = True  # (one machine)
    role: str = DEFAULT_ROLE
    start_method: str = "auto"  # (one machine)
    store: tuple[str, int | None] = (LOOPBACK, None)  # (one machine)

    def processes(self, backend: Backend, gpus: int) -> int:
        """The processes a function's call starts here with ``backend`` where ``gpus`` are visible."""
        if self.nproc is None:
            return gpus if backend.use_cuda else 1
        if backend.use_cuda and self.nproc > gpus:
            raise ConfigurationError(
                f"nproc={self.nproc} but only {gpus} GPU(s) are visible; use nproc<={gpus}, "
                "or backend='gloo' to run CPU processes"
            )
        return self.nproc
