"""What the training batches will look like, before one is drawn: for ``strategy="auto"``'s
estimate of a model's activations when its optimizer is made (``models.Example``).

The first shuffled (training) DataLoader made so far, map-style with a batch size, gives its
dataset's first sample, collated as the loader collates; the model's arguments are that batch
(a tensor), or its first item (``(inputs, targets)``), each standing for the loader's batch size
in rows. The sample is read with every random stream kept (torch's, ``random``'s, NumPy's), so the
run draws what it would have drawn; a dataset that cannot give one, or another shape of batch (a
dict, whose keys the model may take in many ways), gives no example: the state alone is weighed
before the first step, as without one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from autoddp.in_rank import models
from autoddp.in_rank.capture._notice import where
from autoddp.in_rank.world import streams


def example(loaders: Iterable[DataLoader], kind: Any) -> models.Example | None:
    """The example of the first loader of ``loaders`` that ``kind`` says is ``"random"``, if any."""
    for loader in loaders:
        if isinstance(loader.dataset, IterableDataset) or kind(loader) != "random":
            continue
        rows = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        if not isinstance(rows, int) or rows < 1:
            return None
        try:
            with _streams_kept():
                batch = loader.collate_fn([loader.dataset[0]])
        except Exception:  # (an empty dataset, keys other than 0, a collate that wants more)
            return None
        args = _arguments(batch)
        if args is None:
            return None
        site = loader.__dict__.get("_autoddp_site")
        return models.Example(args, {}, rows, f"the DataLoader at {where(site)}")
    return None


def _arguments(batch: Any) -> tuple | None:
    """The model's arguments in a collated batch of one sample: the batch, or its first item."""
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    if isinstance(batch, torch.Tensor) and batch.dim() > 0 and batch.shape[0] == 1:
        return (batch,)
    return None


@contextlib.contextmanager
def _streams_kept() -> Iterator[None]:
    held = streams.states()
    try:
        with torch.random.fork_rng(
            devices=list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        ):
            yield
    finally:
        streams.set_states(held)
