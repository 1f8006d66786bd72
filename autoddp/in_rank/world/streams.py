"""Random streams: every worker draws its own numbers, derived from the caller's state and its rank.

One rule under fork and fresh interpreters alike (forked workers would otherwise all inherit the
caller's state and draw the same noise, dropout masks and augmentations; fresh interpreters
would draw from the operating system's entropy): the caller's torch, Python ``random`` and, when
it is loaded, NumPy states are each digested (without advancing them), and worker ``rank`` seeds
each library with ``sha256(digest, rank)``. Ranks differ, as under torchrun, and a run repeats
exactly when the caller seeded. A seed set inside the function applies as written. The
DataLoader sampler's shared shuffle seed still comes from the caller's seed (see ``data.loaders``);
``Private`` holds the states a sharded sampler draws its order from, apart from the user's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import pickle
import random
import sys
from collections.abc import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class Streams:
    """Digests of the caller's random states, and the seed the caller gave torch."""

    torch_state: bytes
    python_state: bytes
    numpy_state: bytes | None
    torch_initial_seed: int
    #: split_batches: the caller's states themselves (pickled), which rank 0 continues as its own.
    states: bytes | None = None


def of_caller(keep: bool = False) -> Streams:
    """The caller's random states, digested (nothing is drawn from them); ``keep``: the states too,
    for rank 0 to continue them as one process would (``split_batches``)."""
    held = states()
    return _digested(held, pickle.dumps(held, protocol=pickle.HIGHEST_PROTOCOL) if keep else None)


def _digested(held: tuple, kept: bytes | None = None) -> Streams:
    """``Streams`` of states as ``states()`` returns them (digests: nothing is drawn from them)."""
    numpy_state = None
    if held[2] is not None:
        numpy_state = _digest(pickle.dumps(held[2], protocol=pickle.HIGHEST_PROTOCOL))
    return Streams(
        torch_state=_digest(held[0].numpy().tobytes()),
        python_state=_digest(pickle.dumps(held[1], protocol=pickle.HIGHEST_PROTOCOL)),
        numpy_state=numpy_state,
        torch_initial_seed=torch.initial_seed(),
        states=kept,
    )


def seed_apart(held: tuple, rank: int) -> None:
    """Seed torch, ``random`` and NumPy from states ``held`` (as ``states()`` returns them) and
    ``rank``: ranks that held the same states draw apart from here on, repeatably."""
    seed_worker(_digested(held), rank)


def states() -> tuple:
    """torch's, ``random``'s and (if loaded) NumPy's global random states, as one tuple."""
    numpy = sys.modules.get("numpy")
    return torch.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy else None


def set_states(states: tuple) -> None:
    """Put back what ``states`` returned."""
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    numpy = sys.modules.get("numpy")
    if numpy is not None and states[2] is not None:
        numpy.random.set_state(states[2])


def seed_worker(streams: Streams, rank: int) -> int:
    """Seed torch, ``random`` and NumPy for worker ``rank``; returns the torch seed it set.

    With the caller's states kept (``split_batches``), every rank continues them instead: each
    draws what one process would (the model's first weights, data the function makes at random,
    a ``random_split``, the sampler's order), as every rank of a script seeded at its top does.
    """
    seed = derive(streams.torch_state, rank)
    if streams.states is not None:
        set_states(pickle.loads(streams.states))
        return torch.initial_seed()
    torch.manual_seed(seed)
    random.seed(derive(streams.python_state, rank))
    if streams.numpy_state is not None:
        import numpy

        numpy.random.seed(derive(streams.numpy_state, rank) % 2**32)
    return seed


def derive(digest: bytes, rank: int) -> int:
    """Rank ``rank``'s seed from a digest: 63 bits of ``sha256(digest + rank)``."""
    value = hashlib.sha256(digest + rank.to_bytes(8, "little")).digest()
    return int.from_bytes(value[:8], "little") >> 1


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class Private:
    """Random states of a sampler's own, swapped in around each part of its draw.

    A sampler drawn in parts, between the user's steps, must give the same order on every rank
    whatever the user's code draws in between, and the user's code must continue its own streams
    as if nothing had drawn: ``swapped()`` keeps the user's states aside, puts these in, and on
    exit saves these for the next part and puts the user's back. Every generator a sampler may
    draw from is covered, all seeded from one shared seed: torch's global CPU generator, the
    sampler's own ``generator`` attribute (``self.generator``), Python's ``random`` and, once it
    is loaded, NumPy's global state (a bucket sampler's ``random.shuffle`` or ``np.random``).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self._torch = torch.Generator().manual_seed(seed).get_state()
        self._python = random.Random(seed).getstate()
        self._numpy: object | None = None

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Draw from these states inside the block; the user's are back after it."""
        users = states()
        numpy = sys.modules.get("numpy")
        if numpy is not None and self._numpy is None:
            self._numpy = numpy.random.RandomState(self.seed % 2**32).get_state()
        set_states((self._torch, self._python, self._numpy if numpy is not None else None))
        try:
            yield
        finally:
            mine = states()
            self._torch, self._python = mine[0], mine[1]
            if numpy is not None:  # (NumPy loaded inside the block stays the user's)
                self._numpy = mine[2]
            set_states(users)
