"""``torch.save`` from every rank to one path: written once, by rank 0, and never torn.

Saves are matched across ranks exactly, by no timing rule: each rank counts its own saves of each
file (the path resolved through symlinks), and rank 0 publishes the outcome of its k-th save of a
file in the process group's store (done, or the exception it raised) with where it happened: the
number of collectives it had issued (the same on every rank at the same point of the program).
Another rank's save of that file waits for rank 0's matching one and returns once it is complete,
or raises rank 0's exception:

- rank 0's k-th save at the same point: that is this save (saves at one point pair in order);
- at an earlier point: rank 0 saved the file alone there; the next one is looked at;
- at a later point, or none while rank 0 has issued a collective this rank has not reached (a
  thread of each rank publishes its count of collectives) or has finished: rank 0 made no such
  save here. A file rank 0 saved before stays rank 0's (a rank-dependent ``if loss < best:``
  writes nothing); any other file is this rank's own (per-rank files).

Rank 0 writes atomically (a temporary file beside the target, renamed over it; a symlink keeps
pointing at its target) and renames only once every other rank has reached the matching save
(after its ``open``, for a file object every rank opened), gone past that point, or waits for
rank 0 further on (``rank_zero.block.waits_ahead``): no rank reads a newer file before its own
save of it nor truncates the new one, and ``if rank == 0: torch.save(...)`` never deadlocks.
``Saves`` owns the ``torch.save`` hook (a path, or a file object just opened on one) and, from
the session's join on, the protocol; and the ``open`` hook (``opens``): ``open(path, "wb")`` of
a checkpoint (a file rank 0's saves write, or one ``torch.load`` read with no collective since:
resumed from, then saved) gives each rank a private file, so that no rank's ``open`` empties the
file another rank is reading.

A path that is not a regular file (``/dev/null``, a FIFO, a device, ``/dev/stdout``) is written
as one process writes it, in place (a file renamed over it would replace the device): by rank 0,
once; the other ranks skip it at once, with no wait and no count, as there is no file to read
back. A FIFO with no reader blocks rank 0 as it blocks one process, marked for the hang report;
the other ranks go on to their next collective, where the group's timeout and the report apply.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autoddp.core import _compat, _patches
from autoddp.core.errors import Rank0Error
from autoddp.core.state import CURRENT
from autoddp.in_rank import models
from autoddp.in_rank.capture.opens import PrivateFile, copy_in_place, copy_to, opening
from autoddp.in_rank.checkpoint.files import atomic_write, special
from autoddp.in_rank.hang import record
from autoddp.in_rank.hang.marks import MARKS
from autoddp.in_rank.rank_zero.block import WAITING_PREFIX, waiting_for, waits_ahead

_PREFIX = "autoddp/torch.save/"
_FINISHED = f"{_PREFIX}finished"
_POLL_SECONDS = 0.01

RANK0_WRITES = "written once, by rank 0"
OWNED = "written by rank 0 only (rank 0 saved this path before; a save rank 0 does not make writes nothing)"
PER_RANK = "written by each rank (the paths differ)"
IN_PLACE = "written once, by rank 0, in place (not a regular file: it stays what it is)"


class Progress:
    """A thread that publishes this rank's count of collectives issued whenever it changes: the
    exact sign that a rank has gone past a point of the program (it may be blocked there)."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.key = store, f"{_PREFIX}point/{rank}"
        store.set(self.key, str(_compat.collectives_issued()))  # this rank's keys exist from the join on
        store.set(f"{WAITING_PREFIX}{rank}", "-")
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="autoddp-save-progress", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        published = -1
        while not self.stopping.wait(_POLL_SECONDS):
            if not dist.is_initialized():  # the user's code destroyed the group: none follows
                return
            try:
                issued = _compat.collectives_issued()
                if issued != published:
                    self.store.set(self.key, str(issued))
                    published = issued
            except Exception:  # the user's code destroyed the group: no collective follows
                return

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


class Saves:
    """One process's ``torch.save`` calls in a capture session: the hook, counting them per file and
    the store protocol."""

    def __init__(self, session: Any) -> None:
        """``session``: the capture ``Session`` (its notice and world: ``join`` once it is joined)."""
        self.session = session
        self.rank, self.world_size = 0, 0
        self.counts: dict[str, int] = {}  # per file: rank 0's saves made, another's next to match
        # the checkpoints: files rank 0's saves write, or torch.load read (open(p, "wb"): a private file)
        self.checkpoints: set[str] = set()
        self.loaded: set[str] = set()  # absolute paths torch.load read since this rank's last collective
        self.loaded_at = -1  # (that collective's count: a load before it is done on every rank)
        self.progress: Progress | None = None
        self._patches = _patches.Patches()

    def install(self) -> None:
        patches = [
            _patches.wrapping(owner, name, make)
            for owner in (torch, torch.serialization)
            for name, make in (("save", self._save), ("load", self._load))
        ]
        if builtins.open is io.open:  # one function under both names, as before
            wrapped = _patches.wrapping(builtins, "open", self._opening)[2]
            patches += [(builtins, "open", wrapped), (io, "open", wrapped)]
        else:
            patches += [_patches.wrapping(owner, "open", self._opening) for owner in (builtins, io)]
        self._patches.install(patches)

    def uninstall(self) -> None:
        self._patches.restore()

    def _opening(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return opening(original, self.session, self.kept, self._written, self.any_kept)

    def _written(self, private: PrivateFile) -> None:
        """A plain write (no ``torch.save``) into a checkpoint's private file, at its ``close``: saved
        to the path as a save is, once by rank 0 and paired across ranks, so that no rank's write
        replaces the file while another has still to read it. Before the join, after this rank's
        code ended, or inside autoddp's own work: in place, as one process writes it."""
        if not self.joined or self.progress.stopping.is_set() or self.session.busy:
            copy_in_place(private)
            return
        with self.session.own_work():
            self.save(lambda _obj, file: copy_to(private, file), None, private.path, (), {})

    def any_kept(self) -> bool:
        """Whether any path may be a checkpoint yet (else ``open`` resolves no path: ~20 µs saved)."""
        return bool(self.checkpoints or self.loaded)

    def kept(self, absolute: str, real: str) -> bool:
        """Whether ``open(path, "wb")`` of this path gives a private file: a file rank 0's saves write,
        or one ``torch.load`` read with no collective since (a checkpoint resumed from: another rank
        may still be reading it; past a collective, every rank's load before it is done)."""
        return real in self.checkpoints or (absolute in self.loaded and _point() == self.loaded_at)

    def _load(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def load(f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, (str, os.PathLike)) and not self.session.busy:
                point = _point()
                if point != self.loaded_at:  # (only the loads since the last collective are kept)
                    self.loaded, self.loaded_at = set(), point
                self.loaded.add(os.path.abspath(os.fspath(f)))
            return original(f, *args, **kwargs)

        return load

    @property
    def joined(self) -> bool:
        """Whether the session has joined its world (the protocol runs from then on)."""
        return self.progress is not None

    def join(self, rank: int, world_size: int) -> None:
        """The session joined the world as ``rank`` of ``world_size``: other ranks may wait from now."""
        self.rank, self.world_size = rank, world_size
        self.progress = Progress(_compat.default_store(), rank)

    def _save(self, original: Callable[..., Any]) -> Callable[..., Any]:
        session = self.session

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            path = f if isinstance(f, (str, os.PathLike)) else opened_path(f)  # open(path, "wb") too
            if session.busy or path is None:
                return original(obj, f, *args, **kwargs)
            with session.own_work():
                session.world()
                obj = models.full_tensors(obj)  # sharded (FSDP) state: gathered whole
                what = self.save(original, obj, path, args, kwargs, opened=None if path is f else f)
            if isinstance(f, PrivateFile) and what in (RANK0_WRITES, OWNED):
                f.saved = True  # the path is written: nothing of this rank's file goes there
            path = os.fspath(path)
            session.notice.say(("save", os.path.abspath(path)), f"torch.save({path!r}): {what}")
            return None

        return save

    def save(
        self,
        original: Callable[..., Any],
        obj: Any,
        path: Any,
        args: tuple,
        kwargs: dict,
        opened: Any = None,
    ) -> str:
        """Save ``obj`` to ``path`` (a file object ``opened`` on it: see above); returns what
        happened, for the notice."""
        if opened is None and special(path):  # a device, a FIFO: in place, once (see above)
            if self.rank == 0:
                with MARKS.marked(record.RUNS_RANK0, f"torch.save to {os.fspath(path)!r}"):
                    original(obj, path, *args, **kwargs)
            return IN_PLACE
        target = os.path.realpath(os.fspath(path))  # a symlink: its target is written
        store = _compat.default_store()
        point = _compat.collectives_issued()
        where = f"torch.save to {os.path.basename(target)!r}"  # for the hang report
        if self.rank == 0:
            count = self.counts.get(target, 0)
            self.counts[target] = count + 1
            self.checkpoints.add(target)
            key = f"{_PREFIX}save/{target}/{count}"
            try:
                with MARKS.marked(record.RUNS_RANK0, where):
                    wait = lambda: self._wait_for_others(store, target, count, point, where)  # noqa: E731
                    atomic_write(target, lambda file: original(obj, file, *args, **kwargs), wait)
            except Exception as error:
                store.set(key, _outcome(point, error))
                raise
            store.set(key, _outcome(point, None))
            return RANK0_WRITES
        outcome = self._follow(store, target, point, where)
        if outcome == PER_RANK and opened is not None:
            original(obj, opened, *args, **kwargs)  # its own file, opened by this rank alone
        elif outcome == PER_RANK or (opened is not None and _emptied(opened, target)):
            # (this rank's open(path, "wb") came after rank 0's file was in place, and emptied it)
            atomic_write(target, lambda file: original(obj, file, *args, **kwargs))
        return outcome

    def finish(self) -> None:
        """This rank's user code has ended: no rank waits for a save of it any more. Said through
        the store kept since the join: a rank waiting for this one learns it even where the user's
        code destroyed the group."""
        assert self.progress is not None
        self.progress.stop()
        try:
            self.progress.store.set(f"{_FINISHED}/{self.rank}", "1")
        except Exception:  # the store is gone with the run: nobody is waiting
            return

    # --- another rank -------------------------------------------------------------------------

    def _follow(self, store: Any, target: str, point: int, where: str) -> str:
        """Find rank 0's save of ``target`` that matches this one (see the module's docstring)."""
        count = self.counts.get(target, 0)
        timeout = (CURRENT.timeout or store.timeout).total_seconds()
        deadline = time.monotonic() + timeout
        with MARKS.marked(record.WAITS_FOR_RANK0, where):
            while True:
                key = f"{_PREFIX}save/{target}/{count}"
                store.set(f"{key}/reached/{self.rank}", "1")  # rank 0 may replace the file now
                with waiting_for(store, self.rank, key):
                    found = store.check([key])
                if found:
                    theirs, error = _read_outcome(store.get(key), where)
                    if theirs < point:  # rank 0 saved it alone before this point
                        count += 1
                        continue
                    if theirs == point:
                        self.counts[target] = count + 1
                        self.checkpoints.add(target)
                        if error is not None:
                            raise error
                        return RANK0_WRITES
                    break  # rank 0's next save of it comes at a later point: none here
                if gone_past(store, 0, point):
                    if store.check([key]):  # published before it went on
                        continue
                    break
                if time.monotonic() > deadline:
                    raise Rank0Error(
                        f"rank {self.rank} waited {timeout:.0f} s (the process group's timeout) in {where} "
                        "for rank 0 to save it at the same point or go on; save from every rank at the same "
                        "point, or only on rank 0 (if dist.get_rank() == 0: torch.save(...))",
                        type_name="TimeoutError",
                    )
                time.sleep(_POLL_SECONDS)
        self.counts[target] = count
        if store.check([f"{_PREFIX}save/{target}/0"]):
            self.checkpoints.add(target)
            return OWNED
        return PER_RANK

    def _wait_for_others(self, store: Any, target: str, count: int, point: int, where: str) -> None:
        """Rank 0, its file complete: wait until every other rank has reached the matching save
        (after its ``open``, for a file object), or gone past this point, or waits for rank 0
        further on, so that no rank reads the new file before its own save of it nor truncates it."""
        waiting = set(range(1, self.world_size))
        timeout = (CURRENT.timeout or store.timeout).total_seconds()
        deadline = time.monotonic() + timeout
        while waiting:
            for rank in list(waiting):
                reached = store.check([f"{_PREFIX}save/{target}/{count}/reached/{rank}"])
                if reached or gone_past(store, rank, point) or waits_ahead(store, rank):
                    waiting.discard(rank)
            if waiting and time.monotonic() > deadline:
                raise Rank0Error(
                    f"rank 0 waited {timeout:.0f} s (the process group's timeout) in {where} for rank(s) "
                    f"{sorted(waiting)} to reach the same save or go on; save from every rank at the same "
                    "point, or only on rank 0 (if dist.get_rank() == 0: torch.save(...))",
                    type_name="TimeoutError",
                )
            if waiting:
                time.sleep(_POLL_SECONDS)


def _point() -> int:
    """This rank's count of collectives issued (-1 before the group exists: none yet)."""
    return _compat.collectives_issued() if dist.is_initialized() else -1


def gone_past(store: Any, rank: int, point: int) -> bool:
    """True once ``rank`` has issued more than ``point`` collectives, or its code has ended."""
    if store.check([f"{_FINISHED}/{rank}"]):
        return True
    key = f"{_PREFIX}point/{rank}"
    return store.check([key]) and int(store.get(key)) > point


def _outcome(point: int, error: BaseException | None) -> bytes:
    """Rank 0's save as published: its point, then nothing (done) or the exception it raised."""
    head = f"{point}\n".encode()
    if error is None:
        return head
    try:
        return head + pickle.dumps(error)
    except Exception:
        return head + pickle.dumps(_described(error))


def _read_outcome(value: bytes, where: str) -> tuple[int, BaseException | None]:
    """``_outcome`` read back: rank 0's point and its exception (itself, where it unpickles)."""
    head, _, body = value.partition(b"\n")
    if not body:
        return int(head), None
    try:
        error = pickle.loads(body)
    except Exception as unreadable:
        error = Rank0Error(f"{where} failed on rank 0 with an exception this rank cannot read: {unreadable}")
    return int(head), error


def _described(error: BaseException) -> Rank0Error:
    kind = type(error).__qualname__
    return Rank0Error(f"torch.save failed on rank 0 with {kind}: {error}", type_name=kind, detail=str(error))


def opened_path(file: Any) -> str | None:
    """The path of a file object just opened for writing on a regular file (``open(path, "wb")``),
    else None: a stream, a buffer or a file already written to is saved as it is."""
    name, mode = getattr(file, "name", None), getattr(file, "mode", "")
    if not isinstance(name, str) or not isinstance(mode, str) or mode not in ("wb", "xb"):
        return None
    try:
        regular = stat.S_ISREG(os.fstat(file.fileno()).st_mode)
        return name if regular and file.tell() == 0 else None
    except (OSError, ValueError, AttributeError):
        return None


def _emptied(opened: Any, target: str) -> bool:
    """True when ``opened`` is the file now at ``target`` (so its ``open`` truncated that file)."""
    try:
        mine, now = os.fstat(opened.fileno()), os.stat(target)
    except (OSError, ValueError):
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)
