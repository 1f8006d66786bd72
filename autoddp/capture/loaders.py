"""Loaders sharded when iterated: a random loader gets its share per rank, an ordered one stays whole.

A DataLoader whose order is random (``shuffle=True``, any sampler but the sequential one, a custom
batch sampler) is sharded on its first iteration exactly as ``autoddp.prepare`` shards it. A
sequential loader (``shuffle=False``: the usual evaluation loader) is left whole, so metrics
computed by plain code equal the single-process ones (every rank evaluates everything). So is
every pass of a random loader that begins in an evaluation context (gradients off, or every
captured model in ``eval()`` mode): a shuffled validation loader counts every sample once on every
rank, as in one process. A DataLoader subclass that wraps DataLoader's own BatchSampler to keep
its workers across epochs (timm's MultiEpochsDataLoader) is judged by the order inside the
wrapper, and keeps its wrapper.
"""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from autoddp import _compat
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


def evaluating(models: list[torch.nn.Module]) -> bool:
    """True when a pass beginning now is evaluation: gradients off, or every captured model in eval().

    ``models``: the models distributed in this world (with none yet, only the gradient mode counts).
    """
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return True
    return bool(models) and not any(model.training for model in models)


class Shares:
    """A random loader's two orders: all of it (evaluation passes) and this rank's share (training).

    Kept in the loader's ``__dict__`` once capture sharded it; ``use`` puts the order a pass needs
    in place before the pass begins (DataLoader reads its samplers when an iterator is made, so an
    iterator already running keeps its own). A loader whose persistent workers already hold an
    iterator keeps the order it has.
    """

    KEY = "_autoddp_shares"

    def __init__(self, whole: tuple, shard: tuple) -> None:
        self.whole, self.shard = whole, shard
        self.in_use = "shard"

    def use(self, loader: DataLoader, which: str) -> None:
        if which == self.in_use or _compat.loader_iterator(loader) is not None:
            return
        sampler, batch_sampler = self.whole if which == "whole" else self.shard
        # DataLoader.__setattr__ refuses these names after __init__; no iterator holds them yet.
        object.__setattr__(loader, "sampler", sampler)
        object.__setattr__(loader, "batch_sampler", batch_sampler)
        self.in_use = which

    def length(self, which: str) -> int:
        """``len(loader)`` with the order ``which`` in place (without putting it there)."""
        sampler, batch_sampler = self.whole if which == "whole" else self.shard
        return len(batch_sampler if batch_sampler is not None else sampler)
