"""Exception and warning classes of autoddp; each message says what to do about it."""

from __future__ import annotations


class AutoDDPError(Exception):
    """Base class of every error autoddp raises itself."""


class AutoDDPWarning(UserWarning):
    """The category of every warning autoddp gives (each text begins ``autoddp:``): silence them all
    with ``warnings.filterwarnings("ignore", category=autoddp.AutoDDPWarning)``."""


class ConfigurationError(AutoDDPError, ValueError):
    """A bad option, argument or environment: raised before any process starts."""


class SerializationError(AutoDDPError):
    """A function, argument or return value could not be sent between processes."""


class WorkerError(AutoDDPError):
    """A worker process died without a Python exception (killed, ``os._exit``, crash).

    ``rank`` is the global rank of the worker, ``exitcode`` its exit status (negative for a
    signal, as in :mod:`subprocess`), ``signal`` the signal name when it was killed by one.
    """

    def __init__(self, message: str, *, rank: int, exitcode: int | None, signal: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.signal = signal

    def __reduce__(self):
        return (_rebuild_worker_error, (self.args[0], self.rank, self.exitcode, self.signal))


def _rebuild_worker_error(message: str, rank: int, exitcode: int | None, signal: str | None) -> WorkerError:
    return WorkerError(message, rank=rank, exitcode=exitcode, signal=signal)


class NodesError(AutoDDPError):
    """A machine of a run on several machines did not join in time, or ended its run (its workers
    failed with no restarts left): the other machines stop instead of waiting for it."""


class UnevenBatchesError(AutoDDPError, RuntimeError):
    """Ranks drew different numbers of batches from a DataLoader: the one that ran out first left
    the others waiting in a collective (raised in the caller; the original error is its cause)."""


class RemoteError(AutoDDPError):
    """A worker raised an exception that could not be re-created in the caller as itself.

    ``type_name`` is the qualified name of the original exception type, ``rank`` the rank
    that raised it; the original traceback is in the message.
    """

    def __init__(self, message: str, *, rank: int, type_name: str):
        super().__init__(message)
        self.rank = rank
        self.type_name = type_name

    def __reduce__(self):
        return (_rebuild_remote_error, (self.args[0], self.rank, self.type_name))


def _rebuild_remote_error(message: str, rank: int, type_name: str) -> RemoteError:
    return RemoteError(message, rank=rank, type_name=type_name)


class RemoteTraceback(Exception):
    """Carries the formatted traceback of a worker; attached as ``__cause__`` of re-raised errors."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class Rank0Error(AutoDDPError):
    """Raised on every other rank when the body of a ``rank0()`` block failed on rank 0.

    ``type_name`` and ``message`` describe rank 0's exception (rank 0 re-raises the original).
    """

    def __init__(self, message: str, *, type_name: str = "", detail: str = ""):
        super().__init__(message)
        self.type_name = type_name
        self.detail = detail

    def __reduce__(self):
        return (_rebuild_rank0_error, (self.args[0], self.type_name, self.detail))


def _rebuild_rank0_error(message: str, type_name: str, detail: str) -> Rank0Error:
    return Rank0Error(message, type_name=type_name, detail=detail)


class CollectiveInRank0Error(AutoDDPError):
    """A collective (barrier, all_reduce, ...) was called inside a ``rank0()`` body.

    Only rank 0 runs that body, so the collective could never complete: it would hang.
    """


class MemoryPlanError(AutoDDPError, RuntimeError):
    """A process ran out of memory under the plan ``strategy="auto"`` took (``plan``).

    ``next_plan``: the plan the launcher restarts every rank with, once (None: none is left, or
    the run was restarted for memory already). The out-of-memory error is its cause.
    """

    def __init__(self, message: str, *, plan: str, next_plan: str | None):
        super().__init__(message)
        self.plan = plan
        self.next_plan = next_plan

    def __reduce__(self):
        return (_rebuild_memory_plan_error, (self.args[0], self.plan, self.next_plan))


def _rebuild_memory_plan_error(message: str, plan: str, next_plan: str | None) -> MemoryPlanError:
    return MemoryPlanError(message, plan=plan, next_plan=next_plan)


class TorchCompatibilityError(AutoDDPError, RuntimeError):
    """This torch lacks a private piece autoddp relies on (it changed between releases).

    Raised by ``autoddp.core._compat`` instead of guessing; the message names the piece and the fix.
    """
