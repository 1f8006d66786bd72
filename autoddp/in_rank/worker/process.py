"""What runs inside each worker process: set the process up, run the job, report, leave.

Forked workers enter through ``run_job_forked`` (called by torch.distributed.elastic's
multiprocessing); fresh interpreters through ``python -m autoddp.in_rank.worker FOLDER``.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import gc
import io
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any

import torch

from autoddp.core import _compat, _variables, _warn, environment
from autoddp.core._compat import forks
from autoddp.core.errors import AutoDDPError
from autoddp.in_rank.run_folder import finished, stacks, transport
from autoddp.in_rank.worker import stdin
from autoddp.in_rank.worker.running import Job, portable, run_in_world
from autoddp.in_rank.world import placement


def run_job_forked(job: Job, folder: str) -> None:
    """Entry point of a forked worker. Returns only on success, as elastic expects."""
    own_session()
    # Objects inherited from the caller are not ours to collect: freeing one that owns a thread
    # in the caller (a TCPStore server, say) would wait forever for a thread this copy lacks.
    gc.freeze()
    code = _execute(job, folder)
    if code:
        _leave(code, run_atexit=False)  # atexit handlers belong to the parent we were forked from


def main() -> None:
    """Entry point of a fresh worker interpreter (``python -m autoddp.in_rank.worker FOLDER``)."""
    folder = sys.argv[1]
    _set_up_process()
    try:
        own = _pin_own_gpu()  # before the job's CUDA tensors are restored (on the own GPU, not cuda:0)
        where = None if own is None else placement.restore_cuda_on(own)
        job = transport.load_job(folder, where)  # pickled once for all attempts; the folder is this attempt's
        _warn.use_filters(job.warning_filters)  # (a forked worker has the caller's already)
    except BaseException as exc:
        transport.save_error(folder, int(os.environ.get("RANK", "0")), exc)
        _leave(1)
    _leave(_execute(job, folder))


def _pin_own_gpu() -> int | None:
    """Make this worker's own GPU the current one before anything touches CUDA; its index.

    Every CUDA context this process creates then lands on its own GPU, never on cuda:0.
    """
    own = placement.own_gpu(environment.detect().world(), torch.cuda.device_count())
    if own is not None:
        torch.cuda.set_device(own)
    return own


def _execute(job: Job, folder: str) -> int:
    _set_up_process()
    start_method_of_caller(job.start_method)
    world = environment.detect().world()
    give_stdin(world.rank)
    whole_lines()
    STACK_DUMP.arm(folder, world.rank)
    try:
        if job.backend.use_cuda and forks.cuda_in_bad_fork():
            raise AutoDDPError(
                "CUDA was initialised in the calling process before the workers were forked; "
                "use start_method='spawn' (or 'auto', which detects this)"
            )
        if not forks.cuda_in_bad_fork():
            _pin_own_gpu()  # (forked workers too: a run on gloo beside GPUs computes there as well)
        result = run_in_world(job, world, finish=functools.partial(_leaving, world.rank))
        if world.rank == 0:
            transport.save_result(folder, result, job.fn_name)
        finished.mark(world.rank, finished.ENDED)
        return 0
    except BaseException as exc:
        stdin.note_eof(exc, world.rank)
        transport.save_error(folder, world.rank, exc)
        return 1


def _leaving(rank: int, result: Any) -> Any:
    """The function returned: from here on the launcher expects this worker to end (``launch.exits``)."""
    finished.mark(rank, finished.LEAVING)
    return portable(result)


class _StackDump:
    """Writes this worker's Python stacks to the run folder when autoddp stops it (SIGTERM).

    If a collective timed out on another rank, this shows where the rank that never arrived
    was stuck; the caller reads it only then. The file must stay open while armed.
    """

    def __init__(self) -> None:
        self.file: Any = None

    def arm(self, folder: str, rank: int) -> None:
        if self.file is not None or not hasattr(signal, "SIGTERM"):
            return
        path = stacks.stack_path(folder, rank)
        self.file = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")
        faulthandler.register(signal.SIGTERM, file=self.file, all_threads=True, chain=True)


STACK_DUMP = _StackDump()


def _set_up_process() -> None:
    """Signals, parent-death and thread settings every worker needs."""
    if threading.current_thread() is threading.main_thread():
        # The caller handles Ctrl-C and stops the workers; SIGTERM must kill at once even
        # while a collective blocks in C++ (a Python handler would wait for it to return).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    die_with_parent()
    _FORKS.make_children_die_with_this_worker()
    use_thread_count()


def start_method_of_caller(method: str | None) -> None:
    """Give ``multiprocessing`` the start method the caller had (None: not chosen yet).

    A worker that multiprocessing forked has it set to fork, and a fresh interpreter has none
    chosen; the user's own ``multiprocessing.set_start_method("spawn")`` must find what it would
    find in the caller (in a plain ``python script.py``: nothing chosen, so it succeeds).
    """
    multiprocessing.set_start_method(method, force=True)


def give_stdin(rank: int) -> None:
    """Rank 0 reads the launcher's standard input, the other ranks an empty one, as under torchrun.

    torchrun's workers share its stdin and rank 0, which starts first, reads it; a worker started
    by multiprocessing finds ``sys.stdin`` on /dev/null (``EOFError`` from ``input()`` on every
    rank) and a fresh interpreter the shared stream: here rank 0 always has it, and the others
    find its end at once (file descriptor 0 too, for the programs they start).
    """
    if rank != 0:
        empty = os.open(os.devnull, os.O_RDONLY)
        os.dup2(empty, 0)
        os.close(empty)
    elif _reads_descriptor_0(sys.stdin):
        return
    try:
        os.fstat(0)
    except OSError:  # the launcher has no stdin: leave Python's as it is
        return
    encoding = getattr(sys.__stdin__, "encoding", None)
    errors = getattr(sys.__stdin__, "errors", None)
    sys.stdin = open(0, encoding=encoding, errors=errors, closefd=False)  # noqa: SIM115 (the process's own)


def whole_lines() -> None:
    """Each line of this rank's output in one write, where ``PYTHONUNBUFFERED=1`` (common in
    containers) has ``print`` write its pieces one by one: ranks share the console, and the
    ``[rank N]`` prefixing reads their files line by line, so a piece of one rank's line could be
    joined to another's. Output still leaves at every newline and every flush; a line left
    unfinished without a flush waits for its end (lost if the process is killed meanwhile)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.write_through:
            with contextlib.suppress(Exception):  # (a stream that cannot be reconfigured: as it is)
                stream.reconfigure(write_through=False, line_buffering=True)


def _reads_descriptor_0(stream: Any) -> bool:
    try:
        return not stream.closed and stream.fileno() == 0
    except (AttributeError, OSError, ValueError):
        return False


def own_session() -> None:
    """Leave the launcher's session, as torchrun's workers and autoddp's fresh interpreters do.

    Linux shares the CPU between sessions first (``sched_autogroup``): forked workers left in the
    launcher's session would share one session's share against other sessions' load (1.15x longer
    epochs on a busy machine, ``benchmarks/epoch_time.py``). The terminal's signals then reach the
    launcher only, which stops the workers; the kernel still kills them if it dies.
    """
    with contextlib.suppress(OSError):  # already a session leader
        os.setsid()


def use_thread_count() -> None:
    """Compute with the threads ``OMP_NUM_THREADS`` says: a forked worker's torch read the variable
    in the parent, at its import, before the launcher set it for this worker."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel kill this process if its parent dies (no orphans holding GPUs or data).

    ``parent``: the pid the parent had (default: ``AUTODDP_PARENT_PID``), to catch a parent that
    died before the request took effect.
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if parent is None:
        known = os.environ.get(_variables.PARENT_PID, "")
        parent = int(known) if known.isdigit() else None
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the parent died before prctl took effect


class _Forks:
    """Processes this worker forks from its main thread (DataLoader workers, pools) die with it.

    A worker stopped by a signal cannot stop its children itself; without this they would live
    on until their own watchdog noticed (seconds for DataLoader workers). Only forks from the
    main thread: the kernel ties the signal to the thread that forked, and the main thread lives
    as long as the process.
    """

    def __init__(self) -> None:
        self.registered = False
        self.from_main: tuple[bool, int] = (False, 0)

    def make_children_die_with_this_worker(self) -> None:
        if self.registered or not hasattr(os, "register_at_fork"):
            return
        os.register_at_fork(before=self._before, after_in_child=self._after_in_child)
        self.registered = True

    def _before(self) -> None:
        self.from_main = (threading.current_thread() is threading.main_thread(), os.getpid())

    def _after_in_child(self) -> None:
        from_main, parent = self.from_main
        if from_main:
            die_with_parent(parent)


_FORKS = _Forks()


def _leave(code: int, run_atexit: bool = True) -> None:
    """Exit now: flush output and run atexit hooks, but skip the slow interpreter teardown.

    This process's own children (DataLoader workers, persistent ones too) are killed first:
    left alone they would notice the exit only at their next watchdog check, seconds later.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream must not block the exit
            stream.flush()
    if run_atexit:
        _compat.run_atexit_hooks()
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()
    os._exit(code)
