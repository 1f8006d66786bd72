"""Launching: start one worker per device through torch.distributed.elastic, supervise, report.

The caller hosts the rendezvous store on a port the OS picks (so two jobs can never race for
one), starts the workers by fork where that is safe and as fresh interpreters otherwise, waits
until all succeed or one fails (then stops the rest), and hands back rank 0's result or the
first failure as the original exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from autoddp import _worker, environment, hardware, transport
from autoddp.errors import ConfigurationError, SerializationError, WorkerError
from autoddp.process_group import Backend
from autoddp.state import RunOptions

START_METHODS = ("auto", "fork", "spawn")
_POLL_SECONDS = 0.05
_STOP_GRACE_SECONDS = 5


@dataclasses.dataclass(frozen=True)
class Output:
    """Which ranks' output reaches the console, and where every rank's output is kept.

    ``ranks``: ``"0"`` (default: rank 0 only, as written), ``"all"`` (every rank, each line
    prefixed ``[rank N]``) or comma-separated local ranks. Every rank's stdout and stderr also
    go to files under ``log_dir`` (a private folder removed after the run when unset); the last
    lines of a failed rank that the console did not show are printed when it fails.
    """

    ranks: str = "0"
    log_dir: str | None = None

    def shown(self, nproc: int) -> set[int]:
        if self.ranks == "all":
            return set(range(nproc))
        try:
            shown = {int(r) for r in self.ranks.split(",")}
        except ValueError:
            raise ConfigurationError(
                f"ranks={self.ranks!r}: use '0', 'all' or comma-separated local ranks such as '0,1'"
            ) from None
        if not shown or not shown <= set(range(nproc)):
            raise ConfigurationError(f"ranks={self.ranks!r} names ranks outside 0..{nproc - 1}")
        return shown

    def logs_specs(self, folder: str, nproc: int) -> tuple[Any, dict[int, str]]:
        """Elastic's log settings for a run.

        Shown ranks write straight to the console (a terminal stays a terminal: progress bars
        redraw, colours stay); hidden ranks write to files. With ``"all"`` every rank goes
        through a file so that its lines can be prefixed. When this process's stdout is not a
        real file (captured, redirected to a StringIO), forked workers could not redirect
        theirs: then everything passes through unfiltered.
        """
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        shown = self.shown(nproc)
        if not _real_stdio():
            return DefaultLogsSpecs(log_dir=os.devnull), {}
        log_dir = self.log_dir or os.path.join(folder, "logs")
        if self.ranks == "all":
            specs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL, tee=Std.ALL)
            return specs, {r: f"[rank {r}] " for r in range(nproc)}
        redirects = {r: (Std.NONE if r in shown else Std.ALL) for r in range(nproc)}
        return DefaultLogsSpecs(log_dir=log_dir, redirects=redirects), {}


def _real_stdio() -> bool:
    try:
        sys.stdout.fileno()
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def choose_start_method(requested: str, backend: Backend) -> tuple[str, str]:
    """Resolve ``start_method`` to ``"fork"`` or ``"spawn"``, with the reason for the choice."""
    if requested not in START_METHODS:
        raise ConfigurationError(
            f"unknown start_method {requested!r}: use 'auto' (default), 'fork' or 'spawn'"
        )
    fork_ok, why = _fork_is_safe()
    if requested == "fork":
        if not fork_ok:
            raise ConfigurationError(f"start_method='fork' cannot be used here: {why}; use 'spawn' or 'auto'")
        return "fork", "asked for"
    if requested == "spawn":
        return "spawn", "asked for"
    return ("fork", why) if fork_ok else ("spawn", why)


def _fork_is_safe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, "fork is used on Linux only"
    if hardware.gpu_count() > 0 and (torch.cuda.is_initialized() or _cuda_poisons_fork()):
        return False, (
            "CUDA was already initialised in this process (for example by "
            "torch.cuda.is_available()), and forked workers could not use it"
        )
    return True, "CUDA is untouched in this process"


def _cuda_poisons_fork() -> bool:
    """Ask a throw-away forked child whether torch marked it as a bad (post-CUDA) fork."""
    in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", None)
    if in_bad_fork is None:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(1 if in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0


def worker_envs(
    nproc: int, port: int, run_id: str, attempt: int = 0, folder: str = ""
) -> dict[int, dict[str, str]]:
    """The variables each worker gets, named as torchrun names them."""
    common = {
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": environment.LOOPBACK,
        "MASTER_PORT": str(port),
        # The caller hosts the store: rank 0 connects to it instead of binding the port.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "AUTODDP_RUN_ID": run_id,
        "AUTODDP_PARENT_PID": str(os.getpid()),
        "AUTODDP_RUN_FOLDER": folder,  # where a worker reports its error
        "TORCHELASTIC_RESTART_COUNT": str(attempt),  # as torchrun names it: 0 on the first attempt
        "TORCHELASTIC_RUN_ID": run_id,
    }
    if "OMP_NUM_THREADS" not in os.environ:
        common["OMP_NUM_THREADS"] = str(max(1, hardware.cpu_count() // nproc))
    return {r: {**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)}


def launch(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    nproc: int,
    backend: Backend,
    start_method: str,
    timeout: Any,
    options: RunOptions,
    max_restarts: int = 0,
    output: Output = Output(),
) -> Any:
    """Run ``fn(*args, **kwargs)`` in ``nproc`` new workers; return rank 0's result.

    After a failure the whole group starts again, up to ``max_restarts`` times (not for errors
    that would only repeat: a bad configuration, something that cannot be pickled).
    """
    method, reason = choose_start_method(start_method, backend)
    if method == "spawn" and start_method == "auto":
        # Shown once per process (warnings' default filter): the fallback needs no action.
        warnings.warn(
            f"autoddp starts its workers as fresh interpreters (start_method='spawn') because {reason}; "
            "the function and its arguments are sent to them by value.",
            UserWarning,
            stacklevel=4,
        )
    if method == "spawn":  # pickle once, before anything starts: an unpicklable argument fails here
        payload = transport.dumps_job(
            _worker.Job(fn, args, kwargs, backend, timeout, options, ""), fn, args, kwargs
        )

        def workers(folder: str) -> tuple[Any, dict[int, tuple]]:
            transport.save_job(folder, payload)
            return sys.executable, {r: ("-m", "autoddp._worker_main", folder) for r in range(nproc)}

    else:

        def workers(folder: str) -> tuple[Any, dict[int, tuple]]:
            job = _worker.Job(fn, args, kwargs, backend, timeout, options, folder)
            return _worker.run_forked, {r: (job,) for r in range(nproc)}

    return _with_restarts(workers, nproc, method, max_restarts, output=output)


def launch_nodes(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    plan: Any,
    nproc: int,
    backend: Backend,
    timeout: Any,
    options: RunOptions,
    max_restarts: int = 0,
) -> Any:
    """This machine's share of a multi-node run of ``fn`` (fresh interpreters, elastic's agent).

    Returns rank 0's result on the machine that runs rank 0, None on the others.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from autoddp import nodes

    payload = transport.dumps_job(
        _worker.Job(fn, args, kwargs, backend, timeout, options, ""), fn, args, kwargs
    )
    with transport.run_folder() as folder:
        transport.save_job(folder, payload)
        try:
            with _caller_signal_handlers_kept():
                nodes.run_agent(
                    plan, nproc, ["-m", "autoddp._worker_main", folder], max_restarts=max_restarts
                )
        except ChildFailedError as error:
            reports = transport.load_errors(folder)
            if reports:
                report = min(reports.values(), key=lambda r: (r.is_consequence, r.time))
                raise report.rebuild(nproc * plan.max_nodes) from None
            raise WorkerError(
                nodes.describe_failure(error, nproc * plan.max_nodes),
                rank=error.get_first_failure()[0],
                exitcode=None,
            ) from None
        except SignalException as error:
            _say(f"{error.sigval.name} received: stopped all workers on this node")
            if error.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            signal.raise_signal(error.sigval)
            raise
        return transport.load_result(folder)


def launch_script(
    argv: list[str],
    *,
    nproc: int,
    max_restarts: int = 0,
    poll_seconds: float = _POLL_SECONDS,
    output: Output = Output(),
) -> None:
    """Run a script (``python -m autoddp._script ARGV``) in ``nproc`` fresh interpreters.

    The ``autoddp`` command's single-node engine: the same supervision, loopback store and
    restarts as the decorator. Raises the first failure (the worker printed its traceback).
    """

    def workers(folder: str) -> tuple[Any, dict[int, tuple]]:
        return sys.executable, {r: ("-m", "autoddp._script", *argv) for r in range(nproc)}

    _with_restarts(workers, nproc, "spawn", max_restarts, poll_seconds, output)


Workers = Callable[[str], tuple[Any, dict[int, tuple]]]


def _with_restarts(
    workers: Workers,
    nproc: int,
    method: str,
    max_restarts: int,
    poll_seconds: float = _POLL_SECONDS,
    output: Output = Output(),
) -> Any:
    """Run attempts until one succeeds or ``max_restarts`` restarts are spent."""
    for attempt in range(max_restarts + 1):
        try:
            return _attempt(workers, nproc, method, attempt, poll_seconds, output)
        except (ConfigurationError, SerializationError, KeyboardInterrupt):
            raise
        except BaseException as error:
            if attempt == max_restarts or not isinstance(error, Exception):
                raise
            _say(
                f"{one_line(error)}; restarting all {nproc} workers (restart {attempt + 1} of {max_restarts})"
            )
    raise AssertionError("unreachable")  # pragma: no cover


def _attempt(
    workers: Workers, nproc: int, method: str, attempt: int, poll_seconds: float, output: Output
) -> Any:
    """One start of all workers, in a fresh run folder with a fresh store (no stale keys)."""
    with transport.run_folder() as folder:
        entry, entry_args = workers(folder)
        with loopback_store(nproc) as port:
            envs = worker_envs(nproc, port, uuid.uuid4().hex, attempt, folder)
            logs = output.logs_specs(folder, nproc)
            for env in envs.values():  # autoddp.print(all_ranks=True) must not prefix twice
                env["AUTODDP_LINE_PREFIX"] = "1" if logs[1] else "0"
            context, result = _supervise(entry, entry_args, envs, method, poll_seconds, logs)
        if result.is_failed():
            error = _first_failure(context, result, folder, nproc)
            _show_hidden_output(error, result, output.shown(nproc))
            raise error
        return transport.load_result(folder)


def _say(message: str) -> None:
    """One line for the user on stderr."""
    print(f"autoddp: {message}", file=sys.stderr, flush=True)


def one_line(error: BaseException) -> str:
    """The type and first line of an error's message."""
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextlib.contextmanager
def loopback_store(nproc: int) -> Iterator[int]:
    """The rendezvous store of a single-node run, hosted here and reachable from this machine only.

    The listening socket is bound to loopback before torch's TCPStore takes it over (a TCPStore
    binding by itself listens on every interface). The port is the one in ``MASTER_PORT`` if the
    user set it, else one the operating system picks, so simultaneous jobs never race for a port.
    Only the port leaves this function: the store must not outlive the run in some reference
    cycle, where a later forked worker's garbage collection would try to stop its server thread.
    """
    import socket

    from torch.distributed import TCPStore

    requested = os.environ.get("MASTER_PORT", "0")
    if not requested.isdigit() or int(requested) > 65535:
        raise ConfigurationError(f"MASTER_PORT={requested!r} is not a port number; fix or unset it")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((environment.LOOPBACK, int(requested)))
    except OSError as exc:
        listener.close()
        raise ConfigurationError(
            f"MASTER_PORT={requested} cannot be used ({exc.strerror}); another program holds it. "
            "Unset MASTER_PORT to let autoddp pick a free port, or choose another."
        ) from None
    listener.listen(max(128, nproc))
    try:
        store = TCPStore(
            environment.LOOPBACK,
            listener.getsockname()[1],
            nproc,
            is_master=True,
            wait_for_workers=False,
            # shared with any other store this process opens on the port (elastic's rendezvous)
            multi_tenant=True,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now and closes it when it goes
    try:
        yield store.port
    finally:
        del store


def _supervise(
    entry: Any,
    entry_args: dict,
    envs: dict,
    method: str,
    poll_seconds: float,
    logs: tuple[Any, dict[int, str]],
) -> Any:
    """Start the workers with elastic's multiprocessing and wait for all to end or one to fail."""
    from torch.distributed.elastic.multiprocessing import start_processes
    from torch.distributed.elastic.multiprocessing.api import SignalException

    logs_specs, prefixes = logs
    with _caller_signal_handlers_kept(), elastic_logs_quiet():
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # forked children must not inherit unflushed output
        context = None
        try:
            context = start_processes(
                name="autoddp",
                entrypoint=entry,
                args=entry_args,
                envs=envs,
                logs_specs=logs_specs,
                log_line_prefixes=prefixes,
                start_method="fork" if method == "fork" else "spawn",
            )
            return context, context.wait(period=poll_seconds)
        except SignalException as exc:  # (start_processes closes its workers itself if it fails)
            if context is not None:
                context.close(timeout=_STOP_GRACE_SECONDS)
            stopped_by = exc.sigval
        except BaseException:
            if context is not None:
                context.close(timeout=_STOP_GRACE_SECONDS)
            raise
    # Handlers are the caller's again: act on the signal as the caller's process would have.
    _say(f"{stopped_by.name} received: stopped all workers")
    if stopped_by == signal.SIGINT:
        raise KeyboardInterrupt from None
    signal.raise_signal(stopped_by)
    raise WorkerError(f"workers stopped by {stopped_by.name}", rank=-1, exitcode=None, signal=stopped_by.name)


@contextlib.contextmanager
def _caller_signal_handlers_kept() -> Iterator[None]:
    """Elastic installs its own handlers while workers run; give the caller's back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


@contextlib.contextmanager
def elastic_logs_quiet() -> Iterator[None]:
    """Elastic logs every stop and failure; autoddp reports failures itself."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.Logger.manager.loggerDict)
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing"))
    ]
    previous = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, was in zip(loggers, previous, strict=True):
            logger.disabled = was


def _show_hidden_output(error: BaseException, result: Any, shown: set[int], lines: int = 20) -> None:
    """Print the last lines of a failed rank whose output the console did not show."""
    rank = getattr(error, "autoddp_rank", getattr(error, "rank", None))
    if not isinstance(rank, int) or rank in shown:
        return
    tail: list[str] = []
    for path in (result.stdouts.get(rank), result.stderrs.get(rank)):
        if path and os.path.isfile(path):
            with open(path, errors="replace") as handle:
                tail += handle.read().splitlines()[-lines:]
    if tail:
        console = ", ".join(map(str, sorted(shown)))
        _say(f"last lines of rank {rank}'s output (the console shows rank(s) {console}):")
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in tail[-lines:]))
        sys.stderr.flush()


def _exit_codes(context: Any) -> dict[int, int | None]:
    """Exit status of every worker of an ended elastic context, by local rank."""
    if hasattr(context, "subprocess_handlers"):  # fresh interpreters
        return {r: h.proc.poll() for r, h in context.subprocess_handlers.items()}
    processes = context._pc.processes if getattr(context, "_pc", None) else []  # forked workers
    return {r: p.exitcode for r, p in enumerate(processes)}


def _first_failure(context: Any, result: Any, folder: str, world_size: int) -> BaseException:
    """The exception to raise in the caller: the root-cause failure, others listed briefly.

    A worker's own exception comes first unless it only reports a lost connection to a peer
    (a consequence); a worker that died without an exception counts as a cause. Workers that
    autoddp itself stopped afterwards (SIGTERM) are not failures.
    """
    reports = transport.load_errors(folder)
    codes = _exit_codes(context)
    for failure in result.failures.values():
        codes.setdefault(failure.local_rank, failure.exitcode)
    # (is a consequence of another failure, when, rank, exception, one-line summary)
    entries: list[tuple[bool, float, int, BaseException, str]] = []
    for rank, report in reports.items():
        entries.append(
            (report.is_consequence, report.time, rank, report.rebuild(world_size), report.summary())
        )
    detected_at = time.time()
    for rank, code in sorted(codes.items()):
        if rank not in reports and code not in (0, None, -signal.SIGTERM):
            error = _death_error(rank, code, context.pids().get(rank), world_size)
            entries.append((False, detected_at, rank, error, str(error)))
    if not entries:  # only stopped workers: report the one elastic saw first
        first = min(result.failures.values(), key=lambda f: f.timestamp)
        error = _death_error(first.local_rank, first.exitcode, first.pid, world_size)
        entries.append((False, detected_at, first.local_rank, error, str(error)))
    entries.sort(key=lambda e: (e[0], e[1]))
    lead_rank, lead = entries[0][2], entries[0][3]
    others = [f"rank {rank}: {summary}" for _, _, rank, _, summary in entries[1:]]
    if others and hasattr(lead, "add_note"):
        lead.add_note("autoddp: other ranks also failed: " + "; ".join(others))
    report = reports.get(lead_rank)
    if report is not None and report.is_timeout and hasattr(lead, "add_note"):
        _explain_timeout(lead, folder, codes, reports)
    return lead


def _explain_timeout(lead: BaseException, folder: str, codes: dict[int, int | None], reports: dict) -> None:
    """Name the ranks that never reached the collective, and show where they were."""
    stuck = sorted(r for r, code in codes.items() if r not in reports and code == -signal.SIGTERM)
    if not stuck:
        return
    lead.add_note(
        f"autoddp: a collective timed out; rank(s) {', '.join(map(str, stuck))} had not arrived "
        "(still running elsewhere when autoddp stopped them). Raise timeout= in @distributed if the "
        "first steps are legitimately slow."
    )
    for rank in stuck:
        stack = transport.read_stack(folder, rank)
        if stack:
            lead.add_note(f"autoddp: where rank {rank} was when stopped:\n{stack}")


def _death_error(rank: int, code: int | None, pid: int | None, world_size: int) -> WorkerError:
    where = f"rank {rank} of {world_size} (pid {pid})"
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        hint = {
            "SIGKILL": " (the kernel's out-of-memory killer sends SIGKILL: check memory use and `dmesg`)",
            "SIGSEGV": " (a crash in native code)",
            "SIGBUS": " (a crash in native code; in containers, often a too small /dev/shm)",
            "SIGABRT": " (aborted by native code)",
        }.get(name, "")
        return WorkerError(f"{where} was killed by {name}{hint}", rank=rank, exitcode=code, signal=name)
    return WorkerError(
        f"{where} exited with code {code} without raising a Python exception "
        "(os._exit or sys.exit in a worker, or a native library exiting)",
        rank=rank,
        exitcode=code,
    )
