"""``prepare``: make one object ready for the current world (models, loaders, containers).

A single-dispatch function, so other libraries can teach it their own types with
``@autoddp.prepare.register(TheirType)``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.data import DataLoader

from autoddp import _containers
from autoddp.state import CURRENT
from autoddp.world import current


@functools.singledispatch
def prepare(obj: Any) -> Any:
    """Return ``obj`` ready for this process: models moved to its device and wrapped in DDP,
    DataLoaders sharded with a DistributedSampler, tuples, lists, dicts and dataclasses walked
    recursively.

    Anything else comes back unchanged. Outside a distributed run (one process) models are only
    moved to the device and loaders are left as they are. Register handlers for other types
    with ``@autoddp.prepare.register(TheirType)``.
    """
    return _containers.map_items(obj, prepare)


@prepare.register
def _prepare_module(obj: torch.nn.Module) -> torch.nn.Module:
    from autoddp import models

    return models.wrap(obj, current(), CURRENT.options)


@prepare.register
def _prepare_optimizer(obj: torch.optim.Optimizer) -> torch.optim.Optimizer:
    from autoddp import models

    return models.bind_optimizer(obj)  # over sharded parameters: loads full state into the shards


@prepare.register
def _prepare_loader(obj: DataLoader) -> DataLoader:
    from autoddp.data.loaders import shard_loader

    return shard_loader(obj, current())
