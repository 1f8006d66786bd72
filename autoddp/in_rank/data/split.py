"""``split_batches``: the script's batch is the global batch, and each rank takes its part of it.

``split_loader`` keeps the loader's own batch sampler (the one one process iterates: its
sampler, its ``batch_size``, its ``drop_last``) and puts a ``SplitBatches`` around it, which
hands rank r the r-th contiguous, near-equal part of every batch. The order is the single
process's: at the start of each pass rank 0 draws it from its own random states, those the
user's code set up (``torch.manual_seed`` at the top; in a decorated function, rank 0 continues
the caller's states), and every other rank draws from a copy of rank 0's states, so all agree
whatever their own streams hold; then rank 0 goes on with one process's streams and every other
rank with its own (dropout stays per rank, see ``_drawing``). A rank whose part is empty (a last
batch smaller than the world) gets the batch's first sample with a weight of 0: every rank
takes part in every step, so nothing waits, and that sample counts for nothing.

The loader's class is swapped for a cached subclass (same name) whose iterator records, as each
batch reaches the user's code, this rank's weight ``W * part / batch`` in ``CURRENT.split_weight``:
the models weigh their gradients by it (``autoddp.in_rank.models._split``), so that DDP's average is the
global batch's mean when the parts differ in size.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from autoddp.core import _class_swap, _compat
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import CURRENT, World
from autoddp.in_rank.data import draws
from autoddp.in_rank.world import streams
from autoddp.in_rank.world.process_group import comm_device

#: Batches drawn at once at the start of a pass (on rank 0 from the user's states, as one process).
CHUNK = 4096


def part_bounds(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank ``rank``'s part of a batch of ``total``: contiguous, near-equal, the
    first ``total % world_size`` ranks one more."""
    size, extra = divmod(total, world_size)
    start = rank * size + min(rank, extra)
    return start, start + size + (1 if rank < extra else 0)


class SplitBatches:
    """A batch sampler yielding this rank's part of each batch of ``batches`` (one process's)."""

    def __init__(self, batches: Any, world: World) -> None:
        self.batches = batches
        self.rank, self.world_size = world.rank, world.world_size
        #: This rank's weight for each batch of the pass under way, in the order they were drawn.
        self.weights: list[float] = []

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batches, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        return bool(getattr(self.batches, "drop_last", False))

    @property
    def sampler(self) -> Any:
        return getattr(self.batches, "sampler", None)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[Any]]:
        self.weights = []
        private: tuple | None = None
        iterator = None
        first = True
        while True:
            with _drawing(self.rank, first, private) as states:
                if iterator is None:
                    iterator = iter(self.batches)
                chunk = list(itertools.islice(iterator, CHUNK))
            private, first = states[0], False
            for batch in chunk:
                yield self._part(batch)
            if len(chunk) < CHUNK:
                return

    def _part(self, batch: Any) -> list[Any]:
        try:
            items = list(batch)
        except TypeError:
            raise ConfigurationError(
                f"split_batches cannot split this batch sampler's batches: it yields "
                f"{type(batch).__name__} objects, not lists of indices. Give the DataLoader a batch "
                "sampler that yields lists of dataset indices, or leave split_batches off"
            ) from None
        start, stop = part_bounds(len(items), self.rank, self.world_size)
        if start == stop:  # a batch smaller than the world: take part, weighing nothing
            self.weights.append(0.0)
            return items[:1]
        self.weights.append(self.world_size * (stop - start) / len(items))
        return items[start:stop]


@contextlib.contextmanager
def _drawing(rank: int, first: bool, private: tuple | None) -> Iterator[list[Any]]:
    """The random states a part of the draw runs under; yields a list that holds, after the block,
    the states to continue from.

    The first part of a pass: rank 0 draws from its own states, as one process would, and keeps
    the advanced states (one process's); the others draw from a copy of them, then go on with
    streams seeded from their own states and their rank (``streams.seed_apart``): ranks seeded
    alike (a script's ``torch.manual_seed(0)``) still draw their own dropout and augmentation.
    Later parts: every rank, rank 0 too, draws from the states the first part left, swapped in,
    so that all agree whatever the user's code draws between batches.
    """
    found: list[Any] = [None]
    own = streams.states()
    if first:
        streams.set_states(_broadcast(own if rank == 0 else None))
        try:
            yield found
        finally:
            found[0] = streams.states()
            if rank != 0:
                streams.seed_apart(own, rank)
        return
    assert private is not None
    streams.set_states(private)
    try:
        yield found
    finally:
        found[0] = streams.states()
        streams.set_states(own)


def _broadcast(states: tuple | None) -> tuple:
    """Rank 0's random states on every rank (one small broadcast per pass)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        assert states is not None
        return states
    box = [states]
    dist.broadcast_object_list(box, src=0, device=comm_device(torch.device("cpu")))
    return box[0]


def split_loader(loader: DataLoader, world: World) -> DataLoader:
    """``loader`` giving this rank its part of each of one process's batches (in place)."""
    batches = loader.batch_sampler
    if batches is None:
        raise ConfigurationError(
            "split_batches cannot split this DataLoader: it was made with batch_size=None and no "
            "batch_sampler, so it yields single samples, not batches. Give it a batch_size (or a "
            "batch_sampler), or leave split_batches off"
        )
    if isinstance(batches, SplitBatches):
        return loader
    if loader.batch_size is not None and type(batches) is not BatchSampler:
        raise ConfigurationError(
            f"split_batches cannot split this {type(loader).__name__}: its class wraps DataLoader's "
            f"batch sampler ({type(batches).__name__}), and the batches it makes from it are not "
            "known. Use a plain DataLoader for training, or leave split_batches off"
        )
    size = getattr(batches, "batch_size", None)
    if isinstance(size, int) and size < world.world_size:
        raise ConfigurationError(
            f"split_batches: batch_size={size} split over {world.world_size} processes leaves "
            f"{world.world_size - size} of them without a sample in every step. Use a batch_size of "
            f"at least {world.world_size} (it is the global batch), or fewer processes (-n {size})"
        )
    split = SplitBatches(batches, world)
    draws.seed_workers_by_rank(loader, world.rank)
    object.__setattr__(loader, "batch_sampler", split)
    persistent = _compat.loader_iterator(loader)
    if persistent is not None:  # persistent workers already started: their iterator takes it too
        _compat.set_iterator_order(persistent, split)
    if _class_swap.PLAIN_CLASS not in type(loader).__dict__:
        cls = type(loader)
        extra = {"__iter__": _iter, "__reduce_ex__": _class_swap.plain_reduce, _class_swap.PLAIN_CLASS: cls}
        loader.__class__ = _class_swap.cached_subclass(cls, extra)
    return loader


def is_split(loader: DataLoader) -> bool:
    """True for a loader ``split_loader`` gave its parts of one process's batches."""
    return type(loader).__dict__.get("__iter__") is _iter


def _iter(self: DataLoader) -> Any:
    plain = getattr(type(self), _class_swap.PLAIN_CLASS)
    return weighed(self, plain.__iter__(self))  # (through capture's hook, when capture is on)


def weighed(self: DataLoader, iterator: Any) -> Any:
    """``iterator`` over split ``self``, setting each batch's weight as it reaches the user."""
    batches = self.batch_sampler
    if not isinstance(batches, SplitBatches):  # an evaluation pass that got all of it (capture)
        CURRENT.split_weight = None
        return iterator
    return _Weighed(iterator, batches)


#: id() of the iterator whose batch ``CURRENT.split_weight`` is (its weight goes with it).
_OWNER: list[int | None] = [None]


class _Weighed:
    """A loader's iterator that records this rank's weight of each batch as it hands it out.

    The weight stays until the pass ends or its iterator goes (a loop left with ``break``), so a
    forward after it (an evaluation, another loader's batch) is not weighed.
    """

    def __init__(self, iterator: Any, batches: SplitBatches) -> None:
        self._inner, self._batches, self._handed = iterator, batches, 0

    def __iter__(self) -> _Weighed:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._inner)
        except StopIteration:
            CURRENT.split_weight, _OWNER[0] = None, None
            raise
        CURRENT.split_weight = self._batches.weights[self._handed]
        _OWNER[0] = id(self)
        self._handed += 1
        return batch

    def __del__(self) -> None:
        if _OWNER[0] == id(self):
            CURRENT.split_weight, _OWNER[0] = None, None

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
