"""Which ranks' own code ran to its end, as a marker file per rank in the private run folder.

A rank still waiting in a collective for one that ended (a rank-dependent ``break``) fails with
gloo's or NCCL's "connection closed"; the launcher (``launch.failures``) reads the markers to say
that the peer had ended, which is the cause.
"""

from __future__ import annotations

import contextlib
import os

from autoddp.core import _variables
from autoddp.in_rank.run_folder.transport import write_private


def mark_finished(rank: int) -> None:
    """In a worker an autoddp launcher started: this rank's own code ran to its end.

    A rank still waiting for it in a collective is then told why its peer is gone
    (``launch.failures``). Where no launcher of autoddp's watches, nothing is written.
    """
    folder = os.environ.get(_variables.RUN_FOLDER)
    if folder:
        with contextlib.suppress(OSError):
            write_private(os.path.join(folder, f"finished-{rank}"), b"")


def finished_ranks(folder: str) -> set[int]:
    """The ranks that said ``mark_finished``."""
    return marked(folder, "finished")


#: After the user's code and its atexit hooks, autoddp's own end of a worker begins (``leaving``)
#: and ends (``ended``); the launcher names a rank that leaves and never ends (``launch.exits``).
LEAVING, ENDED = "leaving", "ended"


def mark(rank: int, stage: str) -> None:
    """In a worker an autoddp launcher started: this rank reached ``stage`` (``LEAVING``, ``ENDED``)."""
    folder = os.environ.get(_variables.RUN_FOLDER)
    if folder and os.environ.get("WORLD_SIZE", "1") != "1":
        with contextlib.suppress(OSError):
            write_private(os.path.join(folder, f"{stage}-{rank}"), b"")


def marked(folder: str, stage: str) -> set[int]:
    """The ranks that reached ``stage`` (``"finished"``, ``LEAVING``, ``ENDED``)."""
    prefix = f"{stage}-"
    with contextlib.suppress(OSError):
        names = os.listdir(folder)
        return {int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit()}
    return set()
