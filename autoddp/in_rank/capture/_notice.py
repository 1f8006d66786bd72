"""The notice: what capture distributed, said once, on rank 0 only, and nothing if nothing was found."""

from __future__ import annotations

import gc
import os
import sys
import weakref

from autoddp.in_rank.capture._registry import Site

HOW_TO_TURN_OFF = "turn it off with @distributed(capture=False) or autoddp --no-capture"


class Notice:
    """Lines on rank 0's stderr: a header at the first capture, then one line per new finding.

    What was only left alone (an ordered loader) is said once something was captured, and not at
    all when nothing was. A line is said once per object it is about (``subject``): a loader made
    anew each epoch at one line is said once (the earlier one is gone when the next comes), two
    loaders made at one line or two models of one class each get their own line.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.said: set[object] = set()
        #: Each line said, with the objects it was said for (weakly; None: no object given).
        self.lines: dict[str, list[weakref.ref | None]] = {}
        self.captured = False
        self._held: list[str] = []

    def say(self, key: object, line: str, *, captured: bool = True, subject: object = None) -> None:
        """Say ``line`` once for ``key`` (on rank 0; the other ranks found the same), and once for
        ``subject``, the object it is about: the same line for another live object is said again,
        numbered."""
        if key in self.said:
            return
        earlier = self.lines.get(line)
        if earlier is not None and not _another_alive(earlier, subject):
            return
        self.said.add(key)
        self.lines.setdefault(line, []).append(_weak(subject))
        if earlier is not None:  # (earlier now holds this one too): the n-th alive at once
            alive = sum(1 for ref in earlier if ref is not None and ref() is not None)
            line = f"{line} (a {_ordinal(alive)} one)"
        if not captured and not self.captured:
            self._held.append(line)
            return
        if not self.captured:
            self.captured = True
            self._write(
                f"autoddp: capture: this code runs in each of {self.world_size} processes; autoddp "
                f"distributes what it finds ({HOW_TO_TURN_OFF}):"
            )
            for held in self._held:
                self._write(f"autoddp:   {held}")
        self._write(f"autoddp:   {line}")

    def _write(self, text: str) -> None:
        if self.rank == 0:
            _write(text)


def _weak(subject: object) -> weakref.ref | None:
    try:
        return None if subject is None else weakref.ref(subject)
    except TypeError:  # an object that takes no weak reference: never said again for another
        return None


def _another_alive(earlier: list[weakref.ref | None], subject: object) -> bool:
    """Whether ``subject`` is another object than those a line was said for, while one of them is
    still alive (else the line is about the same thing made again: said once)."""
    if subject is None or any(ref is not None and ref() is subject for ref in earlier):
        return False
    if not any(ref is not None and ref() is not None for ref in earlier):
        return False
    gc.collect()  # (rarely: a line said again; an earlier object held only by a cycle is gone)
    return any(ref is not None and ref() is not None for ref in earlier)


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def where(site: Site | None) -> str:
    """``file.py:12`` for a site (the file's name only), or a note that it is unknown."""
    if site is None or site[1] == 0:
        return "made before the call"
    return f"{os.path.basename(site[0])}:{site[1]}"


def _write(text: str) -> None:
    stream = sys.stderr
    if stream is not None:
        stream.write(text + "\n")
        stream.flush()
