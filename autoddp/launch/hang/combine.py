"""Node 0's combined view of a run on several machines, through the rendezvous store.

Every node's watch publishes what its workers' records say under ``autoddp/hang/<run id>/`` in
the store of the static rendezvous (on node 0, which every node's agent already reaches): ages,
not times, since the machines' clocks differ. It also answers node 0's requests for its ranks'
stacks. Node 0 then judges the whole world at once, so that its report names a late rank on
another machine, with that rank's stack, and the other nodes say nothing themselves. Where the
store cannot be reached, or a node has not published yet, each node reports its own ranks. Every
store operation goes through the launcher's bounded ``call`` (a partition must not stall the
watch), and the nodes the heartbeat finds unreachable are named instead of their last records.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from autoddp.in_rank.hang import record
from autoddp.launch.hang import stacks

_ANSWER_SECONDS = 4.0  # how long node 0 waits for another node's stacks

#: This node's stacks by global rank, for the records given (the watch collects them).
Collect = Callable[[list[record.Record]], dict[int, list[stacks.Frame]]]

_T = TypeVar("_T")
#: ``call(operations)``: ``operations(store)`` on the rendezvous store, given up after seconds.
Call = Callable[[Callable[[Any], _T]], _T]


class Exchange:
    """One node's side of the exchange (``node_rank`` of ``nnodes``, ``nproc`` workers here).

    ``unreachable()``: the nodes the heartbeat has lost now, each in words (``node 1 of 2
    unreachable since 18:16:05 (12 s)``).
    """

    def __init__(
        self,
        call: Call,
        run_id: str,
        node_rank: int,
        nnodes: int,
        nproc: int,
        unreachable: Callable[[], Mapping[int, str]] = dict,
    ) -> None:
        self.call, self.node_rank, self.nnodes, self.nproc = call, node_rank, nnodes, nproc
        self.unreachable = unreachable
        self.prefix = f"autoddp/hang/{run_id}/"
        self.asked = 0  # node 0: requests for stacks made so far
        self.answered = ""  # other nodes: the last request answered
        self.owner: dict[int, int] = {}  # node 0: rank -> the node that runs it

    def share(
        self, records: Mapping[int, record.Record | None], now: float, collect: Collect
    ) -> dict[int, record.Record | None] | None:
        """Publish this node's records, answer a request for stacks; on node 0 the whole world's.

        None where there is no combined view (another node, or not every node has published).
        """
        if self.node_rank != 0 and 0 in self.unreachable():
            return None  # (no store call to wait on: each node for itself meanwhile)
        try:
            running = [r for r in records.values() if r is not None]
            mine = [  # ages, not times
                {**dataclasses.asdict(r), "since": now - r.since, "pending_since": now - r.pending_since}
                for r in running
            ]
            shared = json.dumps({"nproc": self.nproc, "records": mine})
            self.call(lambda store: store.set(f"{self.prefix}node/{self.node_rank}", shared))
            if self.node_rank != 0:
                self._answer(running, collect)
                return None
            return self._everyone(now)
        except Exception:  # the store cannot be reached now (a partition, the run ends): each node
            return None  # for itself this time

    def node0_combines(self) -> bool:
        """On the other nodes: whether node 0 reports for every node."""
        if 0 in self.unreachable():
            return False
        try:
            return bool(self.call(lambda store: store.check([f"{self.prefix}combined"])))
        except Exception:
            return False

    def frames(self, ranks: list[int]) -> dict[int, list[stacks.Frame]]:
        """On node 0: the stacks of ``ranks`` that run on other nodes, asked of those nodes."""
        lost = self.unreachable()
        nodes = sorted({self.owner[r] for r in ranks if self.owner.get(r, 0) not in (0, *lost)})
        if not nodes:
            return {}
        self.asked += 1
        asked, found = str(self.asked), {}
        try:
            for node in nodes:
                self.call(lambda store, node=node: store.set(f"{self.prefix}ask/{node}", asked))
            deadline, waiting = time.monotonic() + _ANSWER_SECONDS, set(nodes)
            while waiting and time.monotonic() < deadline:
                time.sleep(0.1)
                for node in list(waiting):
                    answer = self.call(lambda store, node=node: _get(store, f"{self.prefix}stacks/{node}"))
                    if answer is not None:
                        answer = json.loads(answer)
                        if answer["ask"] == asked:
                            waiting.discard(node)
                            for rank, listed in answer["frames"].items():
                                found[int(rank)] = [stacks.Frame(*frame) for frame in listed]
        except Exception:  # (node 0's own store: the run ends)
            pass
        return found

    def _answer(self, running: list[record.Record], collect: Collect) -> None:
        asked = self.call(lambda store: _get(store, f"{self.prefix}ask/{self.node_rank}"))
        if asked is None or asked == self.answered:
            return
        self.answered = asked
        found = collect([r for r in running if r.active])
        listed = {rank: [dataclasses.astuple(f) for f in frames] for rank, frames in found.items()}
        answer = json.dumps({"ask": asked, "frames": listed})
        self.call(lambda store: store.set(f"{self.prefix}stacks/{self.node_rank}", answer))

    def _everyone(self, now: float) -> dict[int, record.Record | None] | None:
        keys = [f"{self.prefix}node/{node}" for node in range(self.nnodes)]
        values = self.call(lambda store: store.multi_get(keys) if store.check(keys) else None)
        if values is None:
            return None
        world: dict[int, record.Record | None] = {}
        first = 0  # elastic numbers the ranks node by node: each node's are consecutive
        for node, value in enumerate(values):
            shared = json.loads(value)
            self.owner.update({rank: node for rank in range(first, first + shared["nproc"])})
            first += shared["nproc"]
            for fields in shared["records"]:
                fields.update(since=now - fields["since"], local_rank=fields["rank"])
                fields.update(pending_since=now - fields.get("pending_since", 0.0))
                world[fields["rank"]] = record.Record(**fields)
        size = max((r.world_size for r in world.values() if r is not None), default=0)
        if not size:
            return None
        self.call(lambda store: store.set(f"{self.prefix}combined", "1"))
        return {rank: world.get(rank) for rank in range(size)}

    def lost_ranks(self) -> dict[int, str]:
        """On node 0: the ranks of the nodes unreachable now (their records are old), each with its
        node in words."""
        lost = self.unreachable()
        return {rank: lost[node] for rank, node in self.owner.items() if node in lost}


def _get(store: Any, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None
