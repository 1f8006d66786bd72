"""What travels between the caller and its workers: the job, rank 0's result, error reports.

Everything goes through one private run folder (mode 0700, files 0600, removed at the end),
pickled with cloudpickle so functions defined in ``__main__``, closures and notebook cells
travel by value. The job and the result are written in torch's own format (``torch.save`` with
that pickler), so tensors travel as raw storage bytes instead of through pickle (a 1 GiB tensor
in seconds, not tens of seconds). Exceptions travel without calling their ``__init__`` again,
so those whose constructor takes other arguments than their message come back as themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import sys
import time
import traceback
import types
from collections.abc import Callable
from typing import Any, BinaryIO

import cloudpickle
import torch

from autoddp.core import _frames
from autoddp.core._leftovers import private_folder
from autoddp.core.errors import RemoteError, RemoteTraceback, SerializationError
from autoddp.in_rank.run_folder.importable import ByValue

_PAYLOAD = "job.pkl"
_PATH = "sys_path.json"
_RESULT = "result.pkl"


def run_folder() -> contextlib.AbstractContextManager[str]:
    """A private temporary folder for one launch, removed afterwards (after a SIGKILL, by a later
    start: ``_leftovers``)."""
    return private_folder("autoddp-")


def write_private(path: str, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` (bytes, or a function writing to a file) to ``path`` atomically, for this user only."""
    partial = f"{path}.{os.getpid()}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    os.replace(partial, path)


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, but code sent by value keeps its file name (worker tracebacks show source),
    exceptions are rebuilt without calling their ``__init__`` (see ``_rebuild_exception``), and
    functions and classes of modules a fresh interpreter cannot import go by value (``importable``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._by_value = ByValue()  # functions of modules a fresh interpreter cannot import

    def dump(self, obj: Any) -> None:
        with self._by_value.pickling():
            super().dump(obj)

    def reducer_override(self, obj: Any) -> Any:
        self._by_value.consider(obj)
        if type(obj) is types.CodeType:
            rebuild, args = self.dispatch_table[types.CodeType](obj)[:2]
            return rebuild, tuple(obj.co_filename if arg == "<dynamic-code>" else arg for arg in args)
        if isinstance(obj, BaseException) and _reduces_like_base_exception(type(obj)):
            return _rebuild_exception, (type(obj), obj.args, dict(getattr(obj, "__dict__", {})))
        return super().reducer_override(obj)


def _reduces_like_base_exception(cls: type) -> bool:
    """True when ``cls`` pickles through BaseException's own reduction (type, args, __dict__)."""
    return cls.__reduce_ex__ is BaseException.__reduce_ex__ and cls.__reduce__ is BaseException.__reduce__


def _rebuild_exception(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    """An instance of ``cls`` with ``args`` and attributes ``state``, its ``__init__`` not called.

    Pickle would call ``cls(*args)``, which fails for ``class Diverged(Exception): def
    __init__(self, step, loss)``, whose ``args`` hold only the message.
    """
    if isinstance(cls.__init__, types.WrapperDescriptorType):  # no __init__ of its own: call it
        exc = cls(*args)  # (SystemExit sets .code, StopIteration .value there)
    else:
        try:
            exc = BaseException.__new__(cls)
        except TypeError:  # a base with its own layout and constructor
            exc = cls.__new__(cls, *args)
        exc.args = args
    exc.__dict__.update(state)
    return exc


class _PickleModule:
    """What ``torch.save`` takes as ``pickle_module``: autoddp's pickler."""

    Pickler = _Pickler


class _ResultPickler(_Pickler):
    """For what a worker sends back: classes of ``__main__`` that this process's ``__main__``
    holds go by reference. Under fork that ``__main__`` is the caller's own, so the caller gets
    instances of its own classes (by value they would be copies: ``isinstance`` false, not
    picklable there); in a fresh interpreter they are not there and go by value, as sent."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) and _in_main(obj):
            return NotImplemented  # pickle's own: by reference
        return super().reducer_override(obj)


class _ResultPickleModule:
    Pickler = _ResultPickler


def _in_main(cls: type) -> bool:
    """True for a class defined in ``__main__`` that ``__main__`` still holds under its name."""
    return cls.__module__ == "__main__" and _from_main(cls.__qualname__) is cls


def _from_main(qualname: str) -> Any:
    """What this process's ``__main__`` holds under ``qualname`` (``Outer.Inner``), or None."""
    found: Any = sys.modules.get("__main__")
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


def dumps(obj: Any) -> bytes:
    """Pickle ``obj``, sending functions and classes that cannot be imported by value."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _torch_dump(obj: Any, file: BinaryIO, pickle_module: type = _PickleModule) -> None:
    """``obj`` in torch's format (tensors as raw storage), pickled with autoddp's pickler."""
    torch.save(obj, file, pickle_module=pickle_module, pickle_protocol=pickle.HIGHEST_PROTOCOL)


def _torch_load(file: str | BinaryIO, map_location: Any = None) -> Any:
    return torch.load(file, map_location=map_location, weights_only=False)


# --- the job -------------------------------------------------------------------------------


def dumps_job(job: Any, fn: Any, args: tuple, kwargs: dict) -> bytes:
    """Pickle ``job`` by value; if that fails, name the function or argument at fault."""
    try:
        buffer = io.BytesIO()
        _torch_dump(job, buffer)
        return buffer.getvalue()
    except Exception as exc:
        culprit = _find_unpicklable(fn, args, kwargs) or "the job"
        raise SerializationError(
            f"{culprit} cannot be sent to fresh worker processes ({type(exc).__name__}: {exc}). "
            "Create it inside the decorated function instead, or pass something picklable "
            "(a path, a config); start_method='fork' avoids pickling where CUDA is not yet in use."
        ) from exc


def _find_unpicklable(fn: Any, args: tuple, kwargs: dict) -> str | None:
    candidates = [(f"the function {getattr(fn, '__qualname__', fn)!r}", fn)]
    candidates += [(f"positional argument {i} ({type(a).__name__})", a) for i, a in enumerate(args)]
    candidates += [(f"argument {k!r} ({type(v).__name__})", v) for k, v in kwargs.items()]
    for label, value in candidates:
        try:
            dumps(value)
        except Exception:
            return label
    return None


def save_job(folder: str, payload: bytes) -> None:
    write_private(os.path.join(folder, _PATH), json.dumps(sys.path).encode())
    write_private(os.path.join(folder, _PAYLOAD), payload)


def load_job(folder: str, map_location: Any = None) -> Any:
    """Load the job in a fresh worker, first giving it the caller's import path.

    ``map_location``: where the caller's CUDA tensors go (the worker's own GPU, not cuda:0).
    """
    sys.path[:] = json.loads(_read(os.path.join(folder, _PATH)))
    return _torch_load(os.path.join(folder, _PAYLOAD), map_location)


# --- rank 0's return value -----------------------------------------------------------------


def save_result(folder: str, value: Any, fn_name: str) -> None:
    """Write rank 0's (already portable) return value for the caller."""
    try:
        path = os.path.join(folder, _RESULT)
        write_private(path, lambda file: _torch_dump(value, file, _ResultPickleModule))
    except Exception as exc:
        raise SerializationError(
            f"the return value of {fn_name}() ({type(value).__name__}) cannot be sent back to the "
            f"caller ({type(exc).__name__}: {exc}); return something picklable, such as tensors, "
            "numbers or a state_dict"
        ) from exc


def has_result(folder: str) -> bool:
    """Whether rank 0 wrote its result."""
    return os.path.exists(os.path.join(folder, _RESULT))


def load_result(folder: str) -> Any:
    """Rank 0's return value, every tensor on the CPU (``portable`` moved those it could reach;
    one inside an object of the user's comes to the CPU here, so the caller never gets a CUDA
    context it did not have, nor a tensor on a GPU it did not choose)."""
    path = os.path.join(folder, _RESULT)
    if not os.path.exists(path):
        return None
    return _torch_load(path, "cpu")


# --- errors --------------------------------------------------------------------------------


#: Messages that mark an error as a consequence of another rank dying mid-collective.
_TIMEOUT_MARKERS = ("Timed out", "timed out", "Application timeout caused pair closure")
_CONSEQUENCE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "NCCL communicator was aborted",
)


@dataclasses.dataclass
class ErrorReport:
    """What a worker tells the caller about the exception that ended it."""

    rank: int
    time: float
    type_name: str
    message: str
    traceback: str
    pickled: bytes | None

    @property
    def is_timeout(self) -> bool:
        """True for a collective that gave up waiting for the other ranks. Gloo says so in two
        ways: the wait that ran out says "Timed out waiting", and every other operation in flight
        on that rank's pairs says "Application timeout caused pair closure"; either may surface."""
        return any(m in self.message for m in _TIMEOUT_MARKERS) or "Timeout" in self.type_name

    @property
    def is_consequence(self) -> bool:
        """True for errors caused by another rank's failure: a collective losing its connection,
        or ``Rank0Error`` (rank 0's block failed; rank 0 reports the original)."""
        own = self.type_name.rsplit(".", 1)[-1] == "Rank0Error"  # (not CollectiveInRank0Error: a cause)
        return own or any(m in self.message for m in _CONSEQUENCE_MARKERS)

    def summary(self) -> str:
        first_line = self.message.splitlines()[0] if self.message else ""
        return f"{self.type_name}: {first_line}" if first_line else self.type_name

    def rebuild(self, world_size: int) -> BaseException:
        """The original exception (its type and args as raised), marked with its rank and carrying
        the worker's traceback."""
        exc: BaseException | None = None
        if self.pickled is not None:
            try:
                exc = pickle.loads(self.pickled)
            except Exception:
                exc = None
        tag = f"rank {self.rank} of {world_size}"
        if isinstance(exc, BaseException):
            exc = _as_callers_class(exc)
        if not isinstance(exc, BaseException):
            return RemoteError(
                f"[{tag}] {self.summary()}\n\n{self.traceback}", rank=self.rank, type_name=self.type_name
            )
        # Its args stay as raised (``except KeyError as e: e.args[0]`` sees the key): the rank is
        # shown in a note (Python 3.11+) and in the worker's traceback, its cause (every Python).
        with contextlib.suppress(AttributeError, TypeError):
            exc.autoddp_rank = self.rank  # type: ignore[attr-defined]
            exc.autoddp_world_size = world_size  # type: ignore[attr-defined]
        exc.__cause__ = RemoteTraceback(f"\n\nTraceback of {tag} (the worker that raised):\n{self.traceback}")
        if hasattr(exc, "add_note"):
            with contextlib.suppress(TypeError):  # (__notes__ made something else than a list)
                exc.add_note(f"autoddp: [{tag}] raised this; the worker's traceback is shown above.")
        return exc


def _as_callers_class(exc: BaseException) -> BaseException:
    """``exc`` as an instance of the caller's own class of that name, for classes of ``__main__``.

    A class defined in the caller's script or notebook travels by value, so the copy that comes
    back is another class object and ``except TheirError:`` would not catch it.
    """
    cls = type(exc)
    if cls.__module__ != "__main__":
        return exc
    theirs = _from_main(cls.__qualname__)
    if theirs is cls or not isinstance(theirs, type) or not issubclass(theirs, BaseException):
        return exc
    if theirs.__name__ != cls.__name__:
        return exc
    return _rebuild_exception(theirs, exc.args, dict(getattr(exc, "__dict__", {})))


class _ByReference(pickle.Pickler):
    """Plain pickle (classes by reference, so the caller gets its own class), exceptions as above."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, BaseException) and _reduces_like_base_exception(type(obj)):
            return _rebuild_exception, (type(obj), obj.args, dict(getattr(obj, "__dict__", {})))
        return NotImplemented


def _pickle_exception(exc: BaseException) -> bytes | None:
    """``exc`` pickled so that it loads back as itself: by reference where it can, else by value."""
    for pickler in (_ByReference, _Pickler):
        try:
            buffer = io.BytesIO()
            pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(exc)
            pickle.loads(buffer.getvalue())
        except Exception:
            continue
        return buffer.getvalue()
    return None


def save_error(folder: str, rank: int, exc: BaseException) -> None:
    """Record ``exc`` for the caller (called in the worker, before it exits)."""
    write_private(os.path.join(folder, f"error-{rank}.pkl"), pickle.dumps(_report(rank, exc)))


def save_early(folder: str, exc: BaseException, where: str) -> None:
    """Rank 0's record of its ``rank0()`` body's failure at ``where``, apart (rank 0 may catch it and go
    on): ``load_errors`` reads it only to explain another rank's ``Rank0Error`` for that block."""
    write_private(os.path.join(folder, "early-0.pkl"), pickle.dumps((where, _report(0, exc))))


def rank0_failed(where: str) -> str:
    """How a ``Rank0Error`` for the block at ``where`` that failed on rank 0 begins."""
    return f"{where} failed on rank 0 with "


def _report(rank: int, exc: BaseException) -> ErrorReport:
    shown = _frames.without_runners(exc.__traceback__, keep_last=True)  # from the user's frames on
    return ErrorReport(
        rank=rank,
        time=time.time(),
        type_name=_qualified_name(type(exc)),
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, shown)),
        pickled=_pickle_exception(exc),
    )


def load_errors(folder: str) -> dict[int, ErrorReport]:
    """Each rank's record; rank 0's early one (``save_early``) where it explains a ``Rank0Error``."""
    reports = {}
    early = None
    for name in os.listdir(folder):
        if name.startswith("error-") and name.endswith(".pkl"):
            report = pickle.loads(_read(os.path.join(folder, name)))
            reports[report.rank] = report
        elif name == "early-0.pkl":
            early = pickle.loads(_read(os.path.join(folder, name)))
    if early is not None and 0 not in reports:
        said = rank0_failed(early[0])
        if any(
            r.type_name.rsplit(".", 1)[-1] == "Rank0Error" and r.message.startswith(said)
            for r in reports.values()
        ):
            reports[0] = early[1]
    return reports


def _qualified_name(cls: type) -> str:
    module = cls.__module__
    return cls.__qualname__ if module in ("builtins", "__main__") else f"{module}.{cls.__qualname__}"
