"""The hang record: one small file per worker saying what the worker waits in, and since when.

The worker maps its file into memory and rewrites a few bytes when it enters or leaves a
collective: a memory write, no system call, so the training step does not notice. A second slot
says which collective this rank started has not completed yet, and since when (NCCL's queued
collectives, asynchronous work objects): the worker's poller (``pending``) keeps it. The launcher
reads it with one ``pread`` per check. Times are ``time.monotonic()`` (CLOCK_MONOTONIC, one clock
for every process of a machine), so the launcher can tell how long a rank has waited. The layout
both sides share, and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import os
import signal
import struct
import threading

from autoddp.core._compat import COLLECTIVES, DDP_BUFFER_BROADCAST
from autoddp.core._compat.collectives import FUNCTIONAL_COLLECTIVES
from autoddp.core._leftovers import private_folder
from autoddp.core.errors import ConfigurationError

#: ``hang_report`` when not given: seconds a rank may wait for the others before the report.
DEFAULT_SECONDS = 60.0
#: The poller thread's function (``pending``): the caller leaves that thread out of stack dumps.
POLLER = "poll_pending_collectives"


def checked_seconds(seconds: object) -> float:
    """The ``hang_report=`` option checked: seconds >= 0, 0 (and ``inf``: never) for off."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ConfigurationError(
            f"hang_report={seconds!r} must be a number of seconds >= 0: how long ranks may wait for "
            "another before autoddp says which rank and where (e.g. hang_report=120; 0: off)"
        )
    return 0.0 if math.isinf(seconds) else float(seconds)  # (inf: no watch that never speaks)


#: The signal that makes a worker write its Python stacks (faulthandler answers it, in C, also
#: while the worker blocks in C++ with the GIL released). None where there is no spare one.
DUMP_SIGNAL: int | None = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None

_MAGIC = b"ADH1"
_HEADER = struct.Struct("<4sIiiiQ")  # magic, pid, rank, world size, local rank, main thread ident
STATE = struct.Struct("<QBBHxxxxd")  # sequence, flags, kind, name, since (time.monotonic())
#: The oldest collective started but not completed: its number (0: none), name, since, then its site.
PENDING = struct.Struct("<QHxxxxxxd")
STATE_OFFSET = _HEADER.size
PENDING_OFFSET = STATE_OFFSET + STATE.size
_SITE_OFFSET = PENDING_OFFSET + PENDING.size
_SITE_BYTES = 480
PENDING_SITE_OFFSET = _SITE_OFFSET + _SITE_BYTES
SIZE = PENDING_SITE_OFFSET + _SITE_BYTES

# What a worker is doing (``kind``).
OUTSIDE = 0  # none of the below: computing, loading data, sleeping...
COLLECTIVE = 1  # inside a torch.distributed collective (``name``)
BACKWARD = 2  # inside backward() with a DDP model: DDP all-reduces the gradients there
WAITS_FOR_RANK0 = 3  # a rank0() block's other ranks, waiting for rank 0 (``site``)
RUNS_RANK0 = 4  # rank 0 running the body of a rank0() block (``site``)
QUEUED = 5  # (as judged) outside any call, but a collective it started has not completed

# ``flags``
ACTIVE = 1  # the user's code runs
HAS_DDP = 2  # a DistributedDataParallel model exists in the worker
ANSWERS = 4  # the worker answers DUMP_SIGNAL (never send it otherwise: by default it kills)

#: What ``name`` numbers: the collectives rank0() refuses, then the others that wait for every rank.
NAMES = (
    *COLLECTIVES,
    *(name for name in FUNCTIONAL_COLLECTIVES if name not in COLLECTIVES),
    "init_process_group",
    "new_group",
    DDP_BUFFER_BROADCAST,
    "backward",
)
_SHOWN = {
    DDP_BUFFER_BROADCAST: "DDP's broadcast of rank 0's parameters and buffers",
    "backward": "DDP's gradient all-reduce in backward()",
}


def folder() -> contextlib.AbstractContextManager[str]:
    """A private folder (mode 0700) for one run's records, removed afterwards (after a SIGKILL, by
    a later start: ``_leftovers``).

    In memory (``/dev/shm``) where the machine has it: the mapped pages then never go to a disk.
    """
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
    return private_folder("autoddp-hang-", base)


def record_path(folder: str, local_rank: int) -> str:
    return os.path.join(folder, f"hang-{local_rank}.record")


def dump_path(folder: str, local_rank: int) -> str:
    """Where a worker writes its stacks when asked (DUMP_SIGNAL)."""
    return os.path.join(folder, f"hang-{local_rank}.stacks")


@dataclasses.dataclass(frozen=True)
class Record:
    """What one worker said about itself, as the launcher read it."""

    pid: int
    rank: int
    world_size: int
    local_rank: int
    thread: int  # the worker's main thread, as faulthandler names it
    sequence: int  # changes at every entry and exit
    flags: int
    kind: int
    name: int
    since: float
    site: str = ""  # where a rank0() block is, for the block kinds
    pending: int = 0  # the oldest collective started and not completed: its number (0: none)
    pending_name: int = 0
    pending_since: float = 0.0
    pending_site: str = ""  # where it was called: "path\0line\0function"

    @property
    def active(self) -> bool:
        return bool(self.flags & ACTIVE)

    @property
    def answers(self) -> bool:
        """Whether the worker writes its stacks when sent DUMP_SIGNAL."""
        return bool(self.flags & ACTIVE and self.flags & ANSWERS)

    @property
    def blocked(self) -> bool:
        """Waiting for other ranks: in a collective, in DDP's backward, or for rank 0's block."""
        return self.kind in (COLLECTIVE, BACKWARD, WAITS_FOR_RANK0, QUEUED)

    @property
    def in_collective(self) -> bool:
        return self.kind in (COLLECTIVE, BACKWARD, QUEUED)

    @property
    def what(self) -> str:
        """The collective's name as the user knows it (``all_reduce``)."""
        name = NAMES[self.name] if 0 <= self.name < len(NAMES) else f"collective #{self.name}"
        return _SHOWN.get(name, name)


def judged(rec: Record | None) -> Record | None:
    """``rec`` as the report judges it: a rank outside any call whose collective has not completed
    (queued on the GPU by NCCL, or an asynchronous work object) waits in that collective (``QUEUED``).
    """
    if rec is None or not rec.pending or rec.kind != OUTSIDE:
        return rec
    return dataclasses.replace(
        rec,
        kind=QUEUED,
        name=rec.pending_name,
        since=rec.pending_since,
        sequence=rec.sequence | rec.pending << 32,  # a new situation when either changes
    )


def pending_frame(rec: Record) -> tuple[str, int, str] | None:
    """(path, line, function) where ``rec``'s pending collective was called, if known."""
    parts = rec.pending_site.split("\0")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2]


def read(path: str) -> Record | None:
    """The record at ``path``, or None when there is none (yet) or it is being rewritten."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        for _ in range(3):  # a worker may be writing: take two equal reads
            first, second = os.pread(fd, SIZE, 0), os.pread(fd, SIZE, 0)
            if first == second:
                break
        else:
            return None
    finally:
        os.close(fd)
    if len(first) < SIZE or first[:4] != _MAGIC:
        return None
    _, pid, rank, world_size, local_rank, thread = _HEADER.unpack_from(first, 0)
    sequence, flags, kind, name, since = STATE.unpack_from(first, STATE_OFFSET)
    site = _text(first[_SITE_OFFSET:PENDING_SITE_OFFSET])
    pending, pending_name, pending_since = PENDING.unpack_from(first, PENDING_OFFSET)
    pending_site = _text(first[PENDING_SITE_OFFSET:SIZE]) if pending else ""
    fields = (pid, rank, world_size, local_rank, thread, sequence, flags, kind, name, since, site)
    return Record(*fields, pending, pending_name, pending_since, pending_site)


def _text(data: bytes) -> str:
    return data.split(b"\0\0", 1)[0].rstrip(b"\0").decode("utf-8", "replace")


class Writer:
    """The worker's side: its record, mapped into memory."""

    def __init__(self, path: str, rank: int, world_size: int, local_rank: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self.map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        thread = threading.main_thread().ident or 0
        _HEADER.pack_into(self.map, 0, _MAGIC, os.getpid(), rank, world_size, local_rank, thread)

    def site(self, text: str) -> None:
        """Say where (a rank0() block); written before the state that refers to it."""
        data = text.encode("utf-8", "replace")[: _SITE_BYTES - 2]
        self.map[_SITE_OFFSET : _SITE_OFFSET + len(data) + 2] = data + b"\0\0"

    def pending(self, number: int, name: int, since: float, site: tuple[str, int, str] | None) -> None:
        """Say which collective started here has not completed (``number`` 0: none), and where."""
        if number and site is not None:
            data = "\0".join((site[0], str(site[1]), site[2])).encode("utf-8", "replace")[: _SITE_BYTES - 2]
            self.map[PENDING_SITE_OFFSET : PENDING_SITE_OFFSET + len(data) + 2] = data + b"\0\0"
        PENDING.pack_into(self.map, PENDING_OFFSET, number, name, since)

    def close(self) -> None:
        self.map.close()
