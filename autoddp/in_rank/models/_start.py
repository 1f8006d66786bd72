"""A sharded model's first weights: rank 0's, whether it was built for real or on the meta device.

DDP broadcasts rank 0's parameters when it wraps a model; FSDP2's ``fully_shard`` does not, so
ranks seeded differently would start from different weights. ``rank0_state`` takes rank 0's full
state before sharding and ``start`` sends it out after: torch's ``set_model_state_dict`` with
``broadcast_from_rank0=True`` broadcasts one tensor at a time and keeps only this rank's slice, so
no rank's device holds more than its shards plus one full tensor.

A model built on the meta device (``with torch.device("meta"): model = Net()``) holds no memory.
It is sharded as it is, ``to_empty`` gives every rank room for its shards only, and rank 0 makes
the weights one process would have made: a copy built on the CPU (host memory) whose modules
each run their ``reset_parameters()``, children before their parent (the order constructors
run them: ``MultiheadAttention`` resets itself after building ``out_proj``), so the same seed
gives the same weights as ``Net()`` in one process. A model built on rank 0
alone (``with torch.device("cpu" if autoddp.rank() == 0 else "meta")``) sends rank 0's weights.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Any

import torch

from autoddp.core import _compat
from autoddp.core.errors import ConfigurationError


def outside_meta() -> contextlib.AbstractContextManager[Any]:
    """Tensors made without a device are real again, where the user's ``with torch.device("meta")``
    (an optimizer made inside it, say) would make the sharding's own bookkeeping tensors meta."""
    return torch.device("cpu") if torch.get_default_device().type == "meta" else contextlib.nullcontext()


def is_meta(module: torch.nn.Module) -> bool:
    """True for a module built on the meta device (any parameter or buffer without storage)."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _own_tensors(module: torch.nn.Module) -> bool:
    return any(True for _ in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)))


def _reset(module: torch.nn.Module) -> Any:
    """The module's own initialiser: ``reset_parameters`` (``_reset_parameters`` in torch's attention)."""
    return _compat.initialiser(module)


def check_initialisable(module: torch.nn.Module) -> None:
    """ConfigurationError naming every module whose meta-built tensors nothing could fill."""
    missing = sorted(
        {type(m).__name__ for m in module.modules() if _own_tensors(m) and not callable(_reset(m))}
    )
    if missing:
        raise ConfigurationError(
            f"{type(module).__name__} was built on the meta device, but {', '.join(missing)} "
            "has no reset_parameters() to make its weights after autoddp gives them memory. Define "
            "reset_parameters() (initialise this module's own parameters and buffers, as __init__ "
            "does), or build the model on a real device (it is sharded after it is built)"
        )


def initialise_on_cpu(module: torch.nn.Module) -> torch.nn.Module:
    """Give a meta-built ``module`` real CPU tensors and the weights its constructors make (in place)."""
    check_initialisable(module)
    module.to_empty(device="cpu")
    with torch.no_grad():
        for sub in _children_first(module):
            if _own_tensors(sub):
                _reset(sub)()
    return module


def _children_first(module: torch.nn.Module, seen: set[int] | None = None) -> list[torch.nn.Module]:
    """Every submodule once, each after its children (a module's constructor builds them first)."""
    seen = set() if seen is None else seen
    order: list[torch.nn.Module] = []
    if id(module) in seen:
        return order
    seen.add(id(module))
    for child in module.children():
        order.extend(_children_first(child, seen))
    order.append(module)
    return order


def rank0_state(module: torch.nn.Module, rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Rank 0's full state dict and its non-persistent buffers, taken before sharding (empty elsewhere).

    For a real model these are the module's own tensors (no copy); for a meta-built one, those of a
    copy built on rank 0's CPU (``initialise_on_cpu``).
    """
    if rank != 0:
        return {}, {}
    source = initialise_on_cpu(copy.deepcopy(module)) if is_meta(module) else module
    state = source.state_dict()
    loose = {name: b for name, b in source.named_buffers() if name not in state}
    return state, loose


def start(
    module: torch.nn.Module,
    state: dict[str, Any],
    loose: dict[str, torch.Tensor],
    shards_on: torch.device | str | None = None,
    buffers_on: torch.device | str | None = None,
) -> None:
    """Fill a sharded ``module`` from rank 0's ``state`` (every rank calls it; a collective).

    A meta-built module first gets memory for its shards on ``shards_on`` (the CPU with CPU
    offload, where FSDP2 wants them) and its buffers on ``buffers_on`` (the computing device).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if shards_on is not None:
        module.to_empty(device=shards_on)
        for sub in module.modules():
            for name, buffer in list(sub.named_buffers(recurse=False)):
                if buffers_on is not None and buffer.device != torch.device(buffers_on):
                    setattr(sub, name, buffer.to(buffers_on))  # (assigning a buffer keeps it one)
    set_model_state_dict(
        module, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    )
    saved = set(module.state_dict())  # (FSDP2's is local: no collective)
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in saved:
                continue  # a non-persistent buffer: not in the state dict, sent as DDP sends buffers
            if dist.get_rank() == 0 and loose[name] is not buffer:
                buffer.copy_(loose[name])
            dist.broadcast(buffer, src=0)
