"""The current world: which process this is, how many there are, and the device it owns.

One explicit object, ``CURRENT``, records the world a worker joined; the public helpers read it
and, outside any joined world, fall back to what the environment says (rank 0 of a world of 1
in a plain process). Nothing here writes ``os.environ``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process stands in a distributed job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    device: str = "cpu"
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How ``prepare`` treats models in the current run (set by ``@distributed``'s options)."""

    ddp_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sync_batchnorm: bool = False


class _Current:
    """Holds the world this process has joined, if any, and the run's options.

    Set only by the process-group lifecycle (``process_group.joined``).
    """

    def __init__(self) -> None:
        self.world: World | None = None
        self.options: RunOptions = RunOptions()
        #: Models wrapped in DDP in this process, released before their process group ends.
        self.wrapped: weakref.WeakSet = weakref.WeakSet()

    @contextlib.contextmanager
    def joined(self, world: World, options: RunOptions | None = None) -> Iterator[World]:
        previous = self.world, self.options
        self.world, self.options = world, options or RunOptions()
        try:
            yield world
        finally:
            self.world, self.options = previous


CURRENT = _Current()


def current() -> World:
    """The world of this process: the joined one, else the one the environment describes."""
    if CURRENT.world is not None:
        return CURRENT.world
    from autoddp import environment

    return environment.detect().world()


def rank() -> int:
    """Global rank of this process (0 outside a distributed run)."""
    return current().rank


def local_rank() -> int:
    """Rank of this process on its node (0 outside a distributed run)."""
    return current().local_rank


def world_size() -> int:
    """Number of processes in the job (1 outside a distributed run)."""
    return current().world_size


def device() -> torch.device:
    """The device this process computes on: its own GPU, else the CPU."""
    return torch.device(current().device)


def is_main() -> bool:
    """True on global rank 0, the process that should log and save."""
    return current().rank == 0


def barrier() -> None:
    """Wait until every process reaches this point; a no-op outside a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
