"""The step record: one small file per rank in the run folder, with where its steps' time went.

A rank keeps its running totals (the steps timed, their seconds, the seconds of those spent
waiting for data and waiting in collectives, the samples its loaders handed out) in its file,
mapped into memory: one ``pack_into`` after each optimizer step, no system call
(``in_rank.step_report`` measures). The launcher reads the files with one ``pread`` each, at the
end of the run and whenever asked while it runs (``launch.step_report`` words the report). The
layout both sides share, and nothing else.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct

_MAGIC = b"ADS1"
#: magic, rank, world size, steps timed, their seconds, seconds waiting for data, seconds waiting in
#: collectives, samples, optimizer steps in all (the first is not timed)
LAYOUT = struct.Struct("<4siiQdddQQ")
_PREFIX = "steps-"


def path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"{_PREFIX}{rank}.record")


@dataclasses.dataclass(frozen=True)
class Totals:
    """One rank's totals, as the launcher read them."""

    rank: int
    world_size: int
    steps: int  # steps timed: each from the end of one optimizer step to the end of the next
    seconds: float
    data: float  # seconds of those waiting for data (inside a DataLoader's iterator)
    waited: float  # seconds of those waiting in collectives for the other ranks
    samples: int  # samples the rank's DataLoaders handed out in those steps
    all_steps: int  # optimizer steps taken, the first (not timed) included

    @property
    def compute(self) -> float:
        """Seconds of the timed steps neither waiting for data nor in collectives."""
        return max(self.seconds - self.data - self.waited, 0.0)


def read(folder: str) -> list[Totals]:
    """Every rank's totals in ``folder``, by rank (a file being written or not written yet: left out)."""
    found: dict[int, Totals] = {}
    try:
        names = [name for name in os.listdir(folder) if name.startswith(_PREFIX)]
    except OSError:
        return []
    for name in names:
        try:
            with open(os.path.join(folder, name), "rb") as handle:
                data = handle.read(LAYOUT.size)
        except OSError:
            continue
        if len(data) < LAYOUT.size or data[:4] != _MAGIC:
            continue
        totals = Totals(*LAYOUT.unpack(data)[1:])
        found[totals.rank] = totals
    return [found[rank] for rank in sorted(found)]


class Writer:
    """The rank's side: its file, mapped into memory (``write`` after each step)."""

    def __init__(self, folder: str, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        fd = os.open(path(folder, rank), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, LAYOUT.size)
            self.map: mmap.mmap | None = mmap.mmap(fd, LAYOUT.size)
        finally:
            os.close(fd)
        self.write(0, 0.0, 0.0, 0.0, 0, 0)

    def write(
        self, steps: int, seconds: float, data: float, waited: float, samples: int, all_steps: int
    ) -> None:
        if self.map is not None:
            LAYOUT.pack_into(
                self.map,
                0,
                _MAGIC,
                self.rank,
                self.world_size,
                steps,
                seconds,
                data,
                waited,
                samples,
                all_steps,
            )

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None

    def forget(self) -> None:
        """In a forked child: never write into the parent's record."""
        self.map = None
