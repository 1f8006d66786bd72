"""The notice: what capture distributed, said once, on rank 0 only, and nothing if nothing was found."""

from __future__ import annotations

import os
import sys

from autoddp.capture._registry import Site

HOW_TO_TURN_OFF = "turn it off with @distributed(capture=False) or autoddp --no-capture"


class Notice:
    """Lines on rank 0's stderr: a header at the first capture, then one line per new finding.

    What was only left alone (an ordered loader) is said once something was captured, and not at
    all when nothing was.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.said: set[object] = set()
        self.lines: set[str] = set()  # (a loader made anew each epoch at one line: said once)
        self.captured = False
        self._held: list[str] = []

    def say(self, key: object, line: str, *, captured: bool = True) -> None:
        """Say ``line`` once for ``key`` (on rank 0; the other ranks found the same)."""
        if key in self.said or line in self.lines:
            return
        self.said.add(key)
        self.lines.add(line)
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
