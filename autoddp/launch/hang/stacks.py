"""The launcher's side of the stacks: ask workers for them, read faulthandler's dumps, find the user's frames.

A worker that answers (``record.ANSWERS``) writes every thread's Python stack to its dump file
when it receives ``record.DUMP_SIGNAL`` (see ``marks``); the stack that matters is its main
thread's, where the user's code runs. Which frames are the user's, and how a file is named, is
``autoddp.core._frames``'s one rule.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Iterable

from autoddp.core import _frames
from autoddp.in_rank.hang import record

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_WAIT_SECONDS = 2.0
#: The signal masks of /proc/PID/task/TID/status read: pending (the thread's, the process's), blocked.
_MASKS = ("SigPnd", "ShdPnd", "SigBlk")


@dataclasses.dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str

    @property
    def user(self) -> bool:
        return _frames.is_user(self.path)

    def shown(self) -> str:
        """``train.py:12 in step`` (the user's files by name, libraries from their package down)."""
        return f"{where(self.path, self.line)} in {self.function}"


def where(path: str, line: int) -> str:
    """``file.py:12`` for the user's files; ``torch/nn/modules/module.py:12`` for a library's."""
    return f"{_frames.short(path)}:{line}"


def collect(folder: str, records: Iterable[record.Record]) -> dict[int, list[Frame]]:
    """Ask each worker for its stacks; the main thread's frames (most recent first), by local rank.

    A dump is read once the worker's handler has run to its end: the signal no longer pending
    and no thread inside the handler (``_handled``), never "the file stopped growing", which a
    loaded machine can fake. A worker that does not answer within a couple of seconds is left out.
    """
    asked = {}
    for rec in records:
        if not rec.answers or record.DUMP_SIGNAL is None or not _is_our_child(rec.pid):
            continue
        path = record.dump_path(folder, rec.local_rank)
        try:
            os.truncate(path, 0)
            blocking = _signal_state(rec.pid, record.DUMP_SIGNAL)[1]  # threads that always block it
            os.kill(rec.pid, record.DUMP_SIGNAL)
        except OSError:
            continue
        asked[rec.local_rank] = (path, rec.thread, rec.pid, blocking)
    texts: dict[int, str] = {}
    deadline = time.monotonic() + _WAIT_SECONDS
    while asked.keys() - texts.keys() and time.monotonic() < deadline:
        time.sleep(0.01)
        for rank, (path, _, pid, blocking) in asked.items():
            if rank not in texts and _handled(pid, record.DUMP_SIGNAL, blocking):
                text = _read(path)
                if text:  # (empty: the handler has not begun; ask again)
                    texts[rank] = text
    return {rank: main_thread(texts[rank], asked[rank][1]) for rank in texts}


def _handled(pid: int, signum: int, blocking: frozenset[int]) -> bool:
    """Whether ``signum``, sent to ``pid``, has been handled: not pending, and no thread blocks
    it but those that did before it was sent (faulthandler's handler runs with it blocked)."""
    try:
        pending, now_blocking = _signal_state(pid, signum)
    except OSError:  # the process is gone
        return True
    return not pending and now_blocking <= blocking


def _signal_state(pid: int, signum: int) -> tuple[bool, frozenset[int]]:
    """(``signum`` pending for ``pid`` or one of its threads, the threads blocking it), from /proc."""
    bit = 1 << (signum - 1)
    pending, blocking = False, set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as handle:
                masks = dict(
                    line.split(":", 1) for line in handle if line.startswith(("SigPnd", "ShdPnd", "SigBlk"))
                )
        except OSError:  # the thread ended
            continue
        pending |= any(int(masks[k], 16) & bit for k in ("SigPnd", "ShdPnd") if k in masks)
        if int(masks.get("SigBlk", "0"), 16) & bit:
            blocking.add(int(tid))
    return pending, frozenset(blocking)


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
        if _frames.is_runner(frame.path):
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
