"""``open(path, "wb")`` of a file that capture's ``torch.save`` writes once: a private file, no truncation.

``with open("last.pt", "wb") as f: torch.save(obj, f)`` then ``torch.load("last.pt")`` on every
rank: each rank's own ``open`` truncates the one file at once, the file that another rank is
still reading back from the last save (or that rank 0 has just put in place for it). Capture's
``torch.save`` writes such a file once, by rank 0, atomically and matched across ranks
(``saves``). So once a path is one of those files (rank 0's, saved in this session, or one that
``torch.load`` read with no collective since: a checkpoint resumed from, then saved), a plain
``open(path, "wb")`` there returns a ``PrivateFile``: a file object on a nameless file of its
own beside the path, whose ``name`` and ``mode`` are the ones asked for. A ``torch.save`` into it
is the save of the path (the private file stays empty and is dropped at ``close``); whatever
else is written to it (or nothing, with no save) is saved to the path at ``close`` as a
``torch.save`` is (``written``: once, by rank 0, paired across ranks, so that no rank's write
replaces the file another rank has still to read), so the file ends as one process leaves it.
Every other ``open``, and a path that is not a regular file, is left exactly as it is.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable
from typing import Any

from autoddp.in_rank.checkpoint.files import special

#: ``open``'s parameters after ``mode``, with their defaults: only a plain ``open(path, "wb")`` is taken.
_DEFAULTS = (
    ("buffering", -1),
    ("encoding", None),
    ("errors", None),
    ("newline", None),
    ("closefd", True),
    ("opener", None),
)
_CHUNK = 1 << 20


class PrivateFile(io.BufferedWriter):
    """What ``open(path, "wb")`` gives for a path capture's ``torch.save`` writes once (see above)."""

    def __init__(self, fd: int, name: Any, path: str, written: Callable[[PrivateFile], None]) -> None:
        """``fd``: the private file, opened for reading and writing; ``name``: as ``open`` was given
        it; ``path``: the real path it stands for; ``written``: puts what it holds at ``path``."""
        raw = io.FileIO(fd, "wb")
        raw.name = name  # what one process's file object says
        super().__init__(raw)
        self.path = path
        self.saved = False  # set by the torch.save hook: the path was saved through this file
        self.written = written

    def close(self) -> None:
        """Drop the private file after a save into it; else have what it holds written to the path."""
        if self.closed:
            return
        try:
            if not self.saved:
                self.flush()
                self.written(self)
        finally:
            super().close()


def opening(
    original: Callable[..., Any],
    session: Any,
    kept: Callable[[str, str], bool],
    written: Callable[[PrivateFile], None],
    any_kept: Callable[[], bool],
) -> Callable[..., Any]:
    """``open`` for a capture ``session``: a ``PrivateFile`` for a plain ``open(path, "wb")`` of a
    checkpoint (``kept(absolute path, real path)``; ``written`` at its close), else ``original``'s
    file object. Until there is any checkpoint (``any_kept``), no path is even resolved."""

    def open(file: Any, mode: Any = "r", *args: Any, **kwargs: Any) -> Any:
        if mode == "wb" and any_kept() and not session.busy and plain(args, kwargs):
            with session.own_work():  # (its own opens are not the user's writes)
                private = private_file(file, kept, written)
            if private is not None:
                return private
        return original(file, mode, *args, **kwargs)

    return open


def plain(args: tuple, kwargs: dict) -> bool:
    """True when ``open``'s arguments after ``mode`` are all its defaults."""
    names = dict(_DEFAULTS)
    if len(args) > len(_DEFAULTS) or any(name not in names for name in kwargs):
        return False
    given = {**{name: value for (name, _), value in zip(_DEFAULTS, args, strict=False)}, **kwargs}
    for name, value in given.items():
        default = names[name]
        if value is not default and not (type(value) is int and value == default):
            return False
    return True


def private_file(
    file: Any, kept: Callable[[str, str], bool], written: Callable[[PrivateFile], None]
) -> PrivateFile | None:
    """A ``PrivateFile`` for ``open(file, "wb")`` when ``file`` is a checkpoint (``kept``) and a
    regular file or absent, else None (the original ``open`` runs)."""
    if not isinstance(file, (str, bytes, os.PathLike)):
        return None
    try:
        path = os.fsdecode(os.fspath(file))
        absolute, real = os.path.abspath(path), os.path.realpath(path)
    except (TypeError, ValueError):
        return None
    if not kept(absolute, real) or special(path):
        return None
    try:
        fd = _nameless(os.path.dirname(real))
    except OSError:  # (a folder this process may not write in): as one process opens it
        return None
    name = file if isinstance(file, bytes) else path
    return PrivateFile(fd, name, real, written)  # (real: a later chdir)


def _nameless(folder: str) -> int:
    """A new file in ``folder`` (the path's own file system) with no name: nothing to leave behind."""
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    if hasattr(os, "O_TMPFILE"):
        with contextlib.suppress(OSError):  # a file system without it: a named one, unlinked
            return os.open(folder, flags | os.O_TMPFILE, 0o600)
    fd, name = tempfile.mkstemp(prefix=".autoddp-", suffix=".open", dir=folder)
    os.unlink(name)
    return fd


def copy_in_place(private: PrivateFile) -> None:
    """Write the whole of ``private`` to its path in place (created or truncated, as ``open``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    with io.FileIO(os.open(private.path, flags, 0o666), "wb") as out:
        copy_to(private, out)


def copy_to(private: PrivateFile, out: Any) -> None:
    """Write the whole of ``private`` (flushed) to the file object ``out``."""
    fd, offset = private.raw.fileno(), 0
    while chunk := os.pread(fd, _CHUNK, offset):
        view = memoryview(chunk)
        while view:
            view = view[out.write(view) :]
        offset += len(chunk)
