"""Distributed samplers that move to the next epoch by themselves and shard any sampler's order.

``AutoEpochSampler`` is torch's DistributedSampler (padded, never dropping samples) with an epoch
that advances on every pass; ``ShardedSampler`` shares out the order of any sampler or batch
sampler, drawn alike on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

from autoddp.state import World


class AutoEpochSampler(DistributedSampler):
    """A DistributedSampler (padded, never dropping samples) that moves to the next epoch by itself.

    Every pass over it (DataLoader iterates its sampler once per epoch, also with persistent
    workers) uses the next epoch, so each epoch is shuffled differently, identically on every rank,
    with no ``set_epoch`` call. An explicit ``set_epoch(n)`` still wins: the next pass uses ``n``,
    the ones after it ``n + 1``, ``n + 2``... The epoch advances when the pass starts yielding, not
    when ``iter()`` is called, because DataLoader may create and drop a sampler iterator unused.
    """

    def __init__(self, source: Any, *, world: World, shuffle: bool, seed: int) -> None:
        super().__init__(
            source,
            num_replicas=world.world_size,
            rank=world.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=False,
        )
        self._next_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass; later passes continue from it."""
        super().set_epoch(epoch)
        self._next_epoch = epoch

    def _begin_pass(self) -> None:
        self.epoch = self._next_epoch
        self._next_epoch = self.epoch + 1

    def __iter__(self) -> Iterator[Any]:
        self._begin_pass()
        yield from super().__iter__()


class ShardedSampler(AutoEpochSampler):
    """Shards any sampler or batch sampler by its own order: each rank takes every W-th item.

    On every pass the wrapped sampler is drawn in full under a seed shared by all ranks (its
    ``generator``, if it has that attribute, is replaced for the draw by one seeded from the shared
    seed and the epoch, and torch's global CPU generator is seeded the same way and restored
    afterwards), so all ranks see the same order and take disjoint shares of it. The order is
    padded by repeating its start, as DistributedSampler does, so every rank gets the same number
    of items. Wrapping a batch sampler shards whole batches.
    """

    def __init__(self, sampler: Any, *, world: World, seed: int) -> None:
        super().__init__(sampler, world=world, shuffle=False, seed=seed)
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        self._begin_pass()
        order = _draw(self.sampler, (self.seed + self.epoch) % 2**64)
        yield from _share(order, self.rank, self.num_replicas)


def _draw(sampler: Any, seed: int) -> list[Any]:
    """The full order of one pass over ``sampler``, drawn under ``seed``."""
    replaced = False
    if hasattr(sampler, "generator"):
        original = sampler.generator
        try:
            sampler.generator = torch.Generator().manual_seed(seed)
            replaced = True
        except (AttributeError, TypeError):
            pass
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return list(sampler)
    finally:
        if replaced:
            sampler.generator = original


def _share(order: list[Any], rank: int, world_size: int) -> list[Any]:
    """Rank ``rank``'s share of ``order``, padded by repeating its start to a multiple of the world."""
    if not order:
        return []
    total = math.ceil(len(order) / world_size) * world_size
    padded = (order * math.ceil(total / len(order)))[:total]
    return padded[rank:total:world_size]
