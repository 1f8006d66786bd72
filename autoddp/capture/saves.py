"""``torch.save`` from every rank to one path: written once, by rank 0, and never torn.

Rank 0 announces each save in the process group's store (its sequence number and path), writes
the file atomically (a temporary file in the same folder, renamed over the path), then marks it
done; it never waits for anyone, so ``if rank == 0: torch.save(...)`` works as written. Another
rank saving a path looks for rank 0's announcement: the same path (rank 0 writes it: wait until it
is done, write nothing) or, at the same sequence number, another path (per-rank files: write its
own). A path rank 0 has saved before is rank 0's: a save of it that rank 0 does not make now (a
rank-dependent ``if loss < best:``) writes nothing and does not wait. When none of these comes
within ``SETTLE_SECONDS`` (a path only this rank saves) it writes its own file, atomically too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from autoddp import _compat
from autoddp.checkpoint import atomic_write
from autoddp.hang import record
from autoddp.hang.marks import MARKS

_PREFIX = "autoddp/torch.save/"
SETTLE_SECONDS = 10.0
_POLL_SECONDS = 0.01


class Saves:
    """One process's ``torch.save`` calls in a run: numbering and the store protocol."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sequence = 0
        self.per_path: dict[str, int] = {}

    def save(self, original: Callable[..., Any], obj: Any, path: Any, args: tuple, kwargs: dict) -> str:
        """Save ``obj`` to ``path`` as described above; returns what happened, for the notice."""
        target = os.path.abspath(os.fspath(path))
        number, self.sequence = self.sequence, self.sequence + 1
        count = self.per_path.get(target, 0)
        self.per_path[target] = count + 1
        store = _compat.default_store()
        where = f"torch.save to {os.path.basename(target)!r}"  # for the hang report
        if self.rank == 0:
            store.set(f"{_PREFIX}seq/{number}", target)
            store.set(f"{_PREFIX}path/{target}/{count}", str(number))
            with MARKS.marked(record.RUNS_RANK0, where):
                atomic_write(target, lambda file: original(obj, file, *args, **kwargs))
            store.set(f"{_PREFIX}done/{number}", "1")
            return "written once, by rank 0"
        same, theirs = f"{_PREFIX}path/{target}/{count}", f"{_PREFIX}seq/{number}"
        owned = f"{_PREFIX}path/{target}/0"
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline:
            if store.check([same]):
                with MARKS.marked(record.WAITS_FOR_RANK0, where):
                    store.wait([f"{_PREFIX}done/{store.get(same).decode()}"])
                return "written once, by rank 0"
            if store.check([owned]):
                return "written by rank 0 only (rank 0 saved this path before)"
            if store.check([theirs]) and store.get(theirs).decode() != target:
                break  # rank 0 saved another path at this point: per-rank files
            time.sleep(_POLL_SECONDS)
        atomic_write(target, lambda file: original(obj, file, *args, **kwargs))
        return "written by each rank (the paths differ)"
