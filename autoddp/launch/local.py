"""Local launch: start one worker per device on this machine, restart the group after a failure.

The caller hosts the rendezvous store on a port the OS picks (so two jobs can never race for
one), starts the workers by fork where that is safe and as fresh interpreters otherwise, waits
until all succeed or one fails (then stops the rest), and hands back rank 0's result or the
root-cause failure as the original exception. Every attempt gets a fresh run folder and store.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from autoddp.core import _variables, _warn
from autoddp.core._warn import one_line, say
from autoddp.core.environment import preflight
from autoddp.core.errors import ConfigurationError, MemoryPlanError, SerializationError, WorkerError
from autoddp.in_rank.hang import record as hang_record
from autoddp.in_rank.run_folder import transport
from autoddp.in_rank.worker import process, stdin
from autoddp.in_rank.worker.running import Job
from autoddp.launch import diagnostics, failures, step_report
from autoddp.launch.contract import Contract, worker_envs
from autoddp.launch.exits import Exits
from autoddp.launch.failures import first_failure
from autoddp.launch.hang.watch import Watch
from autoddp.launch.output import Output, announce_exit, show_hidden_output
from autoddp.launch.request import Request, Script
from autoddp.launch.start_method import choose_start_method, preload_for_forked_workers
from autoddp.launch.store import loopback_store
from autoddp.launch.supervise import POLL_SECONDS, acting_on_signals, supervise

#: For one attempt's run folder: the entry point and each local rank's arguments.
Workers = Callable[[str], tuple[Any, dict[int, tuple]]]


def run_function(job: Job, nproc: int, request: Request) -> Any:
    """Run ``job`` in ``nproc`` new workers; return rank 0's result.

    ``request.store``: the address and port its store listens on (``master=``; no port: a free one).

    After a failure the whole group starts again, up to ``request.max_restarts`` times (not for
    errors that would only repeat: a bad configuration, something that cannot be pickled). Ranks
    that wait for others longer than ``request.hang_report`` seconds are reported
    (``launch.hang.watch``; 0: off).
    """
    start_method = request.start_method
    if job.backend.use_cuda:
        preflight.before_workers(nproc)  # GPUs the caller's own CUDA context would deny them
    method, reason = choose_start_method(start_method, job.backend)
    if method == "spawn" and start_method == "auto":
        # Shown once per process (warnings' default filter): the fallback needs no action.
        _warn.warn(
            f"autoddp starts its workers as fresh interpreters (start_method='spawn') because {reason}; "
            "the function and its arguments are sent to them by value."
        )
    stdin.give_back_read_ahead()  # (rank 0 reads on where the caller stopped)
    if method == "spawn":  # pickle once, before anything starts: an unpicklable argument fails here
        payload = transport.dumps_job(job, job.fn, job.args, job.kwargs)

        def workers(folder: str) -> tuple[Any, dict[int, tuple]]:
            transport.save_job(folder, payload)
            return sys.executable, {r: ("-m", "autoddp.in_rank.worker", folder) for r in range(nproc)}

    else:
        preload_for_forked_workers(job.args, job.kwargs, job.options.capture)

        def workers(folder: str) -> tuple[Any, dict[int, tuple]]:
            return process.run_job_forked, {r: (job, folder) for r in range(nproc)}

    contract = Contract(nproc, max_restarts=request.max_restarts, host=request.store[0])
    with acting_on_signals():
        return _with_restarts(workers, contract, method, request, returns=True)


def run_script(script: Script, nproc: int, request: Request) -> None:
    """Run a script (as ``python -m autoddp.in_rank.worker.script ARGV`` would) in ``nproc`` workers.

    The ``autoddp`` command's single-node engine: the same supervision, loopback store,
    restarts and hang report as the decorator. Workers are forked from this process, which has imported torch
    already (and what DDP construction imports), where CUDA is untouched; else they start as
    fresh interpreters (``request.start_method`` chooses: torchrun's flag). ``request.store``: the
    address and port the store listens on (``MASTER_ADDR``/``MASTER_PORT``; no port: a free one).
    Raises the first failure (the worker printed its traceback).
    """
    argv = list(script.argv)
    method, _ = choose_start_method(request.start_method, None)
    if method == "fork":
        # (not at the top: `python -m autoddp.in_rank.worker.script` must find it new)
        from autoddp.in_rank.worker.script import run_script_forked

        preload_for_forked_workers((), {}, capture=True)

        def workers(folder: str) -> tuple[Any, dict[int, tuple]]:
            return run_script_forked, {r: (list(argv),) for r in range(nproc)}

    else:

        def workers(folder: str) -> tuple[Any, dict[int, tuple]]:
            return sys.executable, {r: ("-m", "autoddp.in_rank.worker.script", *argv) for r in range(nproc)}

    contract = Contract(nproc, request.role, request.max_restarts, request.store[0])
    with acting_on_signals(for_good=True):  # (the command's process: it ends next)
        _with_restarts(workers, contract, method, request)


def _with_restarts(
    workers: Workers, contract: Contract, method: str, request: Request, returns: bool = False
) -> Any:
    """Run attempts until one succeeds or ``contract.max_restarts`` restarts are spent.

    ``returns``: rank 0 writes a result (a function's), which a run must not end without.
    """
    output = request.output
    poll_seconds = POLL_SECONDS if request.monitor_interval is None else request.monitor_interval
    reports, port = (request.hang_report, request.step_report), request.store[1]
    max_restarts, nproc = contract.max_restarts, contract.nproc
    attempt, restarts, plan = 0, 0, None
    while True:
        try:
            return _attempt(
                workers, contract, method, (attempt, plan), poll_seconds, output, reports, port, returns
            )
        except (ConfigurationError, SerializationError, KeyboardInterrupt):
            raise
        except MemoryPlanError as error:  # strategy="auto" ran out of memory: the next plan, once
            if error.next_plan is None or plan is not None:
                raise
            plan = error.next_plan
            say(f"{one_line(error)}; restarting all {nproc} workers once with {plan}")
        except BaseException as error:
            if restarts == max_restarts or not isinstance(error, Exception):
                raise
            restarts += 1
            say(f"{one_line(error)}; restarting all {nproc} workers (restart {restarts} of {max_restarts})")
        attempt += 1


def _attempt(
    workers: Workers,
    contract: Contract,
    method: str,
    start: tuple[int, str | None],
    poll_seconds: float,
    output: Output,
    reports: tuple[float, bool],
    port: int | None,
    returns: bool = False,
) -> Any:
    """One start of all workers, in a fresh run folder with a fresh store (no stale keys);
    ``start``: the attempt's number and the plan strategy="auto" starts from (None: the cheapest);
    ``reports``: the hang report's seconds (0: off) and whether the step report is on."""
    nproc = contract.nproc
    attempt, plan = start
    hang_report, steps = reports
    with transport.run_folder() as folder, hang_record.folder() as records:
        entry, entry_args = workers(folder)
        with loopback_store(nproc, contract.host, port) as port:
            envs = worker_envs(contract, port, uuid.uuid4().hex, attempt, folder)
            logs = output.logs_specs(folder, nproc)
            for env in envs.values():  # autoddp.print(all_ranks=True) must not prefix twice
                env[_variables.LINE_PREFIX] = "1" if output.prefixed else "0"
                if hang_report > 0 or steps:  # the workers keep their hang records there (the
                    env[_variables.HANG_FOLDER] = records  # step report counts their waits)
                if steps:  # each worker's step record goes into the run folder
                    env[_variables.STEP_REPORT] = "1"
                if plan is not None:
                    env[_variables.PLAN_FLOOR] = plan
            watch = functools.partial(_watching, records, nproc, hang_report, folder if steps else None)
            exits = Exits(folder, nproc, returns=returns)
            context, result = supervise(entry, entry_args, envs, method, poll_seconds, logs, watch, exits)
        if result.is_failed() and exits.report({f.local_rank for f in result.failures.values()}):
            if returns and not transport.has_result(folder):
                raise WorkerError(
                    "rank 0 finished your function but never ended, before its result was written "
                    "(see its stacks above); nothing to return",
                    rank=0,
                    exitcode=-signal.SIGTERM,
                    signal="SIGTERM",
                )
        elif result.is_failed():
            error = first_failure(context, result, folder, nproc, records if hang_report > 0 else "")
            error = _ended_without_result(exits, context, folder, error)
            traces = diagnostics.keep_traces(folder, output.log_dir)
            if traces is not None:  # (the run folder goes with the run)
                say(diagnostics.traces_line(traces))
            show_hidden_output(error, result, output.shown(nproc))
            announce_exit(error, nproc)
            raise error
        gone = exits.without_result(failures.exit_codes(context))
        if gone:  # (every rank exited at once: elastic saw them all done)
            raise exits.without_result_error(gone)
        if steps:
            step_report.say_report(folder)
        return transport.load_result(folder)


@contextlib.contextmanager
def _watching(records: str, nproc: int, hang_report: float, steps: str | None) -> Iterator[None]:
    """While the workers run: the hang report's watch, and the step report on request (``steps``:
    the run folder where the workers keep their step records; None: no step report)."""
    with Watch(records, nproc, hang_report), step_report.on_request(steps):
        yield


def _ended_without_result(exits: Exits, context: Any, folder: str, error: BaseException) -> BaseException:
    """``error``, or the ranks that ended without their function's result (``Exits.without_result``)
    where ``error`` only lost them (a peer's connection closed, a timeout): they are the cause."""
    gone = exits.without_result(failures.exit_codes(context))
    lead = failures.lead_report(transport.load_errors(folder).values())
    if not gone or (lead is not None and not (lead.is_consequence or lead.is_timeout)):
        return error
    cause = exits.without_result_error(gone)
    cause.add_note(f"autoddp: the others then lost it: {one_line(error)}")
    return cause
