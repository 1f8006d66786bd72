"""Model wrapping: which strategy distributes a model, and the operations every strategy offers.

``wrap`` applies the run's strategy (``RunOptions.strategy``); the other functions find the
strategy that wrapped a model (kept on its swapped class) and fall back to a plain module's
behaviour for models nobody wrapped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from autoddp.core import _compat, _patches
from autoddp.core.environment import hardware
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import RunOptions, World
from autoddp.in_rank.models import _fsdp_state, _rebind, _routing, _split
from autoddp.in_rank.models.ddp import DDP, check_keywords
from autoddp.in_rank.models.fsdp import FSDP, fsdp_api, precision
from autoddp.in_rank.models.strategy import PLAIN, Strategy

#: The strategies a run can choose, by name.
STRATEGIES: dict[str, Strategy] = {DDP.name: DDP, FSDP.name: FSDP}


def strategy_named(name: str) -> Strategy:
    """The strategy called ``name``; ConfigurationError naming the choices otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown strategy={name!r}: use one of {', '.join(map(repr, STRATEGIES))}"
        ) from None


def check_options(strategy: str, ddp: Any, fsdp_blocks: Any, mixed_precision: Any, cpu_offload: Any) -> None:
    """A run's strategy options, checked before anything runs: ConfigurationError naming the fix."""
    check_keywords(ddp)
    strategy_named(strategy)
    if strategy != "fsdp" and (fsdp_blocks or mixed_precision is not None or cpu_offload):
        raise ConfigurationError(
            "fsdp_blocks=, mixed_precision= and cpu_offload= are FSDP's options: add strategy='fsdp'"
        )
    precision(mixed_precision)
    if isinstance(fsdp_blocks, (str, type)) or not all(isinstance(b, (str, type)) for b in fsdp_blocks):
        raise ConfigurationError(
            f"fsdp_blocks={fsdp_blocks!r}: give a tuple of module classes or class names, "
            "e.g. fsdp_blocks=(TransformerBlock,) or fsdp_blocks=('TransformerBlock',)"
        )


def check_available(strategy: str) -> None:
    """A ConfigurationError naming the torch a strategy needs, where this one lacks it (after the
    options' values are checked: those errors come first)."""
    if strategy == "fsdp":
        fsdp_api(None if hardware.gpu_count() else "cpu")


def strategy_of(model: Any) -> Strategy:
    """The strategy that wrapped ``model`` (the plain one for a model nobody wrapped)."""
    return getattr(type(model), "_autoddp_strategy", PLAIN)


def wrap(
    module: torch.nn.Module,
    world: World,
    options: RunOptions,
    *,
    move: bool = True,
    optimizers: Iterable[torch.optim.Optimizer] = (),
) -> torch.nn.Module:
    """``module`` ready for ``world`` with the run's strategy (a model already wrapped is kept).

    Where the strategy replaced parameters (sharding), optimizers made before over the old ones
    are bound to the new ones (``_rebind``; ``optimizers``: ones the caller knows of)."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return module
    before = list(module.named_parameters())
    wrapped = strategy_named(options.strategy).wrap(module, world, options, move=move)
    _rebind.rebind_optimizers(_rebind.remember(wrapped, before), optimizers)
    return wrapped


def rebind_optimizers(optimizers: Iterable[torch.optim.Optimizer], models: Iterable[torch.nn.Module]) -> None:
    """Bind ``optimizers`` (made before ``models`` were wrapped) to the parameters that wrapping
    replaced in ``models`` (sharding); nothing for a strategy that keeps them."""
    _rebind.rebind_known(optimizers, [unwrap(model) for model in models])


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


def portable(model: torch.nn.Module, keep: bool = True) -> torch.nn.Module:
    """``model`` plain on the CPU, fit to travel to another process (every rank calls it).

    ``keep=False``: this rank's copy is not wanted; it takes part in the collectives only.
    """
    model = unwrap(model)
    return strategy_of(model).portable(model, keep=keep)


def ddp_in_charge(model: torch.nn.Module) -> bool:
    """True when autoddp's own DDP synchronises ``model`` now."""
    from autoddp.in_rank.models.ddp import ddp_of

    return ddp_of(unwrap(model)) is not None


def ddp_being_built(model: torch.nn.Module) -> bool:
    """True while autoddp itself makes the DDP behind ``model`` (a rebuild happens inside the
    user's forward, after the model changed: capture must not take it for a DDP of the user's)."""
    from autoddp.in_rank.models.ddp import building

    return building(unwrap(model))


def release(model: torch.nn.Module) -> None:
    """Undo what autoddp's strategy did to ``model`` (it is the user's plain module again)."""
    model = unwrap(model)
    strategy_of(model).release(model)


def bind_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Have an optimizer over sharded (FSDP) parameters load full state into its shards (idempotent;
    any other optimizer is left as it is)."""
    return _fsdp_state.bind(optimizer)


def optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state as one process would hold it (full tensors; a collective when sharded)."""
    return _fsdp_state.state_dict(optimizer)


def full_tensors(obj: Any, to_host: bool = True) -> Any:
    """``obj`` with every sharded tensor in it gathered whole on the CPU (every rank calls it).

    ``to_host=False``: gathered only for the collective's sake, left on the device.
    """
    return _fsdp_state.full_tensors(obj, to_host)


def sharded_model_of(optimizer: torch.optim.Optimizer) -> torch.nn.Module | None:
    """The sharded model whose parameters ``optimizer`` trains, among those wrapped in this run."""
    return _fsdp_state.model_of(optimizer)


def guard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Average gradients DDP did not see before ``optimizer``'s steps (``models._averaging``)."""
    from autoddp.core.state import CURRENT
    from autoddp.in_rank.models import _averaging

    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trained = [m for m in CURRENT.wrapped_models() if any(id(p) in params for p in m.parameters())]
    _averaging.guard(optimizer, trained)


def counted(original: Any, accumulates: bool = True) -> Any:
    """``torch.autograd.backward`` (``accumulates``) or ``grad`` saying that it runs, for the step's
    averaging guard: which backward passes DDP averaged, and a step inside one (``_reduction``)."""
    from autoddp.in_rank.models import _reduction

    return _reduction.counting(original, _reduction.BACKWARD if accumulates else _reduction.GRAD)


def check_loss(loss: Any, split: bool) -> None:
    """Warn when the first loss reduces over the batch otherwise than the run can average: a
    weighted mean (DDP, split_batches), or a sum (split_batches, which assumes a mean)."""
    _split.check_loss(loss, split)


def show_split_loss_whole(loss: Any) -> None:
    """split_batches: after its backward, ``loss`` holds the global batch's value (every rank calls it)."""
    _split.show_whole(loss)


def split_note(model: torch.nn.Module) -> str:
    """split_batches: the notice's words for ``model``'s BatchNorm layers with global statistics."""
    return _split.note(model)


def no_sync_at_one_process() -> _patches.Patches:
    """``model.no_sync()`` on every module while the user's code runs in one process (a no-op
    context; ``with`` this unit), where no model is wrapped: accumulation code runs unchanged."""
    return _patches.Patches([(torch.nn.Module, "no_sync", _routing.NoSyncAnywhere())])
