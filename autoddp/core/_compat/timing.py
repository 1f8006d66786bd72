"""The private names the step report times a step through (``autoddp.in_rank.step_report``).

The end of a backward pass's own work, before DDP waits there for the other ranks' gradients, is
seen by a callback queued on the autograd engine when the pass begins: the engine runs its final
callbacks in the order they were queued, and DDP queues its wait only once its last bucket is
ready. Each batch a DataLoader hands out comes from its iterator's ``__next__``, defined once on
the iterators' base class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autoddp.core._compat import _need


def backward_callbacks() -> Callable[[Callable[[], None]], None]:
    """The autograd engine's ``queue_callback``: ``queue(callback)`` runs ``callback()`` once the
    running backward pass has computed every gradient, after the callbacks queued before it (a
    callback may queue another). Call it only from inside a pass (one of its hooks)."""
    engine = _need(torch.autograd.Variable, "_execution_engine", "to time the end of a backward pass")
    return _need(engine, "queue_callback", "to time the end of a backward pass")


def loader_iterator_class() -> Any:
    """The base class of every DataLoader iterator, whose ``__next__`` hands out each batch."""
    from torch.utils.data import dataloader

    return _need(dataloader, "_BaseDataLoaderIter", "to time the wait for each batch of a DataLoader")
