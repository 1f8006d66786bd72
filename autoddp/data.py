"""Data sharding: give DataLoaders a DistributedSampler (placeholder, filled in by issue 3)."""

from __future__ import annotations

from torch.utils.data import DataLoader

from autoddp.world import World


def shard_loader(loader: DataLoader, world: World) -> DataLoader:
    """Return ``loader`` sharded for ``world`` (unchanged with one process)."""
    return loader
