"""Model wrapping: the run's strategy distributes a model; the rest of what autoddp does to models.

A strategy is a module, ``ddp`` or ``fsdp``, with the same functions: ``wrap`` (a module ready for
the world), ``distributed`` (already done in this world) and ``release`` (let go of the process
group); the sharded one also gathers (``state_dict``, ``portable``: collectives). ``wrap`` here
applies the run's (``RunOptions.strategy``), which names itself on the class of the model it
wrapped; the functions here find it there, and treat a model nobody wrapped as the plain module it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from autoddp.core import _class_swap, _compat
from autoddp.core.environment import hardware
from autoddp.core.errors import ConfigurationError
from autoddp.core.memory.optimizers import groups_of
from autoddp.core.memory.sizes import parse_bytes
from autoddp.core.state import CURRENT, RunOptions, World
from autoddp.in_rank.models import _first_step, _placed_later, _plan, _rebind, ddp, fsdp
from autoddp.in_rank.models._at_call import DRAWN_APART
from autoddp.in_rank.models._averaging import average_before_read, guard_optimizer
from autoddp.in_rank.models._fsdp_state import (
    bind_optimizer,
    full_tensors,
    optimizer_state_dict,
    sharded_model_of,
)
from autoddp.in_rank.models._reduction import BACKWARD, count_passes
from autoddp.in_rank.models._routing import no_sync_at_one_process
from autoddp.in_rank.models._routing import split_decisions as split_at_call
from autoddp.in_rank.models._split import check_loss, show_split_loss_whole, split_note
from autoddp.in_rank.models._window import training_pass

__all__ = [
    "STRATEGIES",
    "check_options",
    "check_available",
    "check_device_memory",
    "wrap",
    "rebind_optimizers",
    "distributed",
    "unwrap",
    "state_dict",
    "portable",
    "release",
    "strategy_name",
    "strategy_label",
    "plan_note",
    "class_name",
    "measured_from_here",
    "recovering",
    "sharding",
    "ddp_in_charge",
    "ddp_being_built",
    # a model too large for one GPU, waiting in host memory to be sharded: ``_placed_later``
    "can_shard",
    "device_left",
    "defer_placement",
    "placement_pending",
    "placement_cancelled",
    # the optimizers' side: ``_averaging``, ``_fsdp_state``
    "guard_optimizer",
    "average_before_read",
    "training_pass",
    "bind_optimizer",
    "optimizer_state_dict",
    "full_tensors",
    "sharded_model_of",
    # the backward passes and the loss: ``_reduction``, ``_split``, ``_routing``
    "BACKWARD",
    "count_passes",
    "check_loss",
    "show_split_loss_whole",
    "split_note",
    "split_at_call",
    "DRAWN_APART",
    "no_sync_at_one_process",
]

#: The strategies a run can choose, by name.
STRATEGIES: dict[str, ModuleType] = {ddp.NAME: ddp, fsdp.NAME: fsdp}


def _named(name: str) -> ModuleType:
    """The strategy called ``name``; ConfigurationError naming the choices otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown strategy={name!r}: use one of {', '.join(map(repr, (_plan.AUTO, *STRATEGIES)))}"
        ) from None


def _strategy_of(model: torch.nn.Module) -> ModuleType | None:
    """The strategy that wrapped ``model`` (None for a model nobody wrapped)."""
    return STRATEGIES.get(getattr(type(model), "_autoddp_strategy", None))


def check_options(
    strategy: str, ddp_kwargs: Any, fsdp_blocks: Any, mixed_precision: Any, cpu_offload: Any
) -> None:
    """A run's strategy options, checked before anything runs: ConfigurationError naming the fix."""
    ddp.check_keywords(ddp_kwargs)
    if strategy != _plan.AUTO:
        _named(strategy)
    if strategy == ddp.NAME and (fsdp_blocks or mixed_precision is not None or cpu_offload):
        raise ConfigurationError(
            "fsdp_blocks=, mixed_precision= and cpu_offload= are FSDP's options: use strategy='fsdp' "
            "(or 'auto', where they choose FSDP), or leave them out"
        )
    fsdp.precision(mixed_precision)
    if isinstance(fsdp_blocks, (str, type)) or not all(isinstance(b, (str, type)) for b in fsdp_blocks):
        raise ConfigurationError(
            f"fsdp_blocks={fsdp_blocks!r}: give a tuple of module classes or class names, "
            "e.g. fsdp_blocks=(TransformerBlock,) or fsdp_blocks=('TransformerBlock',)"
        )


def check_device_memory(value: Any, strategy: str) -> int:
    """``device_memory=`` in bytes, checked: a size above 0, for ``strategy="auto"`` (the only one
    that weighs it); ConfigurationError naming the fix otherwise."""
    size = parse_bytes(value, name="device_memory")
    if size <= 0:
        raise ConfigurationError(f"device_memory={value!r}: give the memory one process may use, above 0")
    if strategy != _plan.AUTO:
        raise ConfigurationError(
            f"device_memory= is the budget strategy='auto' weighs, and strategy={strategy!r} weighs "
            "nothing: leave device_memory out, or use strategy='auto'"
        )
    return size


def check_available(strategy: str) -> None:
    """A ConfigurationError naming the torch a strategy needs, where this one lacks it (after the
    options' values are checked: those errors come first)."""
    if strategy == fsdp.NAME:
        fsdp.fsdp_api(None if hardware.gpu_count() else "cpu")


def wrap(
    module: torch.nn.Module,
    world: World,
    options: RunOptions,
    *,
    move: bool = True,
    optimizers: Iterable[torch.optim.Optimizer] = (),
    training: _plan.Training | None = None,
) -> torch.nn.Module:
    """``module`` ready for ``world`` with the run's strategy (a model already wrapped is kept);
    ``strategy="auto"`` weighs the model's state with the optimizer that trains it (``training``:
    the class and groups of one being made; else the first of ``optimizers``) (``_plan``).

    Where the strategy replaced parameters (sharding), optimizers made before over the old ones
    are bound to the new ones (``_rebind``; ``optimizers``: ones the caller knows of)."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return module
    optimizers = list(optimizers)
    if training is None and optimizers:
        training = groups_of(optimizers[0], [])
    options = _plan.resolve(module, world, options, training)
    inner = unwrap(module)
    trainable = any(p.requires_grad for p in inner.parameters())
    _placed_later.settle(inner, sharded=options.strategy == fsdp.NAME and world.world_size > 1 and trainable)
    before = list(module.named_parameters())
    wrapped = _named(options.strategy).wrap(module, world, options, move=move)
    _rebind.rebind_optimizers(_rebind.remember(wrapped, before), optimizers)
    del before  # (the parameters sharding replaced: no step's memory)
    _first_step.measured_from_here(world)
    return wrapped


#: Where a model too large for one GPU waits (``_placed_later``, ``capture.too_large``).
defer_placement = _placed_later.defer
placement_pending = _placed_later.pending
placement_cancelled = _placed_later.cancel
device_left = _plan.left_on
can_shard = _plan.can_shard


def measured_from_here() -> None:
    """Once an optimizer is made over wrapped models (the parameters sharding replaced let go of):
    the first step's peak counts from here (``_first_step.measured_from_here``)."""
    if CURRENT.world is not None:
        _first_step.measured_from_here(CURRENT.world)


def rebind_optimizers(optimizers: Iterable[torch.optim.Optimizer], models: Iterable[torch.nn.Module]) -> None:
    """Bind ``optimizers`` (made before ``models`` were wrapped) to the parameters that wrapping
    replaced in ``models`` (sharding); nothing for a strategy that keeps them."""
    _rebind.rebind_known(optimizers, [unwrap(model) for model in models])


def distributed(model: torch.nn.Module) -> bool:
    """True for a model already distributed in this world (by autoddp, or a DDP object)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return True
    inner = unwrap(model)
    strategy = _strategy_of(inner)
    return strategy is not None and strategy.distributed(inner)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's own module behind DDP and ``torch.compile`` wrappers.

    For a module autoddp wrapped, that is the module itself: its ``state_dict`` is already
    plain, and pickling or deep-copying it gives an instance of the user's class.
    """
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif (compiled := _compat.compiled_parts(model)) is not None:
            model = compiled[0]
        else:
            return model


def state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The full, plain state dict of ``model`` (every rank calls it: it may be a collective)."""
    model = unwrap(model)
    return fsdp.state_dict(model) if _strategy_of(model) is fsdp else model.state_dict()


def portable(model: torch.nn.Module, keep: bool = True) -> torch.nn.Module:
    """``model`` plain on the CPU, fit to travel to another process (every rank calls it).

    ``keep=False``: this rank's copy is not wanted; it takes part in the collectives only.
    """
    model = unwrap(model)
    if _strategy_of(model) is fsdp:
        return fsdp.portable(model, keep=keep)
    return model.cpu() if keep else model


def release(model: torch.nn.Module) -> None:
    """Undo what autoddp's strategy did to ``model`` (it is the user's plain module again)."""
    model = unwrap(model)
    strategy = _strategy_of(model)
    if strategy is not None:
        strategy.release(model)


def strategy_name(model: torch.nn.Module) -> str:
    """The strategy that distributes ``model`` ("ddp", "fsdp"; "" for a model nobody wrapped)."""
    strategy = _strategy_of(unwrap(model))
    return strategy.NAME if strategy is not None else ""


def strategy_label(model: torch.nn.Module) -> str:
    """How ``model`` is distributed, for the notice: "DDP", "FSDP", or the user's own sharding."""
    name = strategy_name(model)
    if not name and fsdp.sharded_by_hand(unwrap(model)):
        return "FSDP2 by your own fully_shard (left as it is)"
    return name.upper()


def class_name(model: torch.nn.Module) -> str:
    """The name of the user's class of ``model``, behind the classes autoddp and FSDP2 swap in
    (``FSDPNet`` is ``Net``)."""
    for cls in type(unwrap(model)).__mro__:
        swapped = _class_swap.PLAIN_CLASS in cls.__dict__ or cls.__module__.startswith("torch.distributed")
        if not swapped:
            return cls.__name__
    return type(model).__name__


def recovering() -> Any:
    """Around the user's code in a world: out of memory under ``strategy="auto"``'s plan becomes a
    ``MemoryPlanError`` naming the next plan (``_plan.recovering``)."""
    return _plan.recovering()


def plan_note(model: torch.nn.Module) -> str:
    """Why ``strategy="auto"`` gave ``model`` its strategy, for the notice ("" where it did not)."""
    return _plan.note(unwrap(model))


def sharding() -> bool:
    """True where this world's models are sharded (strategy "fsdp", or "auto" that chose it)."""
    planned = CURRENT.planned
    return CURRENT.options.strategy == fsdp.NAME or (planned is not None and planned.sharded)


def ddp_in_charge(model: torch.nn.Module) -> bool:
    """True when autoddp's own DDP synchronises ``model`` now."""
    return ddp.ddp_of(unwrap(model)) is not None


def ddp_being_built(model: torch.nn.Module) -> bool:
    """True while autoddp itself makes the DDP behind ``model`` (a rebuild happens inside the
    user's forward, after the model changed: capture must not take it for a DDP of the user's)."""
    return ddp.building(unwrap(model))
