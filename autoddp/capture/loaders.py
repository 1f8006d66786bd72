"""Loaders sharded when iterated: a random loader gets its share per rank, an ordered one stays whole.

A DataLoader whose order is random (``shuffle=True``, any sampler but the sequential one, a custom
batch sampler) is sharded on its first iteration exactly as ``autoddp.prepare`` shards it. A
sequential loader (``shuffle=False``: the usual evaluation loader) is left whole, so metrics
computed by plain code equal the single-process ones (every rank evaluates everything). A
DataLoader subclass that wraps DataLoader's own BatchSampler to keep its workers across epochs
(timm's MultiEpochsDataLoader) is judged by the order inside the wrapper, and keeps its wrapper.
"""

from __future__ import annotations

from types import FrameType

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from autoddp import _warn
from autoddp.capture._registry import Site, user_site
from autoddp.data import distributed_sampler, wrapped_batches


def kind(loader: DataLoader) -> str:
    """``"random"`` (shard it), ``"ordered"``, ``"iterable"`` or ``"distributed"`` (leave it whole)."""
    if isinstance(loader.dataset, IterableDataset):
        return "iterable"
    if distributed_sampler(loader) is not None:
        return "distributed"
    batch_sampler = loader.batch_sampler
    wrapped = wrapped_batches(loader)  # a subclass's wrapper around DataLoader's own BatchSampler
    if wrapped is not None:
        return "ordered" if type(wrapped.sampler) is SequentialSampler else "random"
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return "random"  # a custom batch sampler: shared out by whole batches
    sampler = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    return "ordered" if type(sampler) is SequentialSampler else "random"


REASONS = {
    "ordered": "in order (shuffle=False, e.g. evaluation): every rank sees all of it",
    "iterable": "an IterableDataset takes no sampler: shard inside its __iter__ with autoddp.rank()",
    "distributed": "it already has a DistributedSampler",
}


def creation_site(loader: DataLoader, frame: FrameType | None) -> Site:
    """The user's line that made ``loader``: the first frame beyond autoddp, torch and the
    ``__init__`` of the loader's own class (a subclass's ``super().__init__(...)`` is not it)."""
    while frame is not None and (
        _warn.is_library(frame.f_code.co_filename)
        or (frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is loader)
    ):
        frame = frame.f_back
    return user_site(frame)
