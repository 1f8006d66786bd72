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
a run synchronises every forward (nothing is known yet), and a model whose weights change
between the forwards of a window (sharpness-aware minimisation) is never deferred.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from autoddp.core import _compat
from autoddp.core.state import CURRENT


class Window:
    """How many forwards through one model precede each optimizer step (learned from the steps)."""

    __slots__ = ("at_step", "boundary", "candidate", "length", "off", "probe", "version")

    def __init__(self, probe: torch.Tensor | None) -> None:
        """``probe``: a trainable parameter of the model, whose version tells a change of the weights."""
        self.at_step = 0  # the model's forward count at its last step
        self.length = 0  # the window (0: not known yet): the forward that completes it synchronises
        self.candidate = 0  # a new length seen once (taken when the next window has it too)
        self.boundary = 0  # the forward, in this window, that drew a training pass's last batch
        self.off = False  # the weights changed inside a window: no accumulation, nothing deferred
        self.probe = probe
        self.version = 0  # the probe's version at the window's first forward

    def defers(self, forwards: int) -> bool:
        """Whether the forward numbered ``forwards`` (the model's count) leaves its gradients local.

        Nothing is deferred before a step has ended a window (the first window synchronises every
        forward, so that what reads gradients before the first step reads one process's), nor for
        a model whose weights change between the forwards of one window: that is no accumulation
        but code that uses each backward's gradients before the step (sharpness-aware minimisation,
        extragradient), which must see them averaged.
        """
        number = forwards - self.at_step
        if self.probe is not None:
            version = _compat.version(self.probe)
            if number == 1:
                self.version = version
            elif version != self.version:
                self.off = True
        if number == self.length:
            return False
        if last_batch():
            self.boundary = number  # (a window the pass's end closes early: no change of window)
            return False
        return self.length > 0 and not self.off

    def stepped(self, forwards: int) -> None:
        """An optimizer guarding the model steps: the window that ends here teaches the next one."""
        seen = forwards - self.at_step
        if seen == 0:
            return  # a second optimizer of the same model, or a step without a forward
        self.at_step = forwards
        boundary, self.boundary = self.boundary, 0
        if seen == self.length or (seen == boundary and self.length):
            self.candidate = 0
        elif not self.length or seen == self.candidate:
            self.length, self.candidate = seen, 0
        else:
            self.candidate = seen
        if self.length > 1 and not self.off:
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
