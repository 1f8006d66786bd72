"""``torch.save`` from every rank to one path: written once, by rank 0, and never torn.

Every save is named by where it happens in the program: the number of collectives this rank has
issued on the group (the same on every rank at the same point) and its order among the saves
there. Rank 0 announces each of its saves in the process group's store under that name, writes
the file atomically (a temporary file in the same folder, renamed over the path), then marks it
done; it never waits for anyone, so ``if rank == 0: torch.save(...)`` works as written. Another
rank saving a path waits for rank 0's save of that path at the same point, then returns once it
is done: the file is complete on every rank when ``torch.save`` returns, first saves and
repeated ones alike. When rank 0 has gone on without it (it made another save there, is blocked
in a collective this rank is not in, or has finished), a path rank 0 saved before stays rank 0's
(a rank-dependent ``if loss < best:`` writes nothing) and any other path is this rank's own
(per-rank files). Where rank 0's progress cannot be seen (it runs on another machine, or waits in
a collective torch makes in C++), the wait is bounded by ``SETTLE_SECONDS`` and says so.

A file object every rank opened on the same path (``with open(path, "wb") as f: torch.save(sd,
f)``) is the same save of that path: rank 0 renames its complete file over the path only once the
others have reached the save (or gone on, or ``OPEN_SECONDS`` passed), so that no rank's ``open``
truncates it afterwards; a rank whose ``open`` came later and emptied it puts its own complete
copy in place, atomically.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable
from typing import Any

from autoddp import _compat, _warn
from autoddp.checkpoint.files import atomic_write
from autoddp.hang import record
from autoddp.hang.marks import MARKS

_PREFIX = "autoddp/torch.save/"
_FINISHED = f"{_PREFIX}finished"
SETTLE_SECONDS = 10.0
#: How long rank 0 waits for the others to open the path of a file-object save.
OPEN_SECONDS = 2.0
#: How long rank 0 must stay blocked in a collective before it counts as having gone on.
BLOCKED_SECONDS = 0.5
_POLL_SECONDS = 0.01

RANK0_WRITES = "written once, by rank 0"
OWNED = "written by rank 0 only (rank 0 saved this path before; a save rank 0 does not make writes nothing)"
PER_RANK = "written by each rank (the paths differ)"


class Saves:
    """One process's ``torch.save`` calls in a run: naming them and the store protocol."""

    def __init__(self, rank: int, local_rank: int, world_size: int, local_world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.point = -1  # collectives issued at the last save, and the saves made there
        self.at_point = 0
        self.per_path: dict[str, int] = {}
        self.warned: set[str] = set()
        # the hang records, on rank 0's machine: they tell when a rank has gone on without a save
        folder = os.environ.get(record.FOLDER_VARIABLE)
        self.records = folder if folder and rank == local_rank else None
        self.local_world_size = local_world_size

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
        target = os.path.abspath(os.fspath(path))
        name = self._name(target)
        store = _compat.default_store()
        where = f"torch.save to {os.path.basename(target)!r}"  # for the hang report
        if self.rank == 0:
            wait = (lambda: self._wait_for_opens(store, name, target)) if opened is not None else None
            store.set(f"{_PREFIX}at/{name}", target)
            store.set(f"{_PREFIX}path/{target}/{self._path_name(target, name)}", name)
            store.set(f"{_PREFIX}owned/{target}", "1")
            with MARKS.marked(record.RUNS_RANK0, where):
                atomic_write(target, lambda file: original(obj, file, *args, **kwargs), wait)
            store.set(f"{_PREFIX}done/{name}", "1")
            return RANK0_WRITES
        if opened is not None:
            store.set(f"{_PREFIX}opened/{name}/{self.rank}", "1")
            store.set(f"{_PREFIX}opener/{target}/{self.rank}", "1")
        outcome = self._follow(store, target, name, where)
        if outcome == PER_RANK and opened is not None:
            original(obj, opened, *args, **kwargs)  # its own file, opened by this rank alone
        elif outcome == PER_RANK or (opened is not None and _emptied(opened, target)):
            # (this rank's open(path, "wb") came after rank 0's file was in place, and emptied it)
            atomic_write(target, lambda file: original(obj, file, *args, **kwargs))
        return outcome

    def finish(self) -> None:
        """This rank's user code has ended: no rank waits for a save of it any more."""
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a group already torn down: nobody is waiting
                _compat.default_store().set(f"{_FINISHED}/{self.rank}", "1")

    # --- naming -------------------------------------------------------------------------------

    def _name(self, target: str) -> str:
        point = _compat.collectives_issued()
        if point != self.point:
            self.point, self.at_point, self.per_path = point, 0, {}
        name, self.at_point = f"{point}/{self.at_point}", self.at_point + 1
        return name

    def _path_name(self, target: str, name: str) -> str:
        """This save's order among the saves of ``target`` at this point (counted on every rank)."""
        count = self.per_path.get(target, 0)
        self.per_path[target] = count + 1
        return f"{name.split('/')[0]}/{count}"

    # --- another rank -------------------------------------------------------------------------

    def _follow(self, store: Any, target: str, name: str, where: str) -> str:
        """Wait for rank 0's save of ``target`` here, or for rank 0 to go on without it."""
        same = f"{_PREFIX}path/{target}/{self._path_name(target, name)}"
        theirs, owned = f"{_PREFIX}at/{name}", f"{_PREFIX}owned/{target}"
        deadline, seen = time.monotonic() + SETTLE_SECONDS, {}
        while True:
            if store.check([same]):
                with MARKS.marked(record.WAITS_FOR_RANK0, where):
                    store.wait([f"{_PREFIX}done/{store.get(same).decode()}"])
                return RANK0_WRITES
            is_owned = store.check([owned])
            if not is_owned and store.check([theirs]) and store.get(theirs).decode() != target:
                return PER_RANK  # rank 0 saved another path at this point: per-rank files
            if store.check([f"{_FINISHED}/0"]) or self._went_on(0, seen):
                return OWNED if is_owned else PER_RANK
            if time.monotonic() > deadline:  # (a collective torch makes in C++ shows in no record)
                self._say_gave_up(target, is_owned)
                return OWNED if is_owned else PER_RANK
            time.sleep(_POLL_SECONDS)

    def _went_on(self, rank: int, seen: dict[int, tuple[int, float]]) -> bool:
        """``rank`` has stayed in the same collective (one this rank is not in) for ``BLOCKED_SECONDS``
        of this wait: it went on. Timed from this wait's first sight of it, not from the record's
        entry time: a rank still leaving the collective this one just left shows an old one."""
        if self.records is None or rank >= self.local_world_size:
            return False  # not on this machine: its progress cannot be seen
        now = record.read(record.record_path(self.records, rank))
        if now is None or now.rank != rank or not now.in_collective:
            seen.pop(rank, None)
            return False
        sequence, since = seen.setdefault(rank, (now.sequence, time.monotonic()))
        if sequence != now.sequence:
            seen[rank] = (now.sequence, time.monotonic())
            return False
        return time.monotonic() - since >= BLOCKED_SECONDS

    def _wait_for_opens(self, store: Any, name: str, target: str) -> None:
        """Rank 0, its file complete: wait until every other rank has opened the path for this
        save (or gone on without it), so that none truncates the file once it is in place. Only
        for ranks whose progress shows, or that opened this path before: an ``if rank == 0:``
        save is not held up where nothing can tell that the others went on."""
        visible = self.records is not None
        waiting = {
            rank
            for rank in range(1, self.world_size)
            if (visible and rank < self.local_world_size) or store.check([f"{_PREFIX}opener/{target}/{rank}"])
        }
        deadline, seen = time.monotonic() + OPEN_SECONDS, {}
        while waiting:
            for rank in list(waiting):
                opened, finished = f"{_PREFIX}opened/{name}/{rank}", f"{_FINISHED}/{rank}"
                if store.check([opened]) or store.check([finished]) or self._went_on(rank, seen):
                    waiting.discard(rank)
            if waiting and time.monotonic() > deadline:
                return  # a rank that opens it later puts its own complete copy in place (``save``)
            time.sleep(_POLL_SECONDS)

    def _say_gave_up(self, target: str, owned: bool) -> None:
        if target in self.warned:
            return
        self.warned.add(target)
        then = "wrote nothing (the file is rank 0's)" if owned else "wrote its own file"
        _warn.warn(
            f"rank {self.rank} waited {SETTLE_SECONDS:.0f} s in torch.save({os.path.basename(target)!r}) "
            f"for rank 0 to save it at the same point, which rank 0 did not in that time, and {then}: "
            "the file may not yet be complete when this torch.save returns. Save from every rank at "
            "the same point, or only on rank 0 (if dist.get_rank() == 0: torch.save(...))"
        )


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
