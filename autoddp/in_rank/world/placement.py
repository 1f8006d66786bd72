"""Which GPU is this process's own, and what a CUDA index or storage location names in a world.

In a world of several processes each process computes on one GPU of its own. The user's
single-GPU habits name GPU 0 (``"cuda:0"``, ``set_device(0)``, a checkpoint saved from cuda:0)
or the process's ``LOCAL_RANK`` (torchrun-style code, which under ``--gpus-per-task=1`` may say 3
where the only visible GPU is cuda:0): both mean the own GPU. Any other index is another
process's GPU, a clear error. Pure decisions fed the facts, so that they are tested without GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autoddp.core.errors import ConfigurationError
from autoddp.core.state import World


def own_gpu(world: World, visible: int) -> int | None:
    """The index of this process's own GPU, or None where it has none (no GPU visible).

    ``world.device`` names it when the run computes on CUDA; a run on the CPU beside visible GPUs
    (``backend='gloo'``) takes the one its environment would: ``local_rank`` modulo the visible
    GPUs (every GPU of the node visible: its local rank; one bound to the task: cuda:0).
    """
    if world.device.startswith("cuda:"):
        return int(world.device.split(":")[1])
    if visible <= 0:
        return None
    return world.local_rank % visible


def own_index(named: int, own: int, world: World) -> int:
    """The GPU the user's index ``named`` means here: the own one for 0, ``own`` or ``LOCAL_RANK``."""
    if named in (0, own, world.local_rank):
        return own
    raise ConfigurationError(
        f"cuda:{named} is not this process's GPU: rank {world.rank} of {world.world_size} computes on "
        f"cuda:{own}, and every process has a GPU of its own. Say device='cuda', autoddp.device() or "
        "cuda:0 (each means this process's own GPU), or turn capture off "
        "(@distributed(capture=False), autoddp --no-capture)"
    )


def restore_cuda_on(own: int) -> Callable[[Any, str], Any]:
    """A ``map_location`` that restores every CUDA storage on GPU ``own``, the others as saved."""
    target = f"cuda:{own}"

    def restore(storage: Any, location: str) -> Any:
        if not location.startswith("cuda"):
            return None  # torch restores it where it was saved (the CPU)
        from torch.serialization import default_restore_location

        return default_restore_location(storage, target)

    return restore
