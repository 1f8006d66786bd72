"""The launcher's watch: a thread beside elastic's supervision that reads this node's hang records.

About once a second (more often for a ``hang_report`` under 4 s) it reads every local worker's
record (one ``pread`` each) and asks ``verdict`` what they say. A new situation is reported once
it has lasted ``hang_report`` seconds; the same one again every ``REPEAT_SECONDS`` at most while
it lasts. Only then are the ranks asked for their stacks (``stacks``); the report goes to the
console through ``say``. It never stops anything, and a failure of its own ends only the watch.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from autoddp.core._warn import one_line, say
from autoddp.in_rank.hang import record
from autoddp.launch.hang import combine, message, stacks, verdict

#: A situation that lasts is reported again at most this often.
REPEAT_SECONDS = 180.0


class Watch:
    """Watch ``nproc`` local workers whose records are in ``folder``, while a ``with`` block runs.

    ``seconds``: the ``hang_report`` option (0: no watch). ``node`` names this node in reports of
    a run on several machines; with an ``exchange`` node 0 reports for every node when it can.
    """

    def __init__(
        self,
        folder: str,
        nproc: int,
        seconds: float,
        node: str = "",
        repeat: float = REPEAT_SECONDS,
        emit: Callable[[str], None] = say,
        exchange: combine.Exchange | None = None,
    ) -> None:
        self.folder, self.nproc, self.seconds, self.node = folder, nproc, seconds, node
        self.repeat, self.emit, self.exchange = repeat, emit, exchange
        self.reported: dict[tuple, float] = {}  # situation -> when it was last reported
        self.quiet: set[tuple] = set()  # every rank in the same call: nothing to say about it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        if self.seconds > 0:
            self._thread = threading.Thread(target=self._run, name="autoddp-hang-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        period = min(1.0, max(0.1, self.seconds / 4))
        while not self._stop.wait(period):
            try:
                self.tick(time.monotonic())
            except Exception as error:  # never let the watch disturb the run
                self.emit(f"the hang report stopped working ({one_line(error)}); the run goes on")
                return

    def read(self) -> dict[int, record.Record | None]:
        """Every local worker's record now, by local rank."""
        return {rank: record.read(record.record_path(self.folder, rank)) for rank in range(self.nproc)}

    def view(self, now: float) -> tuple[dict[int, record.Record | None], bool] | None:
        """(the records to judge, whether they are node 0's view of every node), or None when
        node 0 reports for this node. The ranks of an unreachable node have no record in node 0's
        view: their last one is old news."""
        records = self.read()
        if self.exchange is None:
            return records, False
        world = self.exchange.share(records, now, self._stacks_by_rank)
        if world is not None:
            lost = self.exchange.lost_ranks()
            return {rank: None if rank in lost else r for rank, r in world.items()}, True
        return None if self.exchange.node0_combines() else (records, False)

    def tick(self, now: float) -> None:
        """One check: report what has lasted long enough, forget what ended."""
        seen = self.view(now)
        current = set()
        for situation in self._judge(seen, now):
            key = situation.key
            current.add(key)
            last = self.reported.get(key)
            if key in self.quiet or (last is not None and now - last < self.repeat):
                continue
            text = self._report(situation, now, combined=seen[1])
            if text:
                for line in text:
                    self.emit(line)
                self.reported[key] = now
        self.reported = {key: when for key, when in self.reported.items() if key in current}
        self.quiet &= current

    def _judge(self, seen: tuple[dict[int, record.Record | None], bool] | None, now: float) -> list:
        if seen is None:
            return []
        records, combined = seen
        return verdict.judge(records, len(records) if combined else self.nproc, now, self.seconds)

    def _report(self, situation: verdict.Situation, now: float, combined: bool) -> list[str]:
        """The report's lines, with the ranks' stacks; none if the situation ended meanwhile."""
        frames: dict[int, list[stacks.Frame]] = {}
        started = time.monotonic()
        if situation.kind != verdict.RANK0_BUSY:
            local = [r for r in self.read().values() if r is not None]
            if combined:
                assert self.exchange is not None
                frames = self._stacks_by_rank(local)
                wanted = [r.rank for r in situation.waiting + situation.late if r.rank not in frames]
                frames.update(self.exchange.frames(wanted))
            else:
                frames = stacks.collect(self.folder, local)
        now += time.monotonic() - started
        if situation.key not in {s.key for s in self._judge(self.view(now), now)}:
            return []  # the late rank arrived while its stack was read
        if situation.kind == verdict.TOGETHER:
            calls = {(r.what, _site(frames, r)) for r in situation.waiting}
            if len(calls) > 1 and all(site is not None for _, site in calls):
                situation = dataclasses.replace(situation, kind=verdict.MISMATCH)
            elif not situation.other_nodes:
                self.quiet.add(situation.key)  # all in the same call on one node: no rank is late
                return []
        node = "all nodes" if combined else self.node
        if self.exchange is None:
            return message.lines(situation, frames, now, self.seconds, self.repeat, node)
        if combined:  # the ranks of an unreachable node, by name
            lost = message.Lost(ranks=self.exchange.lost_ranks())
        else:  # this node's view: which nodes it cannot hear from
            lost = message.Lost(nodes=tuple(self.exchange.unreachable().values()))
        return message.lines(situation, frames, now, self.seconds, self.repeat, node, lost)

    def _stacks_by_rank(self, records: list[record.Record]) -> dict[int, list[stacks.Frame]]:
        """This node's stacks, by global rank."""
        found = stacks.collect(self.folder, records)
        ranks = {r.local_rank: r.rank for r in records}
        return {ranks[local]: frames for local, frames in found.items()}


def _site(frames: dict[int, list[stacks.Frame]], rec: record.Record) -> tuple[str, int] | None:
    frame = message.call_site(rec, frames)
    return (frame.path, frame.line) if frame is not None else None
