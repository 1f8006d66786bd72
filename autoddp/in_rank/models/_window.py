"""Gradient accumulation: one gradient synchronisation per optimizer step, for unchanged code.

A script that accumulates (``(loss / K).backward()`` on K micro-batches, then ``opt.step()``)
would have DDP all-reduce at every ``backward()``. Averaging is linear, so only the last
backward before a step needs to synchronise: DDP's ``no_sync`` for the others (set for the
forward, where DDP decides) leaves their gradients summed locally, and the last one averages the
sum. The window (how many forwards through the model come before each step of an optimizer
guarding it) is learned from the steps: the forward that completes the window synchronises, and
so does one that draws the last batch of a training pass (an epoch's last, shorter window).

A guess can be wrong (the window changed, a step came early), never the result: a step that
finds gradients no synchronisation averaged averages them then (``_averaging``), and so does
anything that reads gradients before the step (``clip_grad_norm_``, ``GradScaler.unscale_``:
capture's ``steps``). A window of 1 (no accumulation) synchronises every forward, as before.
A length becomes the window the first time a step ends one, later only when two windows in a
row have it: an epoch's last, shorter window leaves the window as it is. The first window of
a run synchronises its first forward (the window is still 1) and averages the rest at the step.
"""

from __future__ import annotations

import weakref
from typing import Any

from autoddp.core import _compat
from autoddp.core.state import CURRENT


class Window:
    """How many forwards through one model precede each optimizer step (learned from the steps)."""

    __slots__ = ("at_step", "candidate", "length", "settled")

    def __init__(self) -> None:
        self.at_step = 0  # the model's forward count at its last step
        self.length = 1  # the window: the forward that completes it synchronises
        self.settled = False  # whether a step has ended a window yet
        self.candidate = 0  # a new length seen once (taken when the next window has it too)

    def defers(self, forwards: int) -> bool:
        """Whether the forward numbered ``forwards`` (the model's count) leaves its gradients local."""
        return forwards - self.at_step != self.length and not last_batch()

    def stepped(self, forwards: int) -> None:
        """An optimizer guarding the model steps: the window that ends here teaches the next one."""
        seen = forwards - self.at_step
        if seen == 0:
            return  # a second optimizer of the same model, or a step without a forward
        self.at_step = forwards
        if seen == self.length:
            self.candidate = 0
        elif not self.settled or seen == self.candidate:
            self.length, self.candidate = seen, 0
        else:
            self.candidate = seen
        self.settled = True
        if self.length > 1:
            CURRENT.accumulating = self.length  # (capture's notice says it once)


def training_pass(iterator: Any) -> None:
    """A training pass of a DataLoader begins: its last batch ends a window (``last_batch``).

    ``iterator`` None: a pass whose length cannot be trusted alike on every rank (no last batch).
    """
    try:
        CURRENT.training_pass = None if iterator is None else (weakref.ref(iterator), len(iterator))
    except TypeError:  # a sampler without a length (an endless one)
        CURRENT.training_pass = None


def last_batch() -> bool:
    """Whether the batch drawn last is the last of the training pass under way."""
    current = CURRENT.training_pass
    if current is None:
        return False
    iterator = current[0]()
    return iterator is not None and _compat.batches_drawn(iterator) >= current[1]
