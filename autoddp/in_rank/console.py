"""Console output that does not repeat itself once per process.

In a run of N processes every ``print`` and every progress bar appears N times, and lines from
different ranks can interleave. ``print`` here shows a message once, from global rank 0, unless
asked for every rank's copy (then each line says which rank wrote it); ``progress`` draws one
progress bar, on rank 0, while every rank iterates over exactly the same items.

Outside a distributed run (one process) both behave like their plain counterparts. Nothing here
keeps state between calls: the rank is read from the current world at each call.
"""

from __future__ import annotations

import builtins
import os
import re
import sys
from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

from autoddp.core import _variables
from autoddp.in_rank import world

T = TypeVar("T")

#: The start of every line of a message (lines end with "\n" only, as on a console), except the
#: empty end of a message that ends with a newline.
_LINE_START = re.compile(r"^(?!\Z)", re.MULTILINE)


class SupportsWrite(Protocol):
    """What ``print`` writes to: any object with a ``write(str)`` method, as for the builtin."""

    def write(self, text: str, /) -> Any: ...


def print(
    *args: object,
    sep: str | None = " ",
    end: str | None = "\n",
    file: SupportsWrite | None = None,
    flush: bool = False,
    all_ranks: bool = False,
) -> None:
    """Print like the builtin ``print``, but once per job instead of once per process.

    By default only global rank 0 prints, so a message written by every process appears once.
    With ``all_ranks=True`` every rank prints and each line is prefixed with ``[rank N] ``, so a
    reader can tell the copies apart. In a distributed run the whole message goes out in one
    ``write`` and is flushed at once: ranks sharing a terminal or a pipe then never split each
    other's lines, and the output is not held back in a buffer until the process exits.

    Outside a distributed run (a world of one process) this is exactly the builtin ``print``.
    """
    here = world.current()
    if here.world_size <= 1:
        builtins.print(*args, sep=sep, end=end, file=file, flush=flush)
        return
    for name, value in (("sep", sep), ("end", end)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be None or a string, not {type(value).__name__}")
    if not all_ranks and here.rank != 0:
        return
    if file is None:
        file = sys.stdout
        if file is None:  # no console at all (pythonw); the builtin print is silent too
            return
    text = (" " if sep is None else sep).join(str(arg) for arg in args) + ("\n" if end is None else end)
    if all_ranks and os.environ.get(_variables.LINE_PREFIX) != "1":  # else the launcher prefixes lines
        prefix = f"[rank {here.rank}] "
        text = _LINE_START.sub(lambda _: prefix, text)  # each line, not the end after a final newline
    file.write(text)
    flush_file = getattr(file, "flush", None)
    if flush_file is not None:
        flush_file()


def progress(iterable: Iterable[T], **kwargs: Any) -> Iterable[T]:
    """Wrap ``iterable`` in a progress bar that only global rank 0 draws.

    Every rank gets back an iterable over exactly the same items, in the same order: the bar
    only watches the iteration and never changes it, so collectives inside the loop (a DDP
    backward, an ``all_reduce``) stay in step across ranks. Keyword arguments go to
    ``tqdm.auto.tqdm`` (``desc=``, ``total=``, ``unit=``...). Every rank gets a ``tqdm`` object
    (disabled off rank 0), so ``bar.set_postfix(...)`` and the like work on every rank. ``tqdm``
    is optional: without it the iterable itself is returned and nothing is drawn.
    """
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    if not world.is_main():
        kwargs["disable"] = True
    return tqdm(iterable, **kwargs)
