"""Private folders that name their owner, so that a later start removes those a SIGKILL left.

A run removes its folders (the run folder, the hang records, scratch space) when it ends; a
SIGKILL skips that, and they would stay forever. Each folder therefore holds a small marker
naming the process that made it: its pid and what tells that process from a later one given
the same pid (its start time, the boot, the pid namespace, the host). The first folder a process
makes in a place reaps there the folders whose owner is certainly gone. A folder without a
marker, another user's, or one whose owner lives or cannot be judged (another machine, another
container) is left alone. Reaping is housekeeping: it never raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

#: What every folder of autoddp's is named by (``autoddp-``, ``autoddp-hang-``...).
PREFIX = "autoddp-"
#: The marker file inside each folder.
MARKER = ".autoddp-owner"
_MARKER_BYTES = 4096

#: The places this process has reaped already: once per process and place, not once per folder.
_reaped: set[str] = set()


#: Passes over a private folder at its end before it is left (each after a short pause).
_REMOVALS = 20


@contextlib.contextmanager
def private_folder(prefix: str, base: str | None = None) -> Iterator[str]:
    """A new folder (mode 0700) in ``base`` (None: the temporary directory), removed afterwards."""
    path = make(prefix, base)
    try:
        yield path
    finally:
        _remove_all(path)


def _remove_all(path: str) -> None:
    """Remove ``path`` and everything in it, its marker last, also what a process that is ending
    writes into it meanwhile; what is still left after that is reaped by a later start."""
    for _ in range(_REMOVALS):
        with contextlib.suppress(OSError):
            _remove(path)
        if not os.path.lexists(path):
            return
        time.sleep(0.05)


def make(prefix: str, base: str | None = None) -> str:
    """A new folder (mode 0700) in ``base`` holding its owner's marker; the first in a place reaps it."""
    place = base if base is not None else tempfile.gettempdir()
    if place not in _reaped:
        _reaped.add(place)
        reap(place)
    path = tempfile.mkdtemp(prefix=prefix, dir=place)
    with contextlib.suppress(OSError):  # without its marker a folder is only never reaped
        fd = os.open(os.path.join(path, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(_identity(os.getpid()), handle)
    return path


def reap(base: str, prefix: str = PREFIX) -> int:
    """Remove the folders in ``base`` named ``prefix...`` whose owner is certainly gone; how many."""
    removed = 0
    try:
        here, uid = _identity(None), os.getuid()
        with os.scandir(base) as entries:
            for entry in entries:
                if entry.name.startswith(prefix):
                    with contextlib.suppress(Exception):  # gone meanwhile, not ours to remove...
                        if _left_over(entry, uid, here):
                            _remove(entry.path)
                            removed += 1
    except Exception:  # housekeeping: nothing here may stop a run
        pass
    return removed


def _identity(pid: int | None) -> dict[str, Any]:
    """What tells process ``pid`` from any other, before or after it (None: this machine only)."""
    found: dict[str, Any] = {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id")}
    try:
        found["pidns"] = os.readlink("/proc/self/ns/pid")
    except OSError:
        found["pidns"] = ""
    if pid is not None:
        stat = _stat(pid)
        found.update(pid=pid, start=stat[1] if stat else None)
    return found


def _left_over(entry: os.DirEntry, uid: int, here: dict[str, Any]) -> bool:
    """True for a folder of this user's whose marker names a process that is certainly gone."""
    if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
        return False
    fd = os.open(os.path.join(entry.path, MARKER), os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as handle:
        owner = json.loads(handle.read(_MARKER_BYTES))
    return isinstance(owner, dict) and _gone(owner, here)


def _gone(owner: dict[str, Any], here: dict[str, Any]) -> bool:
    """True only when the process ``owner`` describes can no longer run; False when unsure."""
    if owner.get("host") != here["host"]:
        return False  # another machine's, on a shared folder
    if owner.get("boot") != here["boot"]:
        return bool(owner.get("boot") and here["boot"])  # an earlier boot of this machine
    if owner.get("pidns") != here["pidns"] or (here["boot"] and not here["pidns"]):
        return False  # another container's processes are not visible from here (or unsure)
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    stat = _stat(pid) if isinstance(owner.get("start"), int) else None
    if stat is None:  # /proc does not show it (or told nothing when the marker was written)
        return not _exists(pid)
    state, start = stat
    return state in ("Z", "X") or start != owner["start"]  # exited, or the pid is another process's now


def _stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter and start time (clock ticks after boot), or None."""
    fields = _read(f"/proc/{pid}/stat").rpartition(")")[2].split()
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return fields[0], int(fields[19])


def _remove(path: str) -> None:
    """Remove ``path``, its marker last: a folder only partly removed is reaped again next time."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name == MARKER:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):  # (a folder that never got its marker)
        os.unlink(os.path.join(path, MARKER))
    os.rmdir(path)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM), or unknown: it may be alive
        return True
    return True


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""
