"""The launcher's side of the stacks: ask workers for them, read faulthandler's dumps, find the user's frames.

A worker that answers (``record.ANSWERS``) writes every thread's Python stack to its dump file
when it receives ``record.DUMP_SIGNAL`` (see ``marks``); the stack that matters is its main
thread's, where the user's code runs. Frames are the user's unless they lie in the standard
library, in installed packages (torch among them) or in autoddp itself.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sysconfig
import time
from collections.abc import Iterable

from autoddp.hang import record

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_WAIT_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str

    @property
    def user(self) -> bool:
        return _is_user(self.path)

    def shown(self) -> str:
        """``train.py:12 in step`` (the user's files by name, libraries from their package down)."""
        return f"{where(self.path, self.line)} in {self.function}"


def where(path: str, line: int) -> str:
    """``file.py:12`` for the user's files; ``torch/nn/modules/module.py:12`` for a library's."""
    return f"{_short(path)}:{line}"


def collect(folder: str, records: Iterable[record.Record]) -> dict[int, list[Frame]]:
    """Ask each worker for its stacks; the main thread's frames (most recent first), by local rank.

    A worker that does not answer within a couple of seconds is left out.
    """
    asked = {}
    for rec in records:
        if not rec.answers or record.DUMP_SIGNAL is None or not _is_our_child(rec.pid):
            continue
        path = record.dump_path(folder, rec.local_rank)
        try:
            os.truncate(path, 0)
            os.kill(rec.pid, record.DUMP_SIGNAL)
        except OSError:
            continue
        asked[rec.local_rank] = (path, rec.thread)
    texts: dict[int, str] = {}
    deadline = time.monotonic() + _WAIT_SECONDS
    while asked.keys() - texts.keys() and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = {rank: _read(path) for rank, (path, _) in asked.items() if rank not in texts}
        time.sleep(0.02)
        for rank, text in pending.items():
            if text and text == _read(asked[rank][0]):  # done writing
                texts[rank] = text
    return {rank: main_thread(texts[rank], asked[rank][1]) for rank in texts}


def main_thread(dump: str, thread: int) -> list[Frame]:
    """The frames of ``thread`` in a faulthandler dump (of all threads), most recent call first."""
    frames: list[Frame] = []
    current: int | None = None
    for line in dump.splitlines():
        header = _THREAD.match(line)
        if header:
            current = int(header.group(1), 16)
            continue
        frame = _FRAME.match(line)
        if frame and current == thread:
            frames.append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    return frames


def users_first(frames: list[Frame]) -> tuple[list[Frame], list[Frame]]:
    """(the user's frames, the library frames it called into), most recent call first.

    The worker's own outermost frames (autoddp's call path, and what called it in the caller a
    forked worker was copied from) are left out.
    """
    user = [frame for frame in _above_call_path(frames) if frame.user]
    inner = []
    for frame in frames:
        if frame.user:
            break
        inner.append(frame)
    return user, inner


def innermost_user(frames: list[Frame]) -> Frame | None:
    """The user's line that the stack is at (None if only autoddp's own code runs)."""
    return next((f for f in _above_call_path(frames) if f.user), None)


def _above_call_path(frames: list[Frame]) -> list[Frame]:
    for at, frame in enumerate(frames):
        if os.path.realpath(frame.path) in _CALL_PATH:
            return frames[:at]
    return frames


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def _is_our_child(pid: int) -> bool:
    """Whether ``pid`` is a process this launcher started (never signal a stranger that reused a pid).

    Read from ``/proc``; where there is none, no process is asked.
    """
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[1] == str(os.getpid())  # the field after the state is the parent's pid


#: autoddp's own folder (its frames are never the user's, also in an editable install).
_AUTODDP = os.path.join(os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "")


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(os.path.dirname(os.__file__))
    return (_AUTODDP, *sorted({os.path.join(os.path.realpath(r), "") for r in roots}, key=len, reverse=True))


_LIBRARIES = _library_roots()
#: The worker's call path: the user's code runs below these frames.
_CALL_PATH = {os.path.join(_AUTODDP, name) for name in ("running.py", "_worker.py", "_script.py")}


def _is_user(path: str) -> bool:
    if path.startswith("<"):  # <frozen runpy>, <string>
        return False
    return not os.path.realpath(path).startswith(_LIBRARIES)


def _short(path: str) -> str:
    if _is_user(path):
        return os.path.basename(path)
    real = os.path.realpath(path)
    if real.startswith(_AUTODDP):
        return os.path.join("autoddp", real[len(_AUTODDP) :])
    for root in _LIBRARIES:
        if real.startswith(root):
            return real[len(root) :]
    return path
