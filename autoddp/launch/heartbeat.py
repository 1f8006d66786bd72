"""Each node's pulse in node 0's store during a run on several machines, and who has gone quiet.

A thread of each node's launcher (``Beat``, started by ``launch.meeting`` once the nodes have met)
counts up a key of its own about once a second and reads the others'. A node whose count has not
moved for ``LOST_AFTER`` seconds is said to be unreachable (once; and once more when it answers
again): a network partition, or a machine that stalls, is named as such instead of a silence.
The same thread notes whether another node is already at the next attempt or has ended its run
(``ahead``, elastic's ``num_nodes_waiting``), so that elastic's agent never waits on the network
itself. Its store operations, and the launcher's last words after a failure (``call``), give up
after seconds: a node cut off from node 0 still ends within seconds of its workers.

A store operation given up on goes on in its thread until the store's own timeout. The process
waits for such threads at its exit (``settle``): one that came back from torch's C++ while Python
was shutting down would abort the launcher ("terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

from autoddp.core._warn import say

LOST_AFTER = 5.0  # seconds without a pulse before a node is said to be unreachable
_PERIOD = 1.0
_TIMEOUT = 5.0  # each store operation of this client
_SETTLE = _TIMEOUT + 2.0  # seconds after its start that a store call surely came back by


class Beat:
    """This node's pulse (``node_rank`` of ``nnodes``) under ``prefix`` in the store at ``host:port``."""

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str,
        node_rank: int,
        nnodes: int,
        emit: Callable[[str], None] = say,
    ) -> None:
        self.host, self.port, self.prefix, self.node_rank, self.nnodes = host, port, prefix, node_rank, nnodes
        self.emit = emit
        self.attempt = 0
        self.ahead = 0  # other nodes at the next attempt, or 1 when one ended its run
        self.lost_since: dict[int, float] = {}  # node -> wall-clock time it was last heard from
        self._heard: dict[int, tuple[str, float]] = {}  # node -> (its count, when it last moved)
        self._count = 0
        self._store: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._calls: dict[threading.Thread, float] = {}  # store calls in flight -> when each started
        atexit.register(self.settle)

    def start(self, attempt: int) -> None:
        """(Again) after each meeting: the others' counts are watched from now on."""
        self.attempt, self.ahead = attempt, 0
        now = time.monotonic()
        self._heard = {n: (value, now) for n, (value, _) in self._heard.items()}
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="autoddp-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)

    def call(self, operations: Callable[[Any], Any], timeout: float = _TIMEOUT) -> Any:
        """``operations(store)`` on this node's own store client, given up after ``timeout`` seconds
        (TimeoutError): a store operation towards an unreachable node 0 can block for many minutes
        (TCP's own retries), so it runs in a thread of its own that is left behind if it must."""
        done: list[Any] = []

        def run() -> None:
            try:
                with self._lock:
                    if self._store is None:
                        from torch.distributed import TCPStore

                        timeout = datetime.timedelta(seconds=_TIMEOUT)
                        self._store = TCPStore(
                            self.host, self.port, None, False, timeout, wait_for_workers=False
                        )
                    try:
                        done.append((True, operations(self._store)))
                    except Exception:
                        self._store = None  # (a client that failed is connected afresh)
                        raise
            except Exception as error:
                done.append((False, error))
            finally:
                self._calls.pop(threading.current_thread(), None)

        thread = threading.Thread(target=run, name="autoddp-store-call", daemon=True)
        self._calls[thread] = time.monotonic()
        thread.start()
        thread.join(timeout)
        if not done:
            raise TimeoutError(
                f"node 0's store at {self.host}:{self.port} did not answer within {timeout:g} s"
            )
        ok, value = done[0]
        if not ok:
            raise value
        return value

    def settle(self) -> None:
        """Wait for the store calls still in flight, each until its operations' timeout has surely
        passed (at the process's exit: a call that came back from C++ while Python shut down
        would abort the process)."""
        for thread, started in list(self._calls.items()):
            thread.join(max(0.0, started + _SETTLE - time.monotonic()))

    def _run(self) -> None:
        while not self._stop.wait(_PERIOD):
            self.tick()

    def tick(self) -> None:
        others = [n for n in range(self.nnodes) if n != self.node_rank]

        def pulse(store: Any) -> None:
            self._count += 1
            store.set(f"{self.prefix}alive/{self.node_rank}", str(self._count))
            for node in others:
                key = f"{self.prefix}alive/{node}"
                self._heard_from(node, store.get(key).decode() if store.check([key]) else "")
            if any(store.check([f"{self.prefix}ended/{n}"]) for n in others):
                self.ahead = 1
            else:
                later = f"{self.prefix}{self.attempt + 1}/node/"
                self.ahead = sum(1 for n in others if store.check([f"{later}{n}"]))

        with contextlib.suppress(Exception):  # node 0 cannot be reached: the others' counts stand still
            self.call(pulse)
        now = time.monotonic()
        for node in others:
            moved = self._heard.setdefault(node, ("", now))[1]
            if now - moved >= LOST_AFTER and node not in self.lost_since:
                since = self.lost_since[node] = time.time() - (now - moved)
                self.emit(
                    f"node {node} of {self.nnodes} unreachable since {_clock(since)} (no word "
                    f"from it for {now - moved:.0f} s): a network partition, or that machine stalls; the run "
                    "goes on if it comes back before a collective's timeout"
                )

    def _heard_from(self, node: int, value: str) -> None:
        last = self._heard.get(node)
        if last is not None and last[0] == value:
            return
        self._heard[node] = (value, time.monotonic())
        since = self.lost_since.pop(node, None)
        if since is not None and last is not None:
            self.emit(f"node {node} of {self.nnodes} answers again, after {time.time() - since:.0f} s")

    def unreachable(self) -> dict[int, str]:
        """The nodes unreachable now, each in words (``node 1 of 2 unreachable since 18:16:05 (12 s)``)."""
        now = time.time()
        return {
            node: f"node {node} of {self.nnodes} unreachable since {_clock(since)} ({now - since:.0f} s)"
            for node, since in sorted(self.lost_since.items())
        }

    def lost(self) -> str:
        """The nodes unreachable now, in words ('' for none)."""
        return "; ".join(self.unreachable().values())


def _clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when))
