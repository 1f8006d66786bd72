"""Optimizers over sharded (FSDP) parameters: their state saved full, loaded back into the shards.

``state_dict`` gives an optimizer's state as a single process would have it (integer keys in
parameter order, full tensors), also when its parameters are sharded: a plain optimizer loads it.
``bind`` gives an optimizer over sharded parameters a load pre-hook (torch's public
``register_load_state_dict_pre_hook``) that cuts such full tensors to this rank's shards, and
passes parts of a sharded checkpoint to torch's distributed checkpoint.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch

from autoddp.core import _compat, _containers
from autoddp.core.state import CURRENT

_BOUND = "_autoddp_bound"
_LOADING = threading.local()


def _is_dtensor(value: Any) -> bool:
    tensors = sys.modules.get(_compat.DTENSOR_MODULE)  # nothing is a DTensor before it loads
    return tensors is not None and isinstance(value, tensors.DTensor)


def parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def full_tensors(obj: Any, to_host: bool = True) -> Any:
    """``obj`` with every DTensor in it gathered into a plain CPU tensor (every rank calls it).

    ``to_host=False``: gathered only for the collective's sake, left on the device (a rank whose
    copy nobody reads).
    """
    if _is_dtensor(obj):
        full = obj.full_tensor()
        return full.cpu() if to_host else full
    if isinstance(obj, torch.Tensor):
        return obj
    return _containers.map_items(obj, lambda item: full_tensors(item, to_host))


def optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state as one process would hold it (full tensors); a collective when sharded."""
    return full_tensors(optimizer.state_dict())


def sharded_model_of(optimizer: torch.optim.Optimizer) -> torch.nn.Module | None:
    """The sharded model whose parameters ``optimizer`` trains, among those wrapped in this run."""
    params = {id(p) for p in parameters(optimizer)}
    for model in CURRENT.wrapped_models():
        if any(id(p) in params for p in model.parameters()):
            return model
    return None


def bind_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Have ``optimizer`` load full (and sharded-checkpoint) state into its shards, and reshard
    before each step a root a forward left unsharded (``_Resharding``) (idempotent; an optimizer
    over parameters that are not sharded is left as it is)."""
    if getattr(optimizer, _BOUND, False) or not any(_is_dtensor(p) for p in parameters(optimizer)):
        return optimizer
    optimizer.register_load_state_dict_pre_hook(_into_shards)
    model = sharded_model_of(optimizer)
    places = list(own_places(model)) if model is not None else []
    if places:
        optimizer.register_step_pre_hook(_Resharding(model, places[0]))
    setattr(optimizer, _BOUND, True)
    return optimizer


class _Resharding:
    """An optimizer's step pre-hook: the sharded model's root resharded where a forward with
    gradients that no backward followed left it unsharded. FSDP2 keeps the root's parameters
    gathered from its forward to its backward; without the backward they stay gathered, the step
    changes the shards, and the next forward, finding them gathered, would compute with the weights
    from before the step (FSDP2's ``reshard()`` registers the shards again: the next forward
    gathers the stepped ones)."""

    def __init__(self, model: torch.nn.Module, place: tuple[torch.nn.Module, str]) -> None:
        self.model = weakref.ref(model)
        self.owner, self.name = weakref.ref(place[0]), place[1]

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        owner, model = self.owner(), self.model()
        if owner is not None and model is not None and not _is_dtensor(getattr(owner, self.name, None)):
            model.reshard()


def own_places(unit: torch.nn.Module) -> Any:
    """(owner, name) of each parameter ``unit``'s own ``fully_shard`` manages (those of its
    submodules that are no FSDP2 module themselves), each once, frozen ones too."""
    from torch.distributed.fsdp import FSDPModule  # (only sharded models come here: FSDP2 is there)

    seen: set[int] = set()

    def walk(module: torch.nn.Module) -> Any:
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield module, name
        for child in module.children():
            if not isinstance(child, FSDPModule):  # (one is a unit of its own)
                yield from walk(child)

    return walk(unit)


def _into_shards(optimizer: torch.optim.Optimizer, state: Any) -> Any:
    if getattr(_LOADING, "active", False):
        return None
    loader = getattr(state, "load_into_optimizer", None)
    if loader is not None:  # a part of a sharded checkpoint
        _LOADING.active = True
        try:
            loader(optimizer, sharded_model_of(optimizer))
        finally:
            _LOADING.active = False
        return optimizer.state_dict()
    params = parameters(optimizer)
    cut: dict[Any, Any] = {}
    for key, values in state.get("state", {}).items():
        param = params[key] if isinstance(key, int) and key < len(params) else None
        if param is None or not _is_dtensor(param):
            cut[key] = values
            continue
        cut[key] = {
            name: shard_of(v, param)
            if isinstance(v, torch.Tensor) and not _is_dtensor(v) and v.shape == param.shape
            else v
            for name, v in values.items()
        }
    return {**state, "state": cut}


def shard_of(full: torch.Tensor, param: Any) -> Any:
    """This rank's part of ``full``, laid out as the sharded ``param``; only that part goes to the device.

    FSDP2 shards dim 0 in ``torch.chunk``'s pieces (``Shard(0)`` on a one-dimensional mesh): the
    piece is cut where ``full`` lies (a memory-mapped checkpoint is read for it alone) and moved,
    so the device never holds the full tensor. Other layouts go through ``distribute_tensor``.
    """
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1 or placements != (Shard(0),):
        return distribute_tensor(full.to(param.device), mesh, placements, src_data_rank=None)
    pieces = torch.chunk(full, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    piece = pieces[rank] if rank < len(pieces) else full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(
        piece.to(param.device), mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )
