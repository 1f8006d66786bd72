"""What the records of one node's workers say: nothing to report, or which situation (a pure function).

- ``LATE``: some ranks have waited in a collective (its call, or one that has not completed since,
  ``record.judged``; or for rank 0) for ``hang_report`` seconds or
  more while others are elsewhere (computing, sleeping, in another kind of wait, not running the
  user's code): those have not arrived.
- ``RANK0_BUSY``: ranks wait for rank 0's ``rank0()`` block and rank 0 runs that very block (or
  runs on another node): no hang, the report says so instead.
- ``TOGETHER``: every rank of this node has waited that long in a collective. Collectives of
  different names do not match (``MISMATCH``); the same name may still be called from
  different lines, which only the stacks tell (the watch decides then).

Ranks that all compute (a long first ``torch.compile``, data preparation on every rank) are in
no collective: nothing to report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from autoddp.in_rank.hang import record

LATE = "late"
RANK0_BUSY = "rank0 busy"
TOGETHER = "together"
MISMATCH = "mismatch"


@dataclasses.dataclass(frozen=True)
class Situation:
    """One thing to report, with the records it is about."""

    kind: str
    waiting: tuple[record.Record, ...]  # the ranks that wait
    late: tuple[record.Record, ...] = ()  # running ranks that have not arrived (or rank 0, busy)
    absent: tuple[int, ...] = ()  # local ranks not running the user's code (starting, or done)
    other_nodes: bool = False  # the world has ranks on other nodes

    @property
    def key(self) -> tuple:
        """The same while the situation lasts: who waits in which call, who is late."""
        return (
            self.kind,
            tuple((r.rank, r.sequence) for r in self.waiting),
            tuple(r.rank for r in self.late),
            self.absent,
        )


def judge(
    records: Mapping[int, record.Record | None], nproc: int, now: float, seconds: float
) -> list[Situation]:
    """The situations among this node's ``nproc`` workers (by local rank) at ``now``."""
    judged = {rank: record.judged(r) for rank, r in records.items()}  # a queued collective waits
    running = {rank: r for rank, r in sorted(judged.items()) if r is not None and r.active}
    if not running:
        return []
    absent = tuple(rank for rank in range(nproc) if rank not in running)
    other_nodes = next(iter(running.values())).world_size > nproc
    long = [r for r in running.values() if r.blocked and now - r.since >= seconds]
    situations = []
    for_rank0 = tuple(r for r in long if r.kind == record.WAITS_FOR_RANK0)
    if for_rank0:
        some = next(iter(running.values()))
        here = some.rank - some.local_rank == 0  # this node's first rank is rank 0
        zero = running.get(0) if here else None
        if not here or (
            zero is not None and zero.kind == record.RUNS_RANK0 and zero.site == for_rank0[0].site
        ):
            situations.append(Situation(RANK0_BUSY, for_rank0, (zero,) if zero else (), (), other_nodes))
        else:
            late, gone = ((zero,), ()) if zero is not None else ((), (0,))
            situations.append(Situation(LATE, for_rank0, late, gone, other_nodes))
    waiting = tuple(r for r in long if r.in_collective)
    if waiting:
        late = tuple(r for r in running.values() if not r.in_collective)
        if late or absent:
            situations.append(Situation(LATE, waiting, late, absent, other_nodes))
        elif len(waiting) == len(running):
            kind = MISMATCH if len({r.name for r in waiting}) > 1 else TOGETHER
            situations.append(Situation(kind, waiting, (), (), other_nodes))
    return situations
