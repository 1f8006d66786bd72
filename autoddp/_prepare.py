"""``prepare``: make one object ready for the current world (models, loaders, containers).

A single-dispatch function, so other libraries can teach it their own types with
``@autoddp.prepare.register(TheirType)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch.utils.data import DataLoader

from autoddp import _containers
from autoddp.errors import ConfigurationError
from autoddp.state import CURRENT
from autoddp.world import current


def prepare(obj: Any, *, split_batches: bool | None = None) -> Any:
    """Return ``obj`` ready for this process: models moved to its device and wrapped in DDP,
    DataLoaders sharded with a DistributedSampler, tuples, lists, dicts and dataclasses walked
    recursively.

    Anything else comes back unchanged. Outside a distributed run (one process) models are only
    moved to the device and loaders are left as they are. Register handlers for other types
    with ``@autoddp.prepare.register(TheirType)``. ``split_batches=True`` (default: the run's
    option): a shuffled loader's batches stay one process's, each process taking its part, and
    models use the global batch's BatchNorm statistics; pass the model and the loader together,
    ``autoddp.prepare((model, loader), split_batches=True)``.
    """
    if split_batches is None:
        return _prepare(obj)
    if not isinstance(split_batches, bool):
        raise ConfigurationError(f"split_batches={split_batches!r} must be True or False")
    previous = CURRENT.options
    if split_batches and previous.strategy != "ddp":
        raise ConfigurationError(
            f"split_batches=True works with strategy='ddp' only (not {previous.strategy!r}) so far: "
            "use strategy='ddp', or leave split_batches off"
        )
    CURRENT.options = dataclasses.replace(previous, split_batches=split_batches)
    try:
        return _prepare(obj)
    finally:
        CURRENT.options = previous


@functools.singledispatch
def _prepare(obj: Any) -> Any:
    return _containers.map_items(obj, _prepare)


prepare.register = _prepare.register  # type: ignore[attr-defined]
prepare.registry = _prepare.registry  # type: ignore[attr-defined]
prepare.dispatch = _prepare.dispatch  # type: ignore[attr-defined]


@_prepare.register
def _prepare_module(obj: torch.nn.Module) -> torch.nn.Module:
    from autoddp import models

    return models.wrap(obj, current(), CURRENT.options)


@_prepare.register
def _prepare_optimizer(obj: torch.optim.Optimizer) -> torch.optim.Optimizer:
    from autoddp import models

    return models.bind_optimizer(obj)  # over sharded parameters: loads full state into the shards


@_prepare.register
def _prepare_loader(obj: DataLoader) -> DataLoader:
    from autoddp.data.loaders import shard_loader

    return shard_loader(obj, current())
