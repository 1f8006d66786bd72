"""A sharded model's first weights: rank 0's, whether it was built for real or on the meta device.

DDP broadcasts rank 0's parameters when it wraps a model; FSDP2's ``fully_shard`` does not, so
ranks seeded differently would start from different weights. ``rank0_state`` takes rank 0's full
state before sharding and ``start`` sends it out after: torch's ``set_model_state_dict`` with
``broadcast_from_rank0=True`` broadcasts one tensor at a time and keeps only this rank's slice, so
no rank's device holds more than its shards plus one full tensor.

A model built on the meta device (``with torch.device("meta"): model = Net()``) holds no memory.
It is sharded as it is, ``to_empty`` gives every rank room for its shards only, and rank 0 makes
the weights one process would have made (``MetaStart``), a piece at a time: its modules run their
``reset_parameters()`` children before their parent (the order constructors run them:
``MultiheadAttention`` resets itself after building ``out_proj``), so the same seed gives the same
weights as ``Net()`` in one process; each module's tensors are made on rank 0's CPU just before
its reset, sent to every rank's shards once no module above it that could still write them is
left to reset (a parent with tensors of its own keeps its subtree until its own reset), and freed.
Rank 0's host never holds the whole model, only one such piece. A model built on rank 0 alone
(``with torch.device("cpu" if autoddp.rank() == 0 else "meta")``) sends rank 0's weights; DDP's
meta-built model is made whole on rank 0 (``materialise``), which DDP's own broadcast sends.
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


def _children_first(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Every submodule once, each after its children (a module's constructor builds them first)."""
    return [m for m, _ in _walk(module)]


def _walk(
    module: torch.nn.Module, covered: bool = False, seen: set[int] | None = None
) -> list[tuple[torch.nn.Module, bool]]:
    """``_children_first``'s order, each module with whether its reset is the last that may write
    its subtree's tensors: it owns tensors and no module above it does (``covered``)."""
    seen = set() if seen is None else seen
    order: list[tuple[torch.nn.Module, bool]] = []
    if id(module) in seen:
        return order
    seen.add(id(module))
    own = _own_tensors(module)
    for child in module.children():
        order.extend(_walk(child, covered or own, seen))
    order.append((module, own and not covered))
    return order


def materialise(module: torch.nn.Module, rank: int, device: torch.device | str) -> torch.nn.Module:
    """A meta-built ``module`` for DDP, on ``device``: rank 0's holds the weights one process would
    make (``initialise_on_cpu``), the others' only memory (DDP broadcasts rank 0's when it wraps)."""
    if rank == 0:  # (the others take rank 0's weights: built on rank 0 alone, theirs need no reset)
        return initialise_on_cpu(module).to(device)
    return module.to_empty(device=device)


def rank0_state(module: torch.nn.Module, rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Rank 0's full state dict and its non-persistent buffers, taken before sharding (empty elsewhere):
    the module's own tensors, no copy (a model rank 0 built on the meta device: ``MetaStart``)."""
    if rank != 0:
        return {}, {}
    state = module.state_dict()
    loose = {name: b for name, b in module.named_buffers() if name not in state}
    return state, loose


def rank0_built_on_meta(module: torch.nn.Module, device: torch.device | str) -> bool:
    """Whether rank 0's ``module`` was built on the meta device (every rank calls it: one broadcast
    of a byte, as a model built on rank 0 alone is meta on the other ranks only)."""
    import torch.distributed as dist

    flag = torch.tensor([is_meta(module)], dtype=torch.uint8, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _empty(module: torch.nn.Module, shards_on: Any, buffers_on: Any) -> None:
    """Memory for a sharded module's shards on ``shards_on`` and its buffers on ``buffers_on``."""
    module.to_empty(device=shards_on)
    for sub in module.modules():
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if buffers_on is not None and buffer.device != torch.device(buffers_on):
                setattr(sub, name, buffer.to(buffers_on))  # (assigning a buffer keeps it one)


class MetaStart:
    """The weights of a meta-built model, made on rank 0 a piece at a time (module docstring).

    Made before sharding on every rank (``check_initialisable`` fails on all alike): rank 0 keeps a
    copy on the meta device (no memory) whose modules get CPU tensors only while their piece is made.
    """

    def __init__(self, module: torch.nn.Module, rank: int) -> None:
        check_initialisable(module)
        self.rank = rank
        workspace = copy.deepcopy(module) if rank == 0 else None
        copies = _children_first(workspace) if workspace is not None else None
        #: Each module that owns tensors, in reset order: (the module, rank 0's copy of it, whether
        #: its reset is the last that may write its subtree: then the modules made so far are sent).
        self.steps: list[tuple[torch.nn.Module, torch.nn.Module | None, bool]] = [
            (sub, copies[i] if copies is not None else None, last)
            for i, (sub, last) in enumerate(_walk(module))
            if _own_tensors(sub)
        ]

    def start(self, module: torch.nn.Module, shards_on: Any, buffers_on: Any) -> None:
        """Fill the sharded ``module`` (every rank calls it: collectives, in the same order on each)."""
        _empty(module, shards_on, buffers_on)
        made: list[tuple[torch.nn.Module, torch.nn.Module | None]] = []
        with torch.no_grad():
            for sub, piece, last in self.steps:
                if piece is not None:  # (rank 0)
                    piece.to_empty(device="cpu", recurse=False)
                    _reset(piece)()
                made.append((sub, piece))
                if last:
                    for target, source in made:
                        _send(target, source)
                        if source is not None:
                            source.to_empty(device="meta", recurse=False)  # freed
                    made.clear()
        self.steps = []


def _send(target: torch.nn.Module, source: torch.nn.Module | None) -> None:
    """``source``'s own tensors (rank 0's; None elsewhere) into ``target``'s shards and buffers."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    buffers = dict(target.named_buffers(recurse=False))
    saved = set(target.state_dict(keep_vars=True)) if buffers else set()  # (local: no collective)
    loose = [name for name in buffers if name not in saved]
    names = [name for name, _ in target.named_parameters(recurse=False)]
    names += [name for name in buffers if name in saved]
    if names:  # (called on the module itself: torch reloads only its keys, not the whole model's)
        state = {name: getattr(source, name) for name in names} if source is not None else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(target, state, options=options)
    for name in loose:  # not in the state dict: sent as DDP sends buffers
        if source is not None:
            buffers[name].copy_(getattr(source, name))
        dist.broadcast(buffers[name], src=0)


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
        _empty(module, shards_on, buffers_on)
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
