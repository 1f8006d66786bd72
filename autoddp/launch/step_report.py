"""The caller's half of the step report: one short block on the console, from every rank's record.

At the end of a run on this machine whose workers took optimizer steps, and whenever the caller
gets ``SIGUSR1`` while its workers run (``on_request``), ``words`` reads the ranks' step records
(``in_rank.run_folder.step_record``, kept by ``in_rank.step_report``) and says, in at most 8 lines:

- the steps and samples per second;
- each rank's share of a step waiting for data, computing and waiting in collectives (up to
  five ranks a row each; more: rank 0, the slowest and the median of the others);
- the slowest rank, by how much later than the others it arrives at a step, and in which phase
  of its own (data or computing) it spends the longer time. Every rank ends a step together (the
  gradients' all-reduce), so the rank the others wait for is the one that waits least: the others
  wait, on the mean, the difference. It is named when that is at least ``STRAGGLER_SHARE`` of a
  step; else the ranks arrive together.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import threading
from collections.abc import Iterator

from autoddp.core._warn import say
from autoddp.in_rank.run_folder import step_record
from autoddp.in_rank.run_folder.step_record import Totals

#: A rank is named a straggler when the others wait for it at least this share of a step.
STRAGGLER_SHARE = 0.1
#: Ranks shown a row each; with more, rank 0, the slowest and the median of the others.
ROWS = 5
#: The signal that asks the caller for the report while the workers run.
REQUEST_SIGNAL = getattr(signal, "SIGUSR1", None)

_WHY = {
    "data": "its data loading takes {excess} longer (a slow dataset or disk? more DataLoader workers?)",
    "compute": "its computing takes {excess} longer (another job on its device? uneven work?)",
}


def words(ranks: list[Totals], so_far: bool = False) -> list[str]:
    """The report's lines (without ``autoddp:``), or none before two optimizer steps on two ranks."""
    timed = [t for t in ranks if t.steps > 0 and t.seconds > 0]
    if len(timed) < 2:
        return []
    step = statistics.fmean(t.seconds / t.steps for t in timed)
    samples = sum(t.samples / t.seconds for t in timed)
    rate = f"{1 / step:.1f} steps/s" + (f", {samples:.0f} samples/s" if samples else "")
    steps = max(t.all_steps for t in timed)
    when = "so far" if so_far else "at the end"
    lines = [
        f"step report {when}: {steps} optimizer steps on {len(timed)} processes, {rate} "
        f"(the first step not timed)",
        f"  rank   data  compute  collectives   (share of a {_ms(step)} step{_which(timed)})",
    ]
    slowest, lag = straggler(timed)
    for label, t in _rows(timed, slowest):
        shares = [value / t.seconds for value in (t.data, t.compute, t.waited)]
        lines.append(f"  {label:>4}  {shares[0]:>5.0%}  {shares[1]:>7.0%}  {shares[2]:>11.0%}")
    lines.append(_verdict(timed, slowest, lag, step))
    return lines


def straggler(ranks: list[Totals]) -> tuple[Totals, float]:
    """The rank the others wait for (the one that waits least a step), and their median wait for it."""
    waits = {t.rank: t.waited / t.steps for t in ranks}
    slowest = min(ranks, key=lambda t: waits[t.rank])
    lag = statistics.median(w for rank, w in waits.items() if rank != slowest.rank) - waits[slowest.rank]
    return slowest, max(lag, 0.0)


def phase(ranks: list[Totals], slowest: Totals) -> tuple[str, float]:
    """Where the slowest rank's own time is longer than the others': "data" or "compute", and by how
    much a step (over the median of the others)."""
    others = [t for t in ranks if t.rank != slowest.rank]
    excess = {
        "data": slowest.data / slowest.steps - statistics.median(t.data / t.steps for t in others),
        "compute": slowest.compute / slowest.steps - statistics.median(t.compute / t.steps for t in others),
    }
    name = max(excess, key=excess.__getitem__)
    return name, excess[name]


def _verdict(ranks: list[Totals], slowest: Totals, lag: float, step: float) -> str:
    if lag < STRAGGLER_SHARE * step:
        return f"  no straggler: the ranks arrive within {_ms(lag)} of each other"
    name, excess = phase(ranks, slowest)
    why = _WHY[name].format(excess=_ms(max(excess, 0.0)))
    share = f"{lag / step:.0%} of a step"
    return f"  rank {slowest.rank} arrives {_ms(lag)} after the others each step ({share}): {why}"


def _rows(ranks: list[Totals], slowest: Totals) -> list[tuple[str, Totals]]:
    """A row per rank, or for many: rank 0, the slowest and the median of the others (by waiting)."""
    if len(ranks) <= ROWS:
        return [(str(t.rank), t) for t in ranks]
    shown = [ranks[0]] + ([slowest] if slowest.rank != ranks[0].rank else [])
    rest = [t for t in ranks if t not in shown]
    middle = sorted(rest, key=lambda t: t.waited / t.seconds)[len(rest) // 2]
    return [(str(t.rank), t) for t in [*shown, middle]]


def _which(ranks: list[Totals]) -> str:
    return f"; of {len(ranks)} ranks: 0, the slowest, the median" if len(ranks) > ROWS else ""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def say_report(folder: str, so_far: bool = False) -> None:
    """Print the report of the run whose run folder is ``folder`` (nothing before two steps). A
    report that cannot be made is one line: it never turns a run that succeeded into a failure."""
    try:
        lines = words(step_record.read(folder), so_far)
    except Exception as error:
        lines = [f"no step report: {type(error).__name__}: {error}"]
    for line in lines:
        say(line)


@contextlib.contextmanager
def on_request(folder: str | None) -> Iterator[None]:
    """While the workers run: ``SIGUSR1`` to this process prints the report so far, from the
    records in ``folder`` (None: no report; the main thread only: only it has signal handlers).
    Installed after the workers started, so that a forked worker keeps the signal's own action."""
    if folder is None or REQUEST_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(REQUEST_SIGNAL, lambda signum, frame: say_report(folder, so_far=True))
    try:
        yield
    finally:
        signal.signal(REQUEST_SIGNAL, previous)
