"""Standard input goes to rank 0, as under torchrun: from where the caller stopped reading it.

A caller that read one line of its input holds more of it in ``sys.stdin``'s buffers (Python
reads ahead in blocks); a worker reading file descriptor 0 starts after that block. Where the
input is a file, the caller gives the read-ahead back to the file (``give_back_read_ahead``: the
offset, which the workers share, moves back to the caller's line), so rank 0 reads on exactly
where the caller stopped, as the function would in one process, and the caller reads on after
the call where rank 0 stopped. A pipe or a terminal cannot be rewound: what the caller read
ahead stays the caller's (it reads it after the call), and rank 0 reads what follows. The other
ranks read an empty input; their ``EOFError`` says why (``note_eof``).
"""

from __future__ import annotations

import contextlib
import sys


def give_back_read_ahead() -> None:
    """Move a file standard input's offset back to where the caller's ``sys.stdin`` stopped, dropping
    its read-ahead (read again from the file; nothing is lost). A pipe or terminal is left alone."""
    stream = sys.stdin
    with contextlib.suppress(AttributeError, OSError, ValueError):
        if stream is None or stream.closed or stream.fileno() != 0 or not stream.seekable():
            return
        stream.seek(stream.tell())


#: The note on an ``EOFError`` of a rank other than 0 (whose standard input is empty).
EOF_NOTE = (
    "autoddp: standard input goes to rank 0 only, as under torchrun; rank {rank} reads an empty "
    "one. Read the input on rank 0 and share it (torch.distributed.broadcast_object_list), or pass "
    "it as a file or an argument"
)


def note_eof(exc: BaseException, rank: int) -> None:
    """Say why ``exc`` happened when it is an ``EOFError`` on a rank whose input is empty."""
    if rank != 0 and isinstance(exc, EOFError) and hasattr(exc, "add_note"):
        note = EOF_NOTE.format(rank=rank)
        if note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)
