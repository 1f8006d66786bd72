"""``prepare``: make one object ready for the current world (models, loaders, containers).

A single-dispatch function, so other libraries can teach it their own types with
``@autoddp.prepare.register(TheirType)``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.data import DataLoader

from autoddp.state import CURRENT
from autoddp.world import current


@functools.singledispatch
def prepare(obj: Any) -> Any:
    """Return ``obj`` ready for this process: models moved to its device and wrapped in DDP,
    DataLoaders sharded with a DistributedSampler, tuples, lists and dicts walked recursively.

    Anything else comes back unchanged. Outside a distributed run (one process) models are only
    moved to the device and loaders are left as they are. Register handlers for other types
    with ``@autoddp.prepare.register(TheirType)``.
    """
    return obj


@prepare.register
def _prepare_module(obj: torch.nn.Module) -> torch.nn.Module:
    from autoddp.model import wrap_model

    options = CURRENT.options
    return wrap_model(obj, current(), ddp_kwargs=options.ddp_kwargs, sync_batchnorm=options.sync_batchnorm)


@prepare.register
def _prepare_loader(obj: DataLoader) -> DataLoader:
    from autoddp.data import shard_loader

    return shard_loader(obj, current())


@prepare.register(list)
def _prepare_list(obj: list) -> list:
    items = [prepare(item) for item in obj]
    if all(new is old for new, old in zip(items, obj, strict=True)):
        return obj
    return items if type(obj) is list else type(obj)(items)


@prepare.register(tuple)
def _prepare_tuple(obj: tuple) -> tuple:
    items = [prepare(item) for item in obj]
    if all(new is old for new, old in zip(items, obj, strict=True)):
        return obj
    return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)


@prepare.register(dict)
def _prepare_dict(obj: dict) -> dict:
    items = {key: prepare(value) for key, value in obj.items()}
    if all(items[key] is value for key, value in obj.items()):
        return obj
    return items if type(obj) is dict else type(obj)(items)
