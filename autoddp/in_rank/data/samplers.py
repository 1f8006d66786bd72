"""Distributed samplers that move to the next epoch by themselves and shard any sampler's order.

``AutoEpochSampler`` is torch's DistributedSampler (padded, never dropping samples) with an epoch
that advances on every pass; ``ShardedSampler`` shares out the order of any sampler or batch
sampler, drawn alike on every rank.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data.distributed import DistributedSampler

from autoddp.core.state import World
from autoddp.in_rank.data.draws import OneProcessDraws
from autoddp.in_rank.world import streams


class AutoEpochSampler(DistributedSampler):
    """A DistributedSampler (padded, never dropping samples) that moves to the next epoch by itself.

    Every pass over it (DataLoader iterates its sampler once per epoch, also with persistent
    workers) uses the next epoch, so each epoch is shuffled differently, identically on every rank,
    with no ``set_epoch`` call. An explicit ``set_epoch(n)`` still wins: the next pass uses ``n``,
    the ones after it ``n + 1``, ``n + 2``... The epoch advances when the pass starts yielding, not
    when ``iter()`` is called, because DataLoader may create and drop a sampler iterator unused.
    Its sizes follow the data set's length as it is at every pass and every ``len()``, as one
    process's samplers do (a data set that grows or shrinks between epochs: curriculum, active
    learning); torch's DistributedSampler keeps the length it had when made.
    ``original``: the sampler one process would iterate; the draws its pass makes on the user's
    streams are made beside each pass (``draws.OneProcessDraws``), when it can be replayed.
    """

    def __init__(self, source: Any, *, world: World, shuffle: bool, seed: int, original: Any = None) -> None:
        # Not DistributedSampler.__init__: it stores the sizes (properties here) from len(source).
        self.dataset = source
        self.num_replicas = world.world_size
        self.rank = world.rank
        self.epoch = 0
        self._next_epoch = 0
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = False
        self.one_process = OneProcessDraws.of(original)

    @property
    def num_samples(self) -> int:
        """This rank's share of a pass now (a TypeError for a source with no length, as in one process)."""
        return math.ceil(len(self.dataset) / self.num_replicas)

    @property
    def total_size(self) -> int:
        """The pass's length now, padded to a multiple of the world."""
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass; later passes continue from it."""
        super().set_epoch(epoch)
        self._next_epoch = epoch

    def _begin_pass(self) -> None:
        self.epoch = self._next_epoch
        self._next_epoch = self.epoch + 1

    def __iter__(self) -> Iterator[Any]:
        # A chain over the pass's parts: lazy (nothing happens before the first item is asked
        # for), and each item handed out without a Python frame of ours (the training step's).
        return itertools.chain.from_iterable(self._pass())

    def _pass(self) -> Iterator[Iterable[Any]]:
        self._begin_pass()
        yield from _beside(self.one_process, super().__iter__(), self.num_replicas)


def _beside(
    one_process: OneProcessDraws | None, items: Iterator[Any], world_size: int
) -> Iterator[Iterable[Any]]:
    """``items`` in parts, with one process's draws made on the user's streams beside them when known."""
    return iter((items,)) if one_process is None else one_process.parts(items, world_size)


class ShardedSampler(AutoEpochSampler):
    """Shards any sampler or batch sampler by its own order: each rank takes every W-th item.

    Every pass streams the wrapped sampler's order in parts of ``CHUNK`` items per rank, so a huge
    or endless sampler (``RandomSampler(replacement=True, num_samples=10**10)``: "train for N
    iterations") costs memory for one part only, and the swaps below cost a few microseconds per
    batch at most. Each part is drawn under random states private to the pass (``streams.Private``:
    its ``generator`` attribute, if it has one, torch's global CPU generator, Python's ``random``
    and NumPy's global state, all seeded from the shared seed and the epoch), swapped in for the
    part and out after it: all ranks draw the same order whatever the user's code draws between
    batches, and that code's streams move only by the draws one process's sampler makes on them
    (``draws.OneProcessDraws``, beside the pass). Each rank keeps the items at its positions of
    the order; at the end of the order it is padded by repeating the order's start, as
    DistributedSampler pads, so every rank gets the same number of items. Wrapping a batch sampler
    shards whole batches.
    """

    CHUNK = 4096

    def __init__(self, sampler: Any, *, world: World, seed: int) -> None:
        # The sizes are read from len(sampler) when asked: an endless sampler has none.
        super().__init__(sampler, world=world, shuffle=False, seed=seed)
        self.sampler = sampler
        self.one_process = OneProcessDraws.of(sampler)

    def _pass(self) -> Iterator[Iterable[Any]]:
        self._begin_pass()
        private = streams.Private((self.seed + self.epoch) % 2**64)
        parts = _parts(self.sampler, private, self.CHUNK * self.num_replicas)
        yield from _beside(self.one_process, _share(parts, self.rank, self.num_replicas), self.num_replicas)


def _parts(sampler: Any, private: streams.Private, size: int) -> Iterator[list[Any]]:
    """One pass over ``sampler`` in lists of ``size`` items, each drawn under ``private``'s states."""
    iterator = None
    while True:
        with _drawing(sampler, private):
            if iterator is None:  # a sampler's __iter__ may draw its whole order at once, here
                iterator = iter(sampler)
            part = list(itertools.islice(iterator, size))
        if part:
            yield part
        if len(part) < size:
            return


@contextlib.contextmanager
def _drawing(sampler: Any, private: streams.Private) -> Iterator[None]:
    """``private``'s states in place for a part of the draw, the sampler's ``generator`` too."""
    replaced = False
    if hasattr(sampler, "generator"):
        original = sampler.generator
        try:
            sampler.generator = private.generator
            replaced = True
        except (AttributeError, TypeError):
            pass
    try:
        with private.swapped():
            yield
    finally:
        if replaced:
            sampler.generator = original


def _share(parts: Iterator[list[Any]], rank: int, world_size: int) -> Iterator[Any]:
    """Rank ``rank``'s items of the order ``parts`` make: positions rank, rank + W, rank + 2W...

    The order is padded at its end by repeating its start (its first W items are kept for that) to
    a multiple of the world, as DistributedSampler pads.
    """
    start: list[Any] = []
    count = 0
    for part in parts:
        if len(start) < world_size:
            start += part[: world_size - len(start)]
        yield from part[(rank - count) % world_size :: world_size]
        count += len(part)
    if not count:
        return
    total = math.ceil(count / world_size) * world_size
    for position in range(count + (rank - count) % world_size, total, world_size):
        yield start[position % count]
