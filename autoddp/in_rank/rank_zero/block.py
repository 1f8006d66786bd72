"""``rank0()``: run a block on global rank 0 only; every rank waits for it and learns its outcome.

Use it as ``with autoddp.rank0(): ...`` or as a decorator, ``@autoddp.rank0``. Other ranks skip
the body (see ``autoddp.in_rank.rank_zero.skip`` for how) and wait until rank 0 has finished it; if the body
raised, rank 0 re-raises its exception and every other rank raises ``Rank0Error`` naming it, so
no rank is left waiting in a later collective. The plain alternative, when the other ranks need
not wait, is ``if autoddp.is_main(): ...``.

Rank 0 publishes the outcome in the process group's key-value store (one ``set`` per block);
the other ranks wait on that key with the process group's timeout and delete it after reading.
A collective in the body would pair with nothing (only rank 0 runs it) and hang, so while the
body runs on rank 0 the collectives of ``torch.distributed`` and ``autoddp.barrier`` raise
``CollectiveInRank0Error`` instead.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any, TypeVar, overload

import torch.distributed as dist

from autoddp.core import _compat, _patches, _variables
from autoddp.core.errors import ConfigurationError, Rank0Error
from autoddp.core.state import CURRENT
from autoddp.in_rank.hang import record
from autoddp.in_rank.hang.marks import MARKS
from autoddp.in_rank.rank_zero import refusals, skip
from autoddp.in_rank.run_folder import transport
from autoddp.in_rank.world import current

F = TypeVar("F", bound=Callable[..., Any])

_KEY_PREFIX = "autoddp/rank0/"
#: Per rank: the store key it waits on for rank 0 now ("-": none). Rank 0 reads it to tell that a
#: rank is waiting for it at a point rank 0 has not reached (capture's ``torch.save`` does).
WAITING_PREFIX = "autoddp/waiting/"
_MAX_SITES = 4096
_OK = b"ok\n"  # then the block's name: readers check that they are at the same block

# How a block runs on this process.
_INLINE = "inline"  # a world of 1, or nested in a body already running on rank 0: just run it
_RUN = "run"  # rank 0: run the body with collectives refused, then publish the outcome
_SKIP = "skip"  # other ranks: skip the body, wait for rank 0's outcome


class _State:
    """Per-process bookkeeping of rank0 blocks: the only module state.

    ``sequence`` numbers the blocks that synchronise (every rank runs the same blocks in the
    same order, so the numbers agree across ranks and name the store keys); ``series`` numbers
    the blocks of each named series apart from it (``save`` to one path); ``sites`` caches the
    source check per ``with`` site. The bodies running on this rank 0 are counted in
    ``CURRENT.alone`` (a model's call there is not split between the ranks: ``models._at_call``).
    """

    def __init__(self) -> None:
        self.sequence = itertools.count()
        self.series: dict[str, int] = {}
        self.sites: dict[tuple[int, int], tuple[Any, str, str | None]] = {}


_STATE = _State()


class Rank0Block:
    """The object ``rank0()`` returns: a context manager, and a decorator when called on a function.

    Skipped ranks never enter the context managers listed after it in the same ``with``
    statement (``with rank0(), other():``); list those first or nest them inside the body.
    """

    __slots__ = ("_key", "_marked", "_mode", "_saved", "_skipper", "_store", "_where")

    def __init__(self) -> None:
        self._mode = _INLINE
        self._key = ""
        self._where = "the rank0() block"
        self._store: Any = None
        self._saved: _patches.Patches | None = None
        self._skipper = skip.BodySkipper()
        self._marked = False

    def __call__(self, fn: F) -> F:
        return decorate(fn)

    def __enter__(self) -> None:
        frame = sys._getframe(1)
        self._where = _check_site(frame)
        self._begin()
        if self._mode is _SKIP:
            self._skipper.start(frame)  # last: from here on this frame's next opcode skips

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._mode is not _SKIP:
            self._finish(exc)
            return False
        # A skipping rank: do everything that calls Python, then restore the tracers last.
        error = self._outcome_error() if exc_type is None or skip.is_skip(exc_type) else None
        skipped = self._skipper.stop(exc_type)  # the last call: it puts the tracers back
        if error is not None:
            raise error
        return skipped

    def _begin(self, series: str | None = None) -> None:
        """Decide how this process runs the block; on rank 0 start refusing collectives.

        Blocks are numbered in one sequence that every rank must pass alike; a ``series`` (one
        checkpoint path, say) is numbered on its own, so rank 0 may also run it alone.
        """
        world = current()
        if world.world_size == 1 or CURRENT.alone:
            self._mode = _INLINE
            return
        self._store = _store(world.world_size)
        if series is None:
            self._key = f"{_KEY_PREFIX}{next(_STATE.sequence)}"
        else:
            number = _STATE.series[series] = _STATE.series.get(series, -1) + 1
            self._key = f"{_KEY_PREFIX}{series}/{number}"
        if world.rank != 0:
            self._mode = _SKIP
            return
        self._mode = _RUN
        CURRENT.alone += 1
        self._saved = refusals.refuse(self._where)
        self._marked = MARKS.mark(record.RUNS_RANK0, self._where)  # the hang report: rank 0 is busy here

    def _finish(self, exc: BaseException | None) -> None:
        """On rank 0: give the collectives back and publish whether the body raised."""
        if self._mode is not _RUN:
            return
        if self._saved is not None:
            refusals.restore(self._saved)
            self._saved = None
        CURRENT.alone -= 1
        if self._marked:
            MARKS.unmark()
            self._marked = False
        if exc is None:
            value = _OK + self._where.encode()
        else:
            value = json.dumps({**_describe(exc), "where": self._where}).encode()
            _record_early(exc, self._where)
        if self._store is not None:
            self._store.set(self._key, value)
        else:
            dist.broadcast_object_list([value], src=0)

    def _outcome_error(self) -> Rank0Error | None:
        """On other ranks: wait for rank 0's outcome; the error to raise, if any (never raises)."""
        rank = current().rank
        try:
            value = _wait(self._store, self._key, current().world_size, self._where)
        except Exception as wait_error:
            timeout = _timeout(self._store)
            error = Rank0Error(
                f"rank {rank} gave up waiting for rank 0 to finish {self._where} "
                f"({type(wait_error).__name__}: {wait_error}; the process group's timeout is {timeout}). "
                "If rank 0 needs longer in that block, raise the timeout (@autoddp.distributed(timeout=...) "
                "or init_process_group(timeout=...)); if rank 0 died, its own error says why",
                type_name="TimeoutError",
                detail=str(wait_error),
            )
            error.__cause__ = wait_error
            error.__suppress_context__ = True
            return error
        if value.startswith(_OK):
            theirs, described = value[len(_OK) :].decode(), None
        else:
            described = json.loads(value)
            theirs = described["where"]
        if theirs != self._where:
            error = Rank0Error(
                f"the ranks are out of step: rank {rank} is at {self._where}, but the same block "
                f"(number {self._key.rsplit('/', 1)[1]}) on rank 0 was {theirs}. Every rank must pass the "
                "same rank0() blocks in the same order: make the conditions around them the same on "
                "every rank, or use `if autoddp.is_main():` for work the others need not wait for",
                detail=theirs,
            )
        elif described is not None:
            error = Rank0Error(
                f"{transport.rank0_failed(self._where)}{described['type']}: "
                f"{described['message']} (rank 0 raises that error with its traceback; rank {rank} "
                "raises this one so that no rank waits for the others forever)",
                type_name=described["type"],
                detail=described["message"],
            )
        else:
            return None
        error.__suppress_context__ = True  # not "during handling of _Skip"
        return error


@overload
def rank0() -> Rank0Block: ...
@overload
def rank0(fn: F, /) -> F: ...
def rank0(fn: Callable[..., Any] | None = None, /) -> Any:
    """Run a block (``with autoddp.rank0():``) or a function (``@autoddp.rank0``) on rank 0 only.

    Every other rank skips it and waits until rank 0 has finished, then raises ``Rank0Error`` if
    rank 0's body raised (rank 0 re-raises its own error); a decorated function returns its
    result on rank 0 and None elsewhere. Outside a distributed run it simply runs. The body may
    not ``return``, ``break``, ``continue``, ``yield`` or ``await`` out of the block, nor bind
    ``as``; nor call collectives. Use ``if autoddp.is_main():`` when the others need not wait.
    """
    if fn is None:
        return Rank0Block()
    return decorate(fn)


def decorate(fn: F, *, where: str | None = None) -> F:
    """``@rank0`` itself; ``where`` names the function in messages (default: its qualified name)."""
    if not callable(fn):
        raise ConfigurationError(
            f"rank0 decorates a function, not {type(fn).__name__}; use `with autoddp.rank0():` for a block"
        )
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn) or inspect.iscoroutinefunction(fn):
        raise ConfigurationError(
            f"@rank0 cannot decorate {getattr(fn, '__qualname__', fn)!r}: a generator or async function "
            "would run its body later, outside the block; decorate a plain function that does the work"
        )
    if where is None:
        where = f"the @rank0 function {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}()"

    @functools.wraps(fn)
    def on_rank0(*args: Any, **kwargs: Any) -> Any:
        return run_on_rank0(fn, args, kwargs, where=where)

    return on_rank0  # type: ignore[return-value]


def run_on_rank0(
    fn: Callable[..., Any], args: tuple, kwargs: dict, *, where: str, series: str | None = None
) -> Any:
    """``fn(*args, **kwargs)`` on rank 0 only; the others wait for it (None there), as ``@rank0``.

    With ``series`` the call is numbered in that series only (see ``Rank0Block._begin``).
    """
    block = Rank0Block()
    block._where = where
    block._begin(series)
    if block._mode is _SKIP:
        error = block._outcome_error()
        if error is not None:
            raise error
        return None
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        block._finish(exc)
        raise
    block._finish(None)
    return result


def _check_site(frame: FrameType) -> str:
    """The ``with`` site's name for messages; ConfigurationError if its body cannot be skipped."""
    key = (id(frame.f_code), frame.f_lasti)
    site = _STATE.sites.get(key)
    if site is None:
        if len(_STATE.sites) >= _MAX_SITES:
            _STATE.sites.clear()
        where = f"the rank0() block at {frame.f_code.co_filename}:{frame.f_lineno}"
        if not skip.entered_by_with(frame):
            problem = (
                f"{where} must be entered by a `with` statement (or used as @rank0 on a "
                "function): the other ranks skip the body of that statement, which an ExitStack or a "
                "direct __enter__() call does not have"
            )
        else:
            problem = skip.body_problem(frame, "autoddp.rank0()")
        site = (frame.f_code, where, problem)  # the code object is kept so that its id stays unique
        _STATE.sites[key] = site
    if site[2] is not None:
        raise ConfigurationError(site[2])
    return site[1]


def _store(world_size: int) -> Any:
    """The default process group's store, or None when it has none (then a broadcast is used)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigurationError(
            f"rank0() in a world of {world_size} processes needs the default process group: call it "
            "inside an @autoddp.distributed function, or after torch.distributed.init_process_group()"
        )
    try:
        store = _compat.default_store()
    except (RuntimeError, ValueError):  # a group made without a store
        return None
    return None if type(store) is dist.Store else store  # MPI's placeholder store holds no keys


def _wait(store: Any, key: str, world_size: int, where: str) -> bytes:
    """Rank 0's published outcome for ``key``; the last reader deletes the key.

    While it waits, the hang report knows that this rank waits for rank 0 to finish ``where``.
    """
    with MARKS.marked(record.WAITS_FOR_RANK0, where):
        if store is None:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        with waiting_for(store, current().rank, key):
            store.wait([key], _timeout(store))
            value = store.get(key)
    readers = world_size - 1
    if readers == 1 or store.add(f"{key}/read", 1) == readers:
        store.delete_key(key)
        if readers > 1:
            store.delete_key(f"{key}/read")
    return value


@contextlib.contextmanager
def waiting_for(store: Any, rank: int, key: str) -> Iterator[None]:
    """Say in the store that ``rank`` waits for rank 0 to publish ``key`` (``WAITING_PREFIX``):
    under capture only, whose ``torch.save`` reads it (and made the flag when it joined)."""
    if CURRENT.capture is None:
        yield
        return
    store.set(f"{WAITING_PREFIX}{rank}", key)
    try:
        yield
    finally:
        store.set(f"{WAITING_PREFIX}{rank}", "-")


def waits_ahead(store: Any, rank: int) -> bool:
    """True when ``rank`` waits for rank 0 to publish a key it has not published yet: a point of
    the program rank 0 has not reached (a rank waiting there has gone past rank 0's point)."""
    flag = f"{WAITING_PREFIX}{rank}"
    if not store.check([flag]):
        return False
    key = store.get(flag).decode()
    # the flag is cleared before a key is deleted: still the same flag, the key is not yet there
    return key != "-" and not store.check([key]) and store.get(flag).decode() == key


def _timeout(store: Any) -> datetime.timedelta:
    """How long to wait for rank 0: the process group's timeout as autoddp set it, else the store's.

    A group made by ``init_process_group`` creates its store with the group's own timeout.
    """
    if CURRENT.timeout is not None:
        return CURRENT.timeout
    return store.timeout if store is not None else datetime.timedelta(minutes=30)


def _describe(exc: BaseException) -> dict[str, str]:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    try:
        message = str(exc)
    except Exception:
        message = "<the exception's message could not be turned into text>"
    return {"type": name, "message": message}


def _record_early(exc: BaseException, where: str) -> None:
    """Under an autoddp launcher, rank 0's record of ``exc`` before the other ranks learn of it: one
    that fails in consequence may end first, and the launcher then stops rank 0 before its own
    record (``transport.save_early``: read only to explain their ``Rank0Error``)."""
    folder = os.environ.get(_variables.RUN_FOLDER)
    if folder:
        with contextlib.suppress(Exception):
            transport.save_early(folder, exc, where)
