"""Files that several ranks opened for writing at one path: named at the end, with the fix.

Under autoddp every process runs the script, so a log (``logging.basicConfig(filename=...)``), a
``csv.writer``, ``np.save``, ``json.dump`` or ``pickle.dump`` to one path is written by every
rank into the same file, and the contents mix. Python's audit hook sees every ``open``: while
capture is on, each rank keeps the paths (through symlinks) that the user's code opened for
writing, with the line that opened each first (an open made inside torch or autoddp is not the
user's). When the user's code has ended well, each rank publishes its paths in the process
group's store, and rank 0 waits for the others' exactly as a save does (until each has
published, gone past rank 0's last collective, or waits for rank 0) and names every file that
several ranks wrote, with the fix. ``torch.save`` paths are capture's own (written once).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from autoddp.core import _compat, _frames
from autoddp.core.state import CURRENT
from autoddp.in_rank.capture.saves import gone_past
from autoddp.in_rank.rank_zero.block import waits_ahead

_PREFIX = "autoddp/shared_files/"
_POLL_SECONDS = 0.01
_WRITING = os.O_WRONLY | os.O_RDWR


class SharedFiles:
    """One rank's paths opened for writing by the user's code in a capture session."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.thread = threading.get_ident()  # the user's code runs here
        self.paths: dict[str, str] = {}  # real path: where the user's code first opened it

    def opened(self, path: Any, mode: Any, flags: Any) -> None:
        """An ``open`` audit event of this process."""
        if not isinstance(path, (str, bytes, os.PathLike)) or threading.get_ident() != self.thread:
            return
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & _WRITING)
        if not writing:
            return
        real = os.path.realpath(os.fsdecode(path))
        if real in self.paths or real.startswith(("/dev/", "/proc/")):
            return
        site = _user_site(sys._getframe(2))
        if site is not None:
            self.paths[real] = site

    def publish(self) -> None:
        """Put this rank's paths in the store (before its saves say it has finished)."""
        if not dist.is_initialized():  # the user's code destroyed the group: nothing to compare
            return
        _compat.default_store().set(f"{_PREFIX}{self.rank}", json.dumps(self.paths))

    def gather(self, own: set[str], say: Callable[[object, str], None]) -> None:
        """On rank 0 (its saves finished, so no rank waits for it there): ``say`` each file several
        ranks wrote (``own``: paths capture's ``torch.save`` wrote once)."""
        if self.rank != 0 or not dist.is_initialized():
            return
        store = _compat.default_store()
        point = _compat.collectives_issued()
        writers: dict[str, list[int]] = {path: [0] for path in self.paths if path not in own}
        waiting = set(range(1, self.world_size))
        while waiting:
            for rank in list(waiting):
                gone = gone_past(store, rank, point) or waits_ahead(store, rank)  # first: see below
                if store.check([f"{_PREFIX}{rank}"]):  # (a rank publishes before it says finished)
                    for path in json.loads(store.get(f"{_PREFIX}{rank}")):
                        if path in writers:
                            writers[path].append(rank)
                    waiting.discard(rank)
                elif gone:
                    waiting.discard(rank)
            if waiting:
                time.sleep(_POLL_SECONDS)
        for path, ranks in writers.items():
            if len(ranks) > 1:
                say(("shared file", path), _message(path, self.paths[path], ranks, self.world_size))


def _message(path: str, site: str, ranks: list[int], world_size: int) -> str:
    who = "every rank" if len(ranks) == world_size else f"ranks {', '.join(map(str, ranks))}"
    return (
        f"{os.path.basename(path)} ({site}): {who} wrote it ({path}): under autoddp each of the {world_size} "
        "processes runs this code, so their writes to one file mix or overwrite each other. Write it "
        "from one process (if autoddp.rank() == 0: ..., or with autoddp.rank0(): ...), or give each "
        "rank its own file (f'name{autoddp.rank()}.ext'); for a log, configure the file handler only "
        "on rank 0"
    )


def _user_site(frame: Any) -> str | None:
    """``file.py:12`` of the user's line behind this open; None when torch or autoddp opened it
    (the first frame outside the standard library is theirs: ``torch.save``'s own file, not a
    library's open under a torch frame such as ``@torch.no_grad()``, torchvision's ``save_image``)."""
    opener = None
    while frame is not None:
        filename = frame.f_code.co_filename
        passes = _frames.is_standard_library(filename) or _frames.is_pass_through(filename)  # (open)
        if opener is None and not passes:
            opener = filename
            if _frames.is_autoddp(filename) or _frames.is_package(filename, "torch"):
                return None
        if _frames.is_user(filename):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def audit(event: str, args: tuple) -> None:
    """The process's audit hook (installed once, ``install_hook``): passes ``open`` events to the
    current capture session's ``SharedFiles`` while its user code runs."""
    if event != "open":
        return
    session = CURRENT.capture
    files = getattr(session, "shared_files", None)
    if files is not None and not session.busy:
        files.opened(*args)


def install_hook() -> None:
    """Add ``audit`` to this process's audit hooks once (they cannot be removed)."""
    if not CURRENT.audit_hook:
        sys.addaudithook(audit)
        CURRENT.audit_hook = True
