"""Lines a library's C++ code writes to file descriptor 1, kept out of the user's standard output.

A worker's standard output is the user's: what the script prints, as one process would. Native
code that prints there (gloo on some torch releases, see ``_compat.gloo_lines``) is held off for
the length of one call: descriptor 1 points at a temporary file meanwhile, and what else reached
it (another thread's prints) is written to the real standard output, in order, when the call
returns. The terminal stays a terminal outside the call.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def without_lines(pattern: re.Pattern[bytes]) -> Iterator[None]:
    """Run the block with the lines of descriptor 1 that start with ``pattern`` dropped."""
    libc = ctypes.CDLL(None)  # C's own stdout buffer (std::cout writes through it)
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (closed): nothing printed there can reach anyone
        yield
        return
    _flush(libc)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 1)
        try:
            yield
        finally:
            _flush(libc)
            os.dup2(saved, 1)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held if not pattern.match(line))
            with open(1, "wb", closefd=False) as out:
                out.write(kept)


def _flush(libc: ctypes.CDLL) -> None:
    if sys.__stdout__ is not None:
        sys.__stdout__.flush()
    libc.fflush(None)
