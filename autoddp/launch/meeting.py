"""The static rendezvous of several machines: elastic's ``static``, with what it lacks.

Elastic's agent runs this handler (registered as ``autoddp-static``) where torchrun would run its
``static`` one: node 0 hosts the agents' store at ``--master``, every node meets there before each
attempt. Beside what ``static`` does:

- node 0 names the nodes it still waits for (after ``FIRST_SAY`` seconds, then every
  ``REPEAT_SAY``) and gives up with ``NodesError`` after the join timeout (``join_timeout=``,
  ``--join-timeout``), at the start and at every restart;
- each attempt after the first gets a fresh store for its workers (node 0 hosts it on a free
  port): a restarted worker never reads the addresses the first attempt's workers left in the
  store, whichever node failed;
- before a restart every node publishes what failed on it (from its run folder), so that every
  node says one line: ``restart 1 of 1 after rank 1 on node 1 exited with code 3``;
- a node whose agent ends its run says so in the store: a node waiting for it, or running
  healthy workers beside it (``num_nodes_waiting``), stops within seconds instead of waiting.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

from autoddp.core._warn import one_line, say
from autoddp.core.errors import NodesError, WorkerError
from autoddp.in_rank.run_folder import transport
from autoddp.launch import failures
from autoddp.launch.heartbeat import Beat
from autoddp.launch.plan import DEFAULT_JOIN_TIMEOUT

BACKEND = "autoddp-static"
FIRST_SAY = 5.0  # node 0 names the awaited nodes this soon
REPEAT_SAY = 30.0  # and again this often while it waits
_POLL = 0.2
REMOTE_WAIT = 5.0  # how long node 0 waits for another node's root cause after its own ranks failed


class Meeting:
    """This node's side of the meeting (``node_rank`` of ``nnodes``) at node 0's ``host:port``.

    ``folder``: this node's run folder (the workers' error reports, read before a restart).
    """

    def __init__(
        self,
        host: str,
        port: int,
        node_rank: int,
        nnodes: int,
        run_id: str,
        *,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
        max_restarts: int = 0,
        folder: str = "",
        emit: Callable[[str], None] = say,
    ) -> None:
        self.host, self.port, self.node_rank, self.nnodes, self.run_id = host, port, node_rank, nnodes, run_id
        self.join_timeout, self.max_restarts, self.folder, self.emit = (
            join_timeout,
            max_restarts,
            folder,
            emit,
        )
        self.prefix = f"autoddp/meet/{run_id}/"
        self.attempt = -1
        self.store: Any = None
        self._stores: list[Any] = []  # node 0: the stores it hosts for the attempts after the first
        self.beat = Beat(host, port, self.prefix, node_rank, nnodes, emit)

    # elastic's RendezvousHandler interface
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers' store is hosted by node 0's agent (this handler)

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def next_rendezvous(self) -> Any:
        from torch.distributed import PrefixStore
        from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

        self.attempt += 1
        store = self._agents_store()
        here = f"{self.prefix}{self.attempt}/"
        try:
            failed = self._what_failed() if self.attempt > 0 else ""
            store.set(f"{here}node/{self.node_rank}", failed)
            if self.node_rank == 0:
                self._wait_for_nodes(store, here)
                port = self.port if self.attempt == 0 else self._fresh_store()
                store.set(f"{here}port", str(port))
            else:
                port = int(self._wait_for_node0(store, f"{here}port"))
            if self.attempt > 0:
                self.emit(self._restart_line(store, here))
        except NodesError:
            raise
        except Exception as error:  # (torch's DistStoreError, a RuntimeError)
            raise NodesError(
                f"node 0's store at {self.host}:{self.port} stopped answering ({one_line(error)}): node 0 "
                "ended its run or cannot be reached from here; its output names the cause"
            ) from None
        self.beat.start(self.attempt)
        info = RendezvousStoreInfo(self.host, port)
        return RendezvousInfo(
            PrefixStore(f"{self.run_id}/{self.attempt}", store), self.node_rank, self.nnodes, info
        )

    def num_nodes_waiting(self) -> int:
        """Other nodes already at the next attempt, or one that ended its run: this node's
        healthy workers are then stopped and it meets again (elastic counts no restart for it).
        The heartbeat's thread finds it out: elastic's loop never waits on the network."""
        return self.beat.ahead

    def lost(self) -> str:
        """The nodes unreachable now, in words ('' for none)."""
        return self.beat.lost()

    def shutdown(self) -> bool:
        """This node's agent ends its run: its workers' root cause (if one raised) goes to the
        store, then the word that it ended, so that the others stop waiting for it."""
        report = self._lead_report()

        def last_words(store: Any) -> None:
            if report is not None:
                store.set(f"{self.prefix}failure/{self.node_rank}", pickle.dumps(report))
                store.set(f"{self.prefix}told/{self.node_rank}", "1")
            store.set(f"{self.prefix}ended/{self.node_rank}", "1")

        if self.store is not None:
            with contextlib.suppress(Exception):
                self.beat.call(last_words)
        self.beat.stop()
        self._stores.clear()
        return True

    def tell(self, lead: BaseException) -> None:
        """After this node's triage: a worker that died without an exception (killed, ``os._exit``)
        is told to the others too (a raised one was told at ``shutdown``)."""

        def told(store: Any) -> None:
            if store.check([f"{self.prefix}told/{self.node_rank}"]):
                return
            if isinstance(lead, WorkerError):
                death = {
                    "message": str(lead),
                    "rank": lead.rank,
                    "exitcode": lead.exitcode,
                    "signal": lead.signal,
                }
                store.set(f"{self.prefix}death/{self.node_rank}", json.dumps(death))
            store.set(f"{self.prefix}told/{self.node_rank}", "1")

        if self.store is not None and not self.lost():
            with contextlib.suppress(Exception):
                self.beat.call(told)

    def tell_stopped(self, name: str) -> None:
        """This node's launcher was stopped by signal ``name``: the others are told at once."""

        def told(store: Any) -> None:
            store.set(f"{self.prefix}stopped/{self.node_rank}", name)
            store.set(f"{self.prefix}told/{self.node_rank}", "1")

        if self.store is not None:
            with contextlib.suppress(Exception):
                self.beat.call(told)

    def causes_elsewhere(self, wait: float = REMOTE_WAIT) -> dict[int, Any]:
        """What the other nodes told of their failures, by node: an ``ErrorReport`` (a raised
        exception), a ``WorkerError`` (a worker that died without one) or a ``NodesError`` (its
        launcher was stopped); waiting up to ``wait`` seconds for nodes that have not told yet
        (a lost node never does)."""
        found: dict[int, Any] = {}
        if self.store is None:
            return found
        deadline = time.monotonic() + wait
        others = self._others()
        with contextlib.suppress(Exception):  # (the store went away with node 0)
            while True:
                told = self.beat.call(
                    lambda store: [n for n in others if store.check([f"{self.prefix}told/{n}"])]
                )
                if len(told) == len(others) or time.monotonic() >= deadline:
                    break
                time.sleep(_POLL)
            for node in others:
                found.update(self.beat.call(lambda store, node=node: self._told(store, node)))
        return found

    def _told(self, store: Any, node: int) -> dict[int, Any]:
        failure, death, stopped = (f"{self.prefix}{what}/{node}" for what in ("failure", "death", "stopped"))
        if store.check([failure]):
            return {node: pickle.loads(store.get(failure))}
        if store.check([death]):
            fields = json.loads(store.get(death))
            return {node: WorkerError(fields.pop("message"), **fields)}
        if store.check([stopped]):
            name = store.get(stopped).decode()
            return {
                node: NodesError(
                    f"node {node} of {self.nnodes} was stopped ({name} to its autoddp): the run ended there"
                )
            }
        return {}

    def _others(self) -> list[int]:
        return [r for r in range(self.nnodes) if r != self.node_rank]

    def _ended(self, store: Any) -> int | None:
        return next((r for r in self._others() if store.check([f"{self.prefix}ended/{r}"])), None)

    def _lead_report(self) -> transport.ErrorReport | None:
        reports = transport.load_errors(self.folder) if self.folder else {}
        return failures.lead_report(reports.values())

    # the meeting
    def _agents_store(self) -> Any:
        if self.store is None:
            from torch.distributed import TCPStore

            try:
                self.store = self._store_at(TCPStore)
            except Exception as error:
                if self.node_rank == 0:
                    raise
                raise NodesError(
                    f"node 0 did not answer at {self.host}:{self.port} within the join timeout "
                    f"({self.join_timeout:g} s; {one_line(error)}): start autoddp on node 0 with "
                    "--node-rank 0, check that this machine reaches that address, or raise the join timeout "
                    "(join_timeout= in @distributed, --join-timeout for the command)"
                ) from None
        return self.store

    def _store_at(self, TCPStore: Any) -> Any:
        return TCPStore(
            self.host,
            self.port,
            None,
            self.node_rank == 0,
            datetime.timedelta(seconds=self.join_timeout),
            wait_for_workers=False,
            multi_tenant=True,
        )

    def _fresh_store(self) -> int:
        """Node 0: a new store for this attempt's workers, on a port the OS picks."""
        from torch.distributed import TCPStore

        store = TCPStore(
            self.host, 0, None, True, datetime.timedelta(seconds=self.join_timeout), wait_for_workers=False
        )
        self._stores[:] = [store]  # the previous attempt's workers are gone
        return store.port

    def _wait_for_nodes(self, store: Any, here: str) -> None:
        started = time.monotonic()
        said = started - REPEAT_SAY + FIRST_SAY
        while True:
            missing = [r for r in range(1, self.nnodes) if not store.check([f"{here}node/{r}"])]
            if not missing:
                return
            self._stop_if_ended(store)
            waited = time.monotonic() - started
            nodes = _nodes(missing, self.nnodes)
            where = "the restart" if self.attempt else f"the rendezvous at {self.host}:{self.port}"
            if waited >= self.join_timeout:
                raise NodesError(
                    f"{nodes} did not join {where} within the join timeout ({self.join_timeout:g} s): start "
                    "autoddp there with the same --nnodes and --master and its own --node-rank, or raise "
                    "the join timeout (join_timeout= in @distributed, --join-timeout for the command)"
                )
            if time.monotonic() - said >= REPEAT_SAY:
                self.emit(
                    f"waiting for {nodes} to join {where} ({waited:.0f} s so far; giving up after "
                    f"{self.join_timeout:g} s, the join timeout)"
                )
                said = time.monotonic()
            time.sleep(_POLL)

    def _wait_for_node0(self, store: Any, key: str) -> str:
        started = time.monotonic()
        while not store.check([key]):
            self._stop_if_ended(store)
            if time.monotonic() - started >= self.join_timeout:
                raise NodesError(
                    f"node 0 did not start attempt {self.attempt} within the join timeout "
                    f"({self.join_timeout:g} s): another node did not join; node 0 names it"
                )
            time.sleep(_POLL)
        return store.get(key).decode()

    def _stop_if_ended(self, store: Any) -> None:
        node = self._ended(store)
        if node is not None:
            raise NodesError(
                f"node {node} of {self.nnodes} ended its run (its workers failed with no restarts left, "
                "or it was stopped): this node stops too"
                + ("" if self.node_rank == 0 else "; node 0's output names the root cause")
            )

    def _what_failed(self) -> str:
        """What ended this node's last attempt ('' for nothing: the others restarted first),
        as ``cause|summary``; its reports are then removed for the next attempt's triage."""
        first = self._lead_report()
        for name in os.listdir(self.folder) if self.folder else ():
            if name.startswith(("error-", "finished-", "stack-")):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.folder, name))
        if first is None:
            return ""
        if first.type_name == "SystemExit":
            what = f"exited with code {first.message or 0}"
        else:
            what = f"raised {first.summary()}"
        kind = "consequence" if first.is_consequence else "cause"
        return f"{kind}|rank {first.rank} on node {self.node_rank} {what}"

    def _restart_line(self, store: Any, here: str) -> str:
        said = [store.get(f"{here}node/{r}").decode() for r in range(self.nnodes)]
        found = sorted((s.split("|", 1) for s in said if "|" in s), key=lambda p: p[0] != "cause")
        after = f" after {found[0][1]}" if found else " (another node restarted)"
        return f"restart {self.attempt} of {self.max_restarts}{after}"


def _nodes(ranks: list[int], nnodes: int) -> str:
    return ("node " if len(ranks) == 1 else "nodes ") + ", ".join(map(str, ranks)) + f" of {nnodes}"


def register() -> None:
    """Make ``autoddp-static`` known to elastic: the handler travels in the rendezvous's settings."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create)


def _create(params: Any) -> Meeting:
    return params.config["autoddp_meeting"]
