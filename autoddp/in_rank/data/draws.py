"""The user's random streams around a sharded pass: one process's sampler draws, and workers per rank.

A sharded sampler draws its order from states of its own (``streams.Private``), so that every
rank agrees; one process's sampler draws from the user's streams instead (``RandomSampler``
without a ``generator`` takes a seed from torch's global generator at every pass, one with a
``generator`` advances it by its permutations). ``OneProcessDraws`` makes those same draws on the
user's own streams, in step with the pass, so that whatever the script draws after a pass (a new
model in k-fold, ``torch.rand``, a ``random_split``) is what one process draws. ``RankSeeded``
gives the DataLoader workers of every rank but rank 0 seeds of their own, as each rank's
augmentations must differ.
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    Dataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from autoddp.core import _warn
from autoddp.in_rank.world import streams

#: torch's samplers whose ``__iter__`` only draws and yields (it changes nothing of the sampler),
#: so iterating one a second time on the user's streams makes exactly one process's draws.
_REPLAYABLE = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


class OneProcessDraws:
    """Replays, on the user's own streams, the draws one process's ``sampler`` makes in a pass.

    ``follow(items)`` passes this rank's items through and, as the rank takes its k-th item,
    takes one process's k-th from a pass over ``sampler`` made on the user's streams (its first
    draws as the pass begins, lazy ones as one process's loop reaches them, so a loop left after N
    steps has drawn what one process's N steps draw); when the rank's share ends, the rest of that
    pass is taken too, as one process's loop takes the whole pass. torch's random samplers change
    nothing of themselves in a pass and are passed over again; a sampler of the user's may (a
    bucket list shuffled in place), so each pass is made over a copy of it, which shares only its
    ``generator`` and its data with it: the sampler the order is drawn from stays as it was.
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.replays_itself = type(sampler) in _REPLAYABLE

    @classmethod
    def of(cls, sampler: Any) -> OneProcessDraws | None:
        """The draws of ``sampler``'s passes, or None for one that draws nothing (in order).

        A sampler that cannot be copied is said at once: its passes draw nothing from the user's
        streams here, where one process's would.
        """
        if sampler is None or type(sampler) is SequentialSampler:
            return None
        draws = cls(sampler)
        if not draws.replays_itself:
            try:
                draws._copy()
            except Exception as error:  # deepcopy raises whatever the object's parts raise
                _warn.warn(
                    f"autoddp cannot copy this {type(sampler).__name__} ({type(error).__name__}: "
                    f"{error}) to make the random draws one process's pass over it makes: after a "
                    "pass, torch's, random's and NumPy's streams differ from one process's. Make "
                    "it copyable (copy.deepcopy(sampler) must work: keep the lock or handle out "
                    "of it, or define __deepcopy__), or seed before what you draw after a pass"
                )
                return None
        return draws

    def _all_at_start(self) -> bool:
        """True for torch's samplers that draw a whole pass before its first item: ``RandomSampler``
        without a generator (one seed from torch's, then a generator of its own),
        ``SubsetRandomSampler`` and ``WeightedRandomSampler``."""
        if type(self.sampler) is RandomSampler:
            return self.sampler.generator is None
        return self.replays_itself

    def _seed_only(self) -> bool:
        """True for ``RandomSampler`` without a generator: a pass draws only its seed from the
        user's streams, then permutes on a generator of its own. That seed is drawn without the
        permutation (a list of the whole data set per pass, for nothing), where a real pass showed
        it is all (``_only_a_seed``)."""
        return type(self.sampler) is RandomSampler and self.sampler.generator is None and _only_a_seed()

    def _copy(self) -> Any:
        shared: dict[int, Any] = {}
        generator = getattr(self.sampler, "generator", None)
        if isinstance(generator, torch.Generator):  # the one the order is not drawn from (Private's)
            shared[id(generator)] = generator
        _data_in(self.sampler, shared, depth=3)
        return copy.deepcopy(self.sampler, shared)

    def follow(self, items: Iterator[Any], world_size: int) -> Iterator[Any]:
        """``items`` (this rank's share of ``world_size``) unchanged, with one process's draws made
        on the user's streams beside them. The rest of one process's pass is at most the other
        ranks' shares (a copy that would run on for ever is never waited for)."""
        return itertools.chain.from_iterable(self.parts(items, world_size))

    def parts(self, items: Iterator[Any], world_size: int) -> Iterator[Iterable[Any]]:
        """``follow``'s items in consecutive parts, nothing drawn before the first is asked for.

        Where one process's first item made every draw of its pass (torch's samplers without a
        generator of their own), the rest is ``items`` itself: a chain over the parts hands those
        out at C speed, no Python frame per item (``benchmarks/step_parts.py``).
        """
        if self._seed_only():  # one process's pass draws its seed at its first item, nothing else
            items = iter(items)
            for item in items:
                _draw_seed()
                yield (item,)
                break
            yield items
            return
        shadow, items = iter(self.sampler if self.replays_itself else self._copy()), iter(items)
        if self._all_at_start():  # one process's first item made every draw its pass makes
            for item in items:
                next(shadow, None)
                yield (item,)
                break
            yield items
            return
        yield _in_step(shadow, items, world_size)


def _in_step(shadow: Iterator[Any], items: Iterator[Any], world_size: int) -> Iterator[Any]:
    """``items``, one process's pass ``shadow`` taken in step, then the rest of it."""
    taken = 0
    for item in items:
        next(shadow, None)
        taken += 1
        yield item
    collections.deque(itertools.islice(shadow, taken * (world_size - 1) + world_size), maxlen=0)


def _draw_seed() -> None:
    """What ``RandomSampler`` without a generator draws from torch's global generator per pass."""
    torch.empty((), dtype=torch.int64).random_()


@functools.cache
def _only_a_seed() -> bool:
    """Whether a whole pass of torch's ``RandomSampler`` without a generator moves the user's
    streams (torch's and ``random``'s) exactly as ``_draw_seed`` does: checked once per process on
    a real pass, the streams put back after; a torch release drawing otherwise is replayed whole."""
    held = streams.states()
    try:
        list(RandomSampler(range(3)))
        passed = streams.states()
        streams.set_states(held)
        _draw_seed()
        drawn = streams.states()
        return torch.equal(passed[0], drawn[0]) and passed[1] == drawn[1]
    finally:
        streams.set_states(held)


def _data_in(owner: Any, shared: dict[int, Any], depth: int) -> None:
    """Put the data ``owner`` holds (data sets, tensors, arrays, a few attributes deep) in ``shared``:
    a copy of the sampler refers to them rather than copying them at every pass."""
    numpy = sys.modules.get("numpy")
    data = (Dataset, torch.Tensor, numpy.ndarray) if numpy is not None else (Dataset, torch.Tensor)
    for value in getattr(owner, "__dict__", {}).values():
        if isinstance(value, data):
            shared[id(value)] = value
        elif depth > 1 and hasattr(value, "__dict__") and not isinstance(value, type):
            _data_in(value, shared, depth - 1)


class RankSeeded:
    """A DataLoader ``worker_init_fn`` that gives a rank's workers their own seeds, then calls the user's.

    torch seeds worker ``i`` with ``base_seed + i``, and ``base_seed`` is drawn from the user's
    streams, identical on ranks seeded alike: every rank would augment its samples identically.
    This rank's workers reseed torch, ``random`` and (when loaded) NumPy from that seed and the
    rank, before the user's own ``worker_init_fn`` runs (one reading ``torch.initial_seed()``
    sees the rank's seed). Picklable, for workers in fresh interpreters.
    """

    def __init__(self, user: Callable[[int], Any] | None, rank: int) -> None:
        self.user, self.rank = user, rank

    def __call__(self, worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        seed = streams.derive((info.seed % 2**64).to_bytes(8, "little"), self.rank)
        torch.manual_seed(seed)
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed % 2**32)
        if self.user is not None:
            self.user(worker_id)


def seed_workers_by_rank(loader: torch.utils.data.DataLoader, rank: int) -> None:
    """Give ``loader``'s workers on rank ``rank`` seeds of their own (rank 0 keeps one process's)."""
    if rank == 0 or isinstance(loader.worker_init_fn, RankSeeded):
        return
    loader.worker_init_fn = RankSeeded(loader.worker_init_fn, rank)
