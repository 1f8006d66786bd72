"""The words of the hang report: who waits in what, at which line; who has not arrived, and where."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from autoddp.in_rank.hang import record
from autoddp.launch.hang import stacks, verdict

_LIBRARY_FRAMES = 4  # library frames shown below a late rank's own (where its code called into)
_USER_FRAMES = 12
_PATH_LINE = re.compile(r"(\S+\.py):(\d+)")
_PARTITION = "a network partition, or that machine stalls"


@dataclasses.dataclass(frozen=True)
class Lost:
    """The nodes the heartbeat cannot hear from, in words (``node 1 of 2 unreachable since
    18:16:05 (12 s)``): in node 0's view of every node by global rank (``ranks``), in one node's
    own view as a list (``nodes``)."""

    ranks: Mapping[int, str] = dataclasses.field(default_factory=dict)
    nodes: tuple[str, ...] = ()


def lines(
    situation: verdict.Situation,
    frames: Mapping[int, list[stacks.Frame]],
    now: float,
    seconds: float,
    repeat: float,
    node: str = "",
    lost: Lost = Lost(),
) -> list[str]:
    """The report on ``situation`` (``frames``: stacks by local rank), one line per item; the
    ranks of unreachable nodes (``lost``) are named as such, not by their last record."""
    head = f"hang report{f' ({node})' if node else ''}"
    if situation.kind == verdict.RANK0_BUSY:
        return [_rank0_busy(situation, now)]
    waits = "; ".join(_waits(situation.waiting, frames, now))
    if situation.kind == verdict.MISMATCH:
        text = [
            f"{head}: the ranks wait in collectives that do not match: {waits}. Every rank must call "
            "the same collectives in the same order"
        ]
    elif situation.kind == verdict.TOGETHER:
        text = [
            f"{head}: {waits}: every rank of this node waits, for ranks that run on other nodes "
            "(each node reports its own ranks)"
        ]
        text += [f"  {words}: its ranks cannot reach this node's ({_PARTITION})" for words in lost.nodes]
    else:
        missing = [r.rank for r in situation.late] + _global(situation, situation.absent)
        text = [f"{head}: {_ranks(missing)} {_has(missing)} not arrived; {waits}"]
        text += [line for late in situation.late for line in _late(late, frames.get(late.local_rank), now)]
        absent = _global(situation, situation.absent)
        text += [
            f"  {_ranks([rank])} is not running your code (still starting, or already done)"
            for rank in absent
            if rank not in lost.ranks
        ]
        for words in dict.fromkeys(lost.ranks[rank] for rank in absent if rank in lost.ranks):
            ranks = [rank for rank in absent if lost.ranks.get(rank) == words]
            does = "it does" if len(ranks) == 1 else "they do"
            text.append(f"  {_ranks(ranks)}: {words}, so what {does} is not known ({_PARTITION})")
        text += [f"  {words}: its ranks cannot reach this node's ({_PARTITION})" for words in lost.nodes]
        if situation.other_nodes:
            text.append("  (ranks on other nodes: each node reports its own)")
    minutes = f"{repeat / 60:g} minutes" if repeat >= 60 and repeat % 60 == 0 else f"{repeat:g} s"
    goes_on = "" if situation.kind == verdict.MISMATCH else ": the run goes on when the late ranks arrive"
    if lost.nodes or set(lost.ranks) & set(_global(situation, situation.absent)):
        goes_on = ": the run goes on if the unreachable nodes answer again before the collective's timeout"
    text.append(
        f"  nothing is stopped{goes_on}; this report repeats at most every {minutes} while this lasts "
        f"(hang_report={seconds:g} s; 0 turns it off)"
    )
    return text


def _rank0_busy(situation: verdict.Situation, now: float) -> str:
    ranks = [r.rank for r in situation.waiting]
    block = rank0_block(situation.waiting[0].site)
    if situation.late:
        how = f"rank 0 has been running it for {_age(now, situation.late[0].since)}: not a hang"
    else:
        how = "rank 0 runs on another node"
    return f"{_ranks(ranks)} {_verb(ranks, 'wait')} for {block} ({how})"


def rank0_block(where: str) -> str:
    """``rank 0's rank0() block at train.py:88`` from rank0()'s own name for a block."""
    return f"rank 0's {_block(where)}"


def _block(where: str) -> str:
    """``rank0() block at train.py:88`` from ``the rank0() block at /path/to/train.py:88``."""
    where = _PATH_LINE.sub(lambda m: stacks.where(m.group(1), int(m.group(2))), where)
    return where[4:] if where.startswith("the ") else where


def _waits(
    waiting: tuple[record.Record, ...], frames: Mapping[int, list[stacks.Frame]], now: float
) -> list[str]:
    """``rank 0 waits in all_reduce at train.py:12 (step) for 65 s``, ranks grouped by call."""
    groups: dict[str, list[record.Record]] = {}
    for rec in waiting:
        if rec.kind == record.WAITS_FOR_RANK0:
            call = f"for {rank0_block(rec.site)} to end"
        else:
            frame = call_site(rec, frames)
            at = f" at {frame.shown()}" if frame is not None else ""
            queued = " (called, not completed)" if rec.kind == record.QUEUED else ""
            call = f"in {rec.what}{at}{queued}"
        groups.setdefault(call, []).append(rec)
    said = []
    for call, recs in groups.items():
        ranks = [r.rank for r in recs]
        oldest = min(r.since for r in recs)
        said.append(f"{_ranks(ranks)} {_verb(ranks, 'wait')} {call}, for {_age(now, oldest)}")
    return said


def call_site(rec: record.Record, frames: Mapping[int, list[stacks.Frame]]) -> stacks.Frame | None:
    """Where ``rec`` waits: its collective's call for one not completed, else its stack's own frame."""
    site = record.pending_frame(rec) if rec.kind == record.QUEUED else None
    if site is not None:
        return stacks.Frame(*site)
    return stacks.innermost_user(frames.get(rec.local_rank, []))


def _late(late: record.Record, frames: list[stacks.Frame] | None, now: float) -> list[str]:
    """A rank that has not arrived: what it does, and its stack, the user's frames first."""
    if late.kind == record.RUNS_RANK0:
        doing = f"runs the {_block(late.site)} (for {_age(now, late.since)})"
    elif late.kind == record.WAITS_FOR_RANK0:
        doing = f"waits for {rank0_block(late.site)} (for {_age(now, late.since)})"
    elif late.in_collective:
        doing = f"waits in {late.what} (for {_age(now, late.since)})"
    else:
        doing = f"in no collective for {_age(now, late.since)}"
    if not frames:
        return [f"  rank {late.rank}: {doing}; its stack could not be read"]
    user, inner = stacks.users_first(frames)
    text = [f"  rank {late.rank}: {doing}; its stack, your code first (most recent call first):"]
    text += [f"    {frame.shown()}" for frame in user[:_USER_FRAMES]]
    if len(user) > _USER_FRAMES:
        text.append(f"    ... {len(user) - _USER_FRAMES} more")
    if inner:
        called = " <- ".join(frame.shown() for frame in inner[:_LIBRARY_FRAMES])
        more = " ..." if len(inner) > _LIBRARY_FRAMES else ""
        text.append(f"    inside libraries: {called}{more}")
    return text


def _global(situation: verdict.Situation, local: tuple[int, ...]) -> list[int]:
    """Global ranks of this node's local ranks (the node's ranks are consecutive)."""
    some = (situation.waiting + situation.late)[0]
    return [some.rank - some.local_rank + rank for rank in local]


def _ranks(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 1..7``, ``ranks 0, 2, 5..7``."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = [f"{run[0]}..{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return "ranks " + ", ".join(parts)


def _verb(ranks: list[int], verb: str) -> str:
    return verb + ("s" if len(set(ranks)) == 1 else "")


def _has(ranks: list[int]) -> str:
    return "has" if len(set(ranks)) == 1 else "have"


def _age(now: float, since: float) -> str:
    seconds = max(0.0, now - since)
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds / 60:.1f} min"
