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
(per-rank files). Where rank 0's progress cannot be seen (it runs on another machine), the wait
is bounded by ``SETTLE_SECONDS`` and says so.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from autoddp import _compat, _warn
from autoddp.checkpoint import atomic_write
from autoddp.hang import record
from autoddp.hang.marks import MARKS

_PREFIX = "autoddp/torch.save/"
_FINISHED = f"{_PREFIX}finished"
SETTLE_SECONDS = 10.0
#: How long rank 0 must stay blocked in a collective before it counts as having gone on.
BLOCKED_SECONDS = 0.5
_POLL_SECONDS = 0.01

RANK0_WRITES = "written once, by rank 0"
OWNED = "written by rank 0 only (rank 0 saved this path before; a save rank 0 does not make writes nothing)"
PER_RANK = "written by each rank (the paths differ)"


class Saves:
    """One process's ``torch.save`` calls in a run: naming them and the store protocol."""

    def __init__(self, rank: int, local_rank: int) -> None:
        self.rank = rank
        self.point = -1  # collectives issued at the last save, and the saves made there
        self.at_point = 0
        self.per_path: dict[str, int] = {}
        self.warned: set[str] = set()
        # rank 0's hang record, where it runs on this machine: it tells when rank 0 has gone on
        folder = os.environ.get(record.FOLDER_VARIABLE)
        self.rank0_record = record.record_path(folder, 0) if folder and rank == local_rank else None

    def save(self, original: Callable[..., Any], obj: Any, path: Any, args: tuple, kwargs: dict) -> str:
        """Save ``obj`` to ``path`` as described above; returns what happened, for the notice."""
        target = os.path.abspath(os.fspath(path))
        name = self._name(target)
        store = _compat.default_store()
        write = lambda: atomic_write(target, lambda file: original(obj, file, *args, **kwargs))  # noqa: E731
        where = f"torch.save to {os.path.basename(target)!r}"  # for the hang report
        if self.rank == 0:
            store.set(f"{_PREFIX}at/{name}", target)
            store.set(f"{_PREFIX}path/{target}/{self._path_name(target, name)}", name)
            store.set(f"{_PREFIX}owned/{target}", "1")
            with MARKS.marked(record.RUNS_RANK0, where):
                write()
            store.set(f"{_PREFIX}done/{name}", "1")
            return RANK0_WRITES
        outcome = self._follow(store, target, name, where)
        if outcome == PER_RANK:
            write()
        return outcome

    def finish(self) -> None:
        """Rank 0's user code has ended: no rank waits for a save of it any more."""
        import torch.distributed as dist

        if self.rank == 0 and dist.is_initialized():
            with contextlib.suppress(Exception):  # a group already torn down: nobody is waiting
                _compat.default_store().set(_FINISHED, "1")

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
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            if store.check([same]):
                with MARKS.marked(record.WAITS_FOR_RANK0, where):
                    store.wait([f"{_PREFIX}done/{store.get(same).decode()}"])
                return RANK0_WRITES
            is_owned = store.check([owned])
            if not is_owned and store.check([theirs]) and store.get(theirs).decode() != target:
                return PER_RANK  # rank 0 saved another path at this point: per-rank files
            if store.check([_FINISHED]) or self._rank0_blocked():
                return OWNED if is_owned else PER_RANK
            if self.rank0_record is None and time.monotonic() > deadline:
                self._say_gave_up(target, is_owned)
                return OWNED if is_owned else PER_RANK
            time.sleep(_POLL_SECONDS)

    def _rank0_blocked(self) -> bool:
        """Rank 0 has waited in a collective (one this rank is not in) long enough: it went on."""
        if self.rank0_record is None:
            return False
        seen = record.read(self.rank0_record)
        return (
            seen is not None
            and seen.rank == 0
            and seen.in_collective
            and time.monotonic() - seen.since >= BLOCKED_SECONDS
        )

    def _say_gave_up(self, target: str, owned: bool) -> None:
        if target in self.warned:
            return
        self.warned.add(target)
        then = "wrote nothing (the file is rank 0's)" if owned else "wrote its own file"
        _warn.warn(
            f"rank {self.rank} waited {SETTLE_SECONDS:.0f} s in torch.save({os.path.basename(target)!r}) "
            f"for rank 0 to save it at the same point, which rank 0 (on another machine) did not, and "
            f"{then}: the file may not yet be complete when this torch.save returns. Save from every "
            "rank at the same point, or only on rank 0 (if dist.get_rank() == 0: torch.save(...))"
        )
