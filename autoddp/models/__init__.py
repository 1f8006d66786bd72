"""Model wrapping: which strategy distributes a model, and the operations every strategy offers.

``wrap`` applies the run's strategy (``RunOptions.strategy``); the other functions find the
strategy that wrapped a model (kept on its swapped class) and fall back to a plain module's
behaviour for models nobody wrapped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from autoddp import _compat
from autoddp.errors import ConfigurationError
from autoddp.models.ddp import DDP
from autoddp.models.fsdp import FSDP
from autoddp.models.strategy import PLAIN, Strategy
from autoddp.state import RunOptions, World

#: The strategies a run can choose, by name.
STRATEGIES: dict[str, Strategy] = {DDP.name: DDP, FSDP.name: FSDP}


def strategy_named(name: str) -> Strategy:
    """The strategy called ``name``; ConfigurationError naming the choices otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown strategy {name!r}: use one of {', '.join(map(repr, STRATEGIES))}"
        ) from None


def strategy_of(model: Any) -> Strategy:
    """The strategy that wrapped ``model`` (the plain one for a model nobody wrapped)."""
    return getattr(type(model), "_autoddp_strategy", PLAIN)


def wrap(module: torch.nn.Module, world: World, options: RunOptions, *, move: bool = True) -> torch.nn.Module:
    """``module`` ready for ``world`` with the run's strategy (a model already wrapped is kept)."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return module
    return strategy_named(options.strategy).wrap(module, world, options, move=move)


def distributed(model: torch.nn.Module) -> bool:
    """True for a model already distributed in this world (by autoddp, or a DDP object)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return True
    inner = unwrap(model)
    return strategy_of(inner).distributed(inner)


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
            return strategy_of(model).unwrap(model)


def state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The full, plain state dict of ``model`` (every rank calls it: it may be a collective)."""
    model = unwrap(model)
    return strategy_of(model).state_dict(model)


def load_state_dict(model: torch.nn.Module, state: Mapping[str, Any], strict: bool = True) -> Any:
    """Load a full, plain state dict into ``model``, whatever wrapped it."""
    model = unwrap(model)
    return strategy_of(model).load_state_dict(model, state, strict=strict)


def portable(model: torch.nn.Module, keep: bool = True) -> torch.nn.Module:
    """``model`` plain on the CPU, fit to travel to another process (every rank calls it).

    ``keep=False``: this rank's copy is not wanted; it takes part in the collectives only.
    """
    model = unwrap(model)
    return strategy_of(model).portable(model, keep=keep)


def ddp_in_charge(model: torch.nn.Module) -> bool:
    """True when autoddp's own DDP synchronises ``model`` now."""
    from autoddp.models.ddp import ddp_of

    return ddp_of(unwrap(model)) is not None


def release(model: torch.nn.Module) -> None:
    """Undo what autoddp's strategy did to ``model`` (it is the user's plain module again)."""
    model = unwrap(model)
    strategy_of(model).release(model)


def guard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Average gradients DDP did not see before ``optimizer``'s steps (``models._averaging``)."""
    from autoddp.models import _averaging
    from autoddp.state import CURRENT

    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trained = [m for m in CURRENT.wrapped_models() if any(id(p) in params for p in m.parameters())]
    _averaging.guard(optimizer, trained)
