"""The current world for user code: rank, world size, device, and a barrier.

The helpers read the world this process joined (``autoddp.core.state.CURRENT``) and, outside any
joined world, what the environment says (rank 0 of a world of 1 in a plain process). Nothing
here writes ``os.environ``.
"""

from __future__ import annotations

import torch

from autoddp.core import environment
from autoddp.core.state import CURRENT, World


def current() -> World:
    """The world of this process: the joined one, else the one the environment describes."""
    if CURRENT.world is not None:
        return CURRENT.world
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
