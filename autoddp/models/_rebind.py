"""Optimizers made before a strategy replaced their model's parameters, bound to the new ones.

Sharding (FSDP2's ``fully_shard``) puts new parameter objects in the module. An optimizer made
before that still holds the old tensors: its steps would update tensors no forward reads, and
training would silently do nothing. After a wrap that replaced parameters, every optimizer that
holds an old one takes the new ones in its groups: those the garbage collector lists (every one
made in this process since it started or forked: a worker freezes what it inherited), those the
caller knows (the optimizers a decorated call reaches) and those the user's frames reach (their
locals and globals, a few attributes deep). State an optimizer already has (momentum after some
steps) is carried over as one process holds it, cut to this rank's shards by the optimizer's
load (``_fsdp_state.bind``).
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from autoddp import _containers, _frames
from autoddp.errors import ConfigurationError
from autoddp.models import _fsdp_state


def replaced(before: list[tuple[str, torch.Tensor]], module: torch.nn.Module) -> dict[int, torch.Tensor]:
    """id(old parameter) -> its replacement in ``module``, for each of ``before`` (its named
    parameters before the wrap) that the wrap replaced."""
    after = dict(module.named_parameters())
    mapping: dict[int, torch.Tensor] = {}
    for name, old in before:
        new = after.get(name)
        if new is not None and new is not old:
            mapping[id(old)] = new
    return mapping


def rebind_optimizers(
    mapping: dict[int, torch.Tensor], model: torch.nn.Module, known: Iterable[torch.optim.Optimizer] = ()
) -> None:
    """Every optimizer over a parameter in ``mapping`` (its old ones' ids: they are alive while
    the caller holds them) that can be found trains the new ones instead (module docstring)."""
    if not mapping:
        return
    done: set[int] = set()
    for found in _candidates(known):
        if id(found) in done:
            continue
        done.add(id(found))
        groups = found.__dict__.get("param_groups")  # (None while an optimizer is being made)
        if isinstance(groups, list) and any(id(p) in mapping for g in groups for p in g["params"]):
            _rebind(found, mapping, model)


def _candidates(known: Iterable[torch.optim.Optimizer]) -> Iterator[Any]:
    yield from known
    yield from (found for found in gc.get_objects() if isinstance(found, torch.optim.Optimizer))
    namespaces: list[Any] = []
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if _frames.is_user(frame.f_code.co_filename):
            namespaces += [frame.f_locals, frame.f_globals]
        frame = frame.f_back
    skip = (type, types.ModuleType, types.FunctionType, torch.Tensor, torch.nn.Module)
    yield from _containers.reachable(namespaces, (torch.optim.Optimizer,), skip=skip)


def _rebind(
    optimizer: torch.optim.Optimizer, mapping: dict[int, torch.Tensor], model: torch.nn.Module
) -> None:
    stateful = any(id(p) in mapping and state for p, state in optimizer.state.items())
    full = optimizer.state_dict() if stateful else None  # (plain tensors: the unsharded model's)
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]
    for old in [p for p in optimizer.state if id(p) in mapping]:
        optimizer.state.pop(old)
    _fsdp_state.bind(optimizer)
    if full is None:
        return
    try:
        optimizer.load_state_dict(full)  # (cut to this rank's shards by the bound load)
    except Exception as error:
        raise ConfigurationError(
            f"{type(model).__name__} was sharded after its {type(optimizer).__name__} had taken steps, "
            f"and autoddp could not carry the optimizer's state into the shards ({error}). Make the "
            "optimizer after autoddp.prepare(model) (or let autoddp find the model through it: make "
            "the optimizer first, inside the decorated function, without calling prepare)"
        ) from error
