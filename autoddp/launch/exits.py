"""The end of a run: a worker that finished the user's code but never ends is named and stopped.

Each worker marks when the user's code is done (a script's atexit hooks included; a decorated
function's return): ``leaving``, and when autoddp's own end of the process is done: ``ended``
(``run_folder.finished``). In between lie only the freeing of the user's objects (a ``__del__``, a C++
destructor waiting for a thread) and the group's teardown, which take well under a second. Once
every local rank is leaving, a rank that has not ended ``EXIT_SECONDS`` later is stuck there: it
is stopped with SIGTERM, which writes its stacks to the run folder (``worker.process``), and
``report`` names it with them, so the run ends with the user's own status instead of waiting
forever, silently.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

from autoddp.core import _variables
from autoddp.core._warn import one_line, say
from autoddp.core.errors import WorkerError
from autoddp.in_rank.run_folder import finished, stacks

#: How long every rank may take to end once all have finished the user's code.
EXIT_SECONDS = 30.0


class Exits:
    """Watch the ``nproc`` workers of one attempt whose markers are in ``folder``."""

    def __init__(self, folder: str, nproc: int, seconds: float | None = None, returns: bool = False) -> None:
        self.folder, self.nproc = folder, nproc
        #: Each worker runs a function that returns (the decorator's): one that ends without
        #: having returned (``os._exit``) is a failure (``without_result``), not a worker that ended.
        self.returns = returns
        self.seconds = (
            float(os.environ.get(_variables.EXIT_SECONDS, EXIT_SECONDS)) if seconds is None else seconds
        )
        self.stopped: dict[int, float] = {}  # rank -> how long it had not ended
        self._since: float | None = None
        self._stop = threading.Event()

    @contextlib.contextmanager
    def watching(self, pids: Callable[[], dict[int, int]]) -> Iterator[Exits]:
        """Check about five times a second while the ``with`` block runs; ``pids`` by local rank."""
        thread = threading.Thread(target=self._run, args=(pids,), name="autoddp-exit-watch", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(timeout=5)

    def _run(self, pids: Callable[[], dict[int, int]]) -> None:
        while not self._stop.wait(0.2):
            try:
                if self.check(time.monotonic(), pids):
                    return
            except Exception as error:  # never let the watch disturb the run
                say(f"the exit watch stopped working ({one_line(error)}); the run goes on")
                return

    def check(self, now: float, pids: Callable[[], dict[int, int]]) -> bool:
        """One look; True when there is nothing more to watch (all ended, or the stuck stopped)."""
        if len(finished.marked(self.folder, finished.LEAVING)) < self.nproc:
            return False
        stuck = set(range(self.nproc)) - finished.marked(self.folder, finished.ENDED)
        if not stuck:
            return True
        self._since = now if self._since is None else self._since
        if now - self._since < self.seconds:
            return False
        known = pids()
        for rank in sorted(stuck):
            self.stopped[rank] = now - self._since
            with contextlib.suppress(OSError, KeyError):
                os.kill(known[rank], signal.SIGTERM)  # (its stacks go to the run folder first)
        return True

    def report(self, failed: set[int]) -> bool:
        """After the workers are gone: True when the ``failed`` ranks are exactly those stopped here
        (the user's code ended well everywhere); each is named with its stacks."""
        if not self.stopped or failed != set(self.stopped):
            return False
        for rank, waited in sorted(self.stopped.items()):
            stack = stacks.read_stack(self.folder, rank) or "(no stack written)"
            say(
                f"rank {rank} finished your code, but its process had not ended {waited:.0f} s after "
                f"every rank had (something it freed, or the group's teardown, never returned): "
                f"stopped it. Where it was:\n{stack}"
            )
        return True

    def without_result(self, codes: dict[int, int | None]) -> set[int]:
        """The local ranks that ended with status 0 before autoddp's own end of the worker (the
        function never returned there: ``os._exit(0)``, or a native library exiting); none unless
        ``returns``. Elastic counts such a worker as done: under fork it then waits forever for
        its return value, under fresh interpreters it ends the run without a result."""
        if not self.returns:
            return set()
        gone = {rank for rank, code in codes.items() if code == 0}
        return gone - finished.marked(self.folder, finished.ENDED) if gone else set()

    def without_result_error(self, ranks: set[int], first_rank: int = 0) -> WorkerError:
        """The error for the local ``ranks`` that ended without a result (``without_result``)."""
        named = ", ".join(str(first_rank + rank) for rank in sorted(ranks))
        plural = "s" if len(ranks) > 1 else ""
        return WorkerError(
            f"rank{plural} {named} of {self.nproc}: the worker process exited with status 0 before your "
            "function returned there (os._exit(0), or a native library ending the process): there is no "
            "result. Return from the function instead of exiting the process; to stop early on every "
            "rank, return or raise",
            rank=first_rank + min(ranks),
            exitcode=0,
        )
