"""Failure triage: which rank's failure is the root cause, how each death is named, and where the
ranks that never reached a timed-out collective were (also when NCCL's watchdog aborted a rank
that waited in one: its hang record still says so)."""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Iterable
from typing import Any

from autoddp.core import _compat, _frames
from autoddp.core.errors import UnevenBatchesError, WorkerError
from autoddp.in_rank.hang import record
from autoddp.in_rank.run_folder import stacks, transport
from autoddp.in_rank.run_folder.finished import finished_ranks
from autoddp.launch.hang import message


@dataclasses.dataclass(frozen=True)
class Ended:
    """How this machine's workers ended, by global rank.

    ``codes``: each worker's exit status (None while unknown); ``pids``: their process ids;
    ``first``: the failure elastic saw first (rank, exit status, pid); ``first_rank``: the
    global rank of this machine's local rank 0 (the hang records are kept by local rank).
    """

    codes: dict[int, int | None]
    pids: dict[int, int | None]
    first: tuple[int, int | None, int | None]
    first_rank: int = 0


def exit_codes(context: Any) -> dict[int, int | None]:
    """Exit status of every worker of an ended elastic context, by local rank."""
    if hasattr(context, "subprocess_handlers"):  # fresh interpreters
        return {r: h.proc.poll() for r, h in context.subprocess_handlers.items()}
    return _compat.forked_exit_codes(context)


def first_failure(
    context: Any, result: Any, folder: str, world_size: int, records: str = ""
) -> BaseException:
    """The exception to raise in the caller of a run on this machine (see ``root_cause``)."""
    codes = exit_codes(context)
    for failure in result.failures.values():
        codes.setdefault(failure.local_rank, failure.exitcode)
    first = min(result.failures.values(), key=lambda f: f.timestamp)
    ended = Ended(codes, context.pids(), (first.local_rank, first.exitcode, first.pid))
    return root_cause(ended, folder, world_size, records)


def agent_failure(error: Any, nproc: int, folder: str, world_size: int, records: str = "") -> BaseException:
    """The exception to raise on this machine after elastic's agent raised ``ChildFailedError``.

    The agent names only the workers that had failed when it looked; it stopped the rest
    (SIGTERM), except those whose code had already run to its end.
    """
    failures = error.failures
    rank, failure = error.get_first_failure()
    first_rank = rank - failure.local_rank
    said = finished_ranks(folder)
    codes: dict[int, int | None] = {
        r: (0 if r in said else -signal.SIGTERM) for r in range(first_rank, first_rank + nproc)
    }
    codes.update({r: f.exitcode for r, f in failures.items()})
    pids = {r: f.pid for r, f in failures.items()}
    ended = Ended(codes, pids, (rank, failure.exitcode, failure.pid), first_rank)
    lead = root_cause(ended, folder, world_size, records)
    reports = transport.load_errors(folder)
    report = reports.get(getattr(lead, "autoddp_rank", getattr(lead, "rank", None)))
    late_here = any(code == -signal.SIGTERM and r not in reports for r, code in codes.items())
    waited = report is not None and (report.is_consequence or (report.is_timeout and not late_here))
    if waited and hasattr(lead, "add_note"):
        lead.add_note(ELSEWHERE_NOTE)
    return lead


#: The note on this machine's root cause when its ranks only lost (or waited for) another machine's.
ELSEWHERE_NOTE = (
    "autoddp: this machine's ranks lost (or waited for) ranks of another machine: the failure "
    "began there, and its launcher names the root cause"
)


def triage_order(report: transport.ErrorReport) -> tuple[bool, float]:
    """The triage's one order of the failures ranks reported: a rank's own failure before one
    that only lost a peer (a consequence), then the earliest."""
    return report.is_consequence, report.time


def lead_report(reports: Iterable[transport.ErrorReport]) -> transport.ErrorReport | None:
    """The report the triage leads with (``triage_order``), or None for none."""
    return min(reports, key=triage_order, default=None)


def root_cause(ended: Ended, folder: str, world_size: int, records: str = "") -> BaseException:
    """The exception to raise in the caller: the root-cause failure, others listed briefly.

    A worker's own exception comes first unless it only reports a lost connection to a peer
    (a consequence); a worker that died without an exception counts as a cause. Workers that
    autoddp itself stopped afterwards (SIGTERM) are not failures. ``records``: the hang records'
    folder, read when a rank died of a signal while it waited in a collective.
    """
    reports = transport.load_errors(folder)
    codes = ended.codes
    # (is a consequence of another failure, when, rank, exception, one-line summary)
    entries: list[tuple[bool, float, int, BaseException, str]] = []
    for rank, report in reports.items():
        entries.append((*triage_order(report), rank, report.rebuild(world_size), report.summary()))
    detected_at = time.time()
    for rank, code in sorted(codes.items()):
        if rank not in reports and code not in (0, None, -signal.SIGTERM):
            error = _death_error(rank, code, ended.pids.get(rank), world_size)
            entries.append((False, detected_at, rank, error, str(error)))
    if not entries:  # only stopped workers: report the one elastic saw first
        error = _death_error(*ended.first, world_size)
        entries.append((False, detected_at, ended.first[0], error, str(error)))
    entries.sort(key=lambda e: (e[0], e[1]))
    lead_rank, lead = entries[0][2], entries[0][3]
    others = [f"rank {rank}: {summary}" for _, _, rank, _, summary in entries[1:]]
    if others and hasattr(lead, "add_note"):
        lead.add_note("autoddp: other ranks also failed: " + "; ".join(others))
    if records and lead_rank not in reports and isinstance(lead, WorkerError) and lead.signal:
        _explain_death(lead, lead_rank, records, folder, ended)
    report = reports.get(lead_rank)
    if report is not None and report.is_timeout and hasattr(lead, "add_note"):
        _explain_timeout(lead, folder, codes, reports)
    if report is not None and (report.is_consequence or report.is_timeout):
        _explain_finished(lead, lead_rank, codes, reports, finished_ranks(folder))
        return _uneven_batches(lead, folder, world_size)
    return lead


def _explain_finished(
    lead: BaseException, lead_rank: int, codes: dict[int, int | None], reports: dict, said: set[int]
) -> None:
    """A rank that ended while ``lead_rank`` still waited for it: say that this is the cause.

    Only the ranks in ``said`` ran their code to its end; one that exited with status 0 without
    saying so left early (``sys.exit(0)``, ``os._exit(0)``).
    """
    if not hasattr(lead, "add_note"):
        return
    others = {r for r in set(codes) | said if r not in reports and r != lead_rank}
    finished = sorted(r for r in others if r in said)
    exited = sorted(r for r in others if r not in said and codes.get(r) == 0)
    advice = (
        "a rank that leaves early (a rank-dependent break or exit, early stopping on its own loss, "
        "fewer batches than the others) leaves the others waiting. Take such decisions on a value "
        "every rank shares (reduced with dist.all_reduce, or rank 0's broadcast)"
    )
    if finished:
        ranks = ", ".join(map(str, finished))
        lead.add_note(
            f"autoddp: rank {ranks} had already ended well (its code ran to the end) while rank "
            f"{lead_rank} still waited for it in a collective: {advice}"
        )
    if exited:
        ranks = ", ".join(map(str, exited))
        lead.add_note(
            f"autoddp: rank {ranks} had exited with status 0 before its code ran to its end (sys.exit, "
            f"os._exit) while rank {lead_rank} still waited for it in a collective: {advice}"
        )


def _uneven_batches(lead: BaseException, folder: str, world_size: int) -> BaseException:
    """``lead``, or the error naming the rank that ran out of batches first where one did."""
    from autoddp.in_rank.capture import passes

    sentence = passes.uneven(folder, world_size)
    if sentence is None:
        return lead
    error = UnevenBatchesError(sentence)
    error.__cause__ = lead
    return error


def _explain_timeout(lead: BaseException, folder: str, codes: dict[int, int | None], reports: dict) -> None:
    """Name the ranks that never reached the collective, and show where they were."""
    stuck = sorted(r for r, code in codes.items() if r not in reports and code == -signal.SIGTERM)
    if not stuck:
        return
    lead.add_note(
        f"autoddp: a collective timed out; rank(s) {', '.join(map(str, stuck))} had not arrived "
        "(still running elsewhere when autoddp stopped them). Raise timeout= in @distributed "
        "(autoddp --timeout for a script) if the first steps are legitimately slow."
    )
    for rank in stuck:
        stack = _without_our_threads(stacks.read_stack(folder, rank))
        if stack:
            lead.add_note(f"autoddp: where rank {rank} was when stopped:\n{stack}")


def _explain_death(lead: BaseException, lead_rank: int, records: str, folder: str, ended: Ended) -> None:
    """A rank killed while it waited in a collective (NCCL's watchdog aborts with SIGABRT once a
    collective has not completed within the timeout): name the ranks that had not arrived, and where."""
    now = time.monotonic()
    local = {rank: rank - ended.first_rank for rank in ended.codes}
    judged = {rank: record.judged(record.read(record.record_path(records, local[rank]))) for rank in local}
    dead = judged.get(lead_rank)
    if dead is None or not dead.active or not dead.in_collective:
        return
    site = message.call_site(dead, {})
    at = f" at {site.shown()}" if site is not None else ""
    queued = " (called, not completed)" if dead.kind == record.QUEUED else ""
    late = {
        rank: rec
        for rank, rec in sorted(judged.items())
        if rank != lead_rank and rec is not None and rec.active and not rec.in_collective
    }
    waited = f"rank {lead_rank} died while it waited in {dead.what}{at}{queued}, for {now - dead.since:.1f} s"
    if not late:
        lead.add_note(f"autoddp: {waited}; every other rank was in a collective too")
        return
    ranks = ", ".join(map(str, late))
    watchdog = (
        " NCCL's watchdog aborts a rank (SIGABRT) whose collective has not completed within the "
        "timeout; if the late rank's work is legitimately long, raise the timeout (timeout= in "
        "@distributed, or init_process_group(timeout=...) in a script)"
    )
    why = watchdog if getattr(lead, "signal", None) == "SIGABRT" else ""
    lead.add_note(f"autoddp: {waited}: rank {ranks} had not arrived (in no collective).{why}")
    for rank, rec in late.items():
        stack = _without_our_threads(stacks.read_stack(folder, rank))
        doing = f"in no collective for {now - rec.since:.1f} s"
        lead.add_note(
            f"autoddp: where rank {rank} was when stopped ({doing}):\n{stack or '(no stack written)'}"
        )


def _without_our_threads(stack: str) -> str:
    """A faulthandler dump without the hang report's own poller thread, each thread's stack cut
    where the script runner's frames begin (neither is the user's business)."""
    kept = []
    for block in stack.split("\n\n"):
        if f" in {record.POLLER}\n" in block + "\n":
            continue
        lines = block.splitlines()
        end = next((n for n, line in enumerate(lines) if _frames.runner_line(line)), len(lines))
        kept.append("\n".join(lines[:end]))
    return "\n\n".join(kept)


def _death_error(rank: int, code: int | None, pid: int | None, world_size: int) -> WorkerError:
    where = f"rank {rank} of {world_size} (pid {pid})"
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        hint = {
            "SIGKILL": " (the kernel's out-of-memory killer sends SIGKILL: check memory use and `dmesg`)",
            "SIGSEGV": " (a crash in native code)",
            "SIGBUS": " (a crash in native code; in containers, often a too small /dev/shm)",
            "SIGABRT": " (aborted by native code; NCCL's watchdog aborts a rank whose collective timed out)",
        }.get(name, "")
        return WorkerError(f"{where} was killed by {name}{hint}", rank=rank, exitcode=code, signal=name)
    return WorkerError(
        f"{where} exited with code {code} without raising a Python exception "
        "(os._exit or sys.exit in a worker, or a native library exiting)",
        rank=rank,
        exitcode=code,
    )
