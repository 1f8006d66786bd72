"""Node 0's combined view of a run on several machines, through the rendezvous store.

Every node's watch publishes what its workers' records say under ``autoddp/hang/<run id>/`` in
the store of the static rendezvous (on node 0, which every node's agent already reaches): ages,
not times, since the machines' clocks differ. It also answers node 0's requests for its ranks'
stacks. Node 0 then judges the whole world at once, so that its report names a late rank on
another machine, with that rank's stack, and the other nodes say nothing themselves. Where the
store cannot be reached, or a node has not published yet, each node reports its own ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from autoddp.hang import record, stacks

_ANSWER_SECONDS = 4.0  # how long node 0 waits for another node's stacks

#: This node's stacks by global rank, for the records given (the watch collects them).
Collect = Callable[[list[record.Record]], dict[int, list[stacks.Frame]]]


class Exchange:
    """One node's side of the exchange (``node_rank`` of ``nnodes``)."""

    def __init__(self, host: str, port: int, run_id: str, node_rank: int, nnodes: int) -> None:
        self.host, self.port, self.node_rank, self.nnodes = host, port, node_rank, nnodes
        self.prefix = f"autoddp/hang/{run_id}/"
        self.store: Any = None
        self.broken = False
        self.asked = 0  # node 0: requests for stacks made so far
        self.answered = ""  # other nodes: the last request answered
        self.owner: dict[int, int] = {}  # node 0: rank -> the node that runs it

    def share(
        self, records: Mapping[int, record.Record | None], now: float, collect: Collect
    ) -> dict[int, record.Record | None] | None:
        """Publish this node's records, answer a request for stacks; on node 0 the whole world's.

        None where there is no combined view (another node, or not every node has published).
        """
        if not self._connected():
            return None
        try:
            running = [r for r in records.values() if r is not None]
            mine = [  # ages, not times
                {**dataclasses.asdict(r), "since": now - r.since, "pending_since": now - r.pending_since}
                for r in running
            ]
            self.store.set(f"{self.prefix}node/{self.node_rank}", json.dumps(mine))
            if self.node_rank != 0:
                self._answer(running, collect)
                return None
            return self._everyone(now)
        except Exception:  # the store went away (the run ends): each node for itself
            self.broken = True
            return None

    def node0_combines(self) -> bool:
        """On the other nodes: whether node 0 reports for every node."""
        if self.broken or self.store is None:
            return False
        try:
            return bool(self.store.check([f"{self.prefix}combined"]))
        except Exception:
            self.broken = True
            return False

    def frames(self, ranks: list[int]) -> dict[int, list[stacks.Frame]]:
        """On node 0: the stacks of ``ranks`` that run on other nodes, asked of those nodes."""
        nodes = sorted({self.owner[r] for r in ranks if self.owner.get(r, 0) != 0})
        if not nodes or self.store is None:
            return {}
        self.asked += 1
        asked, found = str(self.asked), {}
        try:
            for node in nodes:
                self.store.set(f"{self.prefix}ask/{node}", asked)
            deadline, waiting = time.monotonic() + _ANSWER_SECONDS, set(nodes)
            while waiting and time.monotonic() < deadline:
                time.sleep(0.1)
                for node in list(waiting):
                    key = f"{self.prefix}stacks/{node}"
                    if self.store.check([key]):
                        answer = json.loads(self.store.get(key))
                        if answer["ask"] == asked:
                            waiting.discard(node)
                            for rank, listed in answer["frames"].items():
                                found[int(rank)] = [stacks.Frame(*frame) for frame in listed]
        except Exception:
            self.broken = True
        return found

    def _connected(self) -> bool:
        if self.store is None and not self.broken:
            try:
                import torch.distributed as dist

                self.store = dist.TCPStore(
                    self.host,
                    self.port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=5),
                    wait_for_workers=False,
                )
            except Exception:
                self.broken = True
        return self.store is not None and not self.broken

    def _answer(self, running: list[record.Record], collect: Collect) -> None:
        key = f"{self.prefix}ask/{self.node_rank}"
        if not self.store.check([key]):
            return
        asked = self.store.get(key).decode()
        if asked == self.answered:
            return
        self.answered = asked
        found = collect([r for r in running if r.active])
        listed = {rank: [dataclasses.astuple(f) for f in frames] for rank, frames in found.items()}
        self.store.set(f"{self.prefix}stacks/{self.node_rank}", json.dumps({"ask": asked, "frames": listed}))

    def _everyone(self, now: float) -> dict[int, record.Record | None] | None:
        keys = [f"{self.prefix}node/{node}" for node in range(self.nnodes)]
        if not self.store.check(keys):
            return None
        world: dict[int, record.Record | None] = {}
        for node, value in enumerate(self.store.multi_get(keys)):
            for fields in json.loads(value):
                fields.update(since=now - fields["since"], local_rank=fields["rank"])
                fields.update(pending_since=now - fields.get("pending_since", 0.0))
                world[fields["rank"]] = record.Record(**fields)
                self.owner[fields["rank"]] = node
        size = max((r.world_size for r in world.values() if r is not None), default=0)
        if not size:
            return None
        self.store.set(f"{self.prefix}combined", "1")
        return {rank: world.get(rank) for rank in range(size)}
