"""Gradient accumulation under FSDP2: one reduce-scatter per optimizer step, for unchanged code.

What ``_window`` does for DDP: a forward the learned window says is not the last before a step
runs with FSDP2's ``set_requires_gradient_sync(False)``, so its backward leaves the gradients
unsharded and summed locally, and the last one's reduce-scatter averages the sum into the shards.
Those unsharded gradients take the whole model's gradient bytes on every rank: deferred only where
they fit twice in what the memory budget leaves (``_plan.room``), and never with CPU offload or
mixed precision (FSDP2 keeps their gradients elsewhere).

A guess can be wrong, never the result. FSDP2 swaps each unit's unsharded parameters in for its
forward; a pre-hook on the unit, after FSDP2's, sees them (torch keeps the same ones from one
forward to the next), and their ``.grad`` is what a deferred backward left. A step, or what reads
gradients before it (``clip_grad_norm_``), that finds such gradients averages them across ranks and
adds this rank's slice to the shards' gradients (``settle``); ``zero_grad``, of an optimizer or of
the model, drops them, as it drops the shards'. (Gradients set to None by hand, parameter by
parameter, between a deferred backward and the step are not seen: only ``zero_grad`` is.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from autoddp.core.errors import TorchCompatibilityError
from autoddp.core.memory.sizes import format_bytes
from autoddp.core.state import CURRENT
from autoddp.in_rank.models import _fsdp_state, _mean, _window

_ATTR = "_autoddp_deferral"
_ZERO_GRAD = "zero_grad"


class _Unit:
    """One ``fully_shard`` unit: where its own parameters sit, and their unsharded twins."""

    __slots__ = ("places", "sharded", "unsharded")

    def __init__(self, unit: torch.nn.Module) -> None:
        self.places = list(_fsdp_state.own_places(unit))
        #: The shards (FSDP2 keeps these objects, the optimizer's, from forward to forward; the
        #: module holds the unsharded twins from a forward to its backward: never read then).
        self.sharded = [getattr(owner, name) for owner, name in self.places]
        self.unsharded: list[torch.nn.Parameter] = []  # (seen at the unit's first forward)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        """The unit's forward pre-hook (after FSDP2's, which unsharded it): its unsharded parameters."""
        if not self.places:
            return
        owner, name = self.places[0]
        first = getattr(owner, name)
        if (self.unsharded and first is self.unsharded[0]) or _is_dtensor(first):
            return  # (the same as before; or not unsharded for this forward: nothing to see)
        self.unsharded = [getattr(owner, name) for owner, name in self.places]

    def pending(self) -> bool:
        return any(p.grad is not None for p in self.unsharded)

    def sharded_now(self) -> bool:
        """Whether the parameters seen at the start are FSDP2's shards (the optimizer's)."""
        return all(_is_dtensor(p) for p in self.sharded)


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


class Deferral:
    """The window of one sharded model and the gradients its deferred backward passes left.

    ``why``: the reason its reduce-scatters cannot be deferred (then it defers nothing, and only
    learns the window, so that a run that accumulates is told why every backward reduce-scatters).
    """

    def __init__(self, model: torch.nn.Module, units: list[torch.nn.Module], why: str | None = None) -> None:
        probe = next((p for p in model.parameters() if p.requires_grad), None)
        self.window = _window.Window(probe)
        self.why = why
        self.window.off = why is not None  # (never deferred: and never said as deferred)
        self.forwards = 0  # forwards with gradients through the model
        self.syncing = True  # what set_requires_gradient_sync was last set to
        self.deferred = False  # a forward deferred since the gradients were last settled
        self.units = [_Unit(unit) for unit in units]
        disabled = torch.compiler.disable  # (hooks of Python state: never traced by torch.compile)
        pairs = zip(units, self.units, strict=True)
        self.handles = [unit.register_forward_pre_hook(disabled(seen)) for unit, seen in pairs]
        counts = self._forward if why is None else self._counted
        self.handles.append(model.register_forward_pre_hook(disabled(counts)))

    def _forward(self, module: torch.nn.Module, args: Any) -> None:
        """The model's forward pre-hook: whether this forward's backward reduce-scatters."""
        if not torch.is_grad_enabled():
            return
        self.forwards += 1
        sync = not self.window.defers(self.forwards)
        self.deferred = self.deferred or not sync
        if sync != self.syncing:
            module.set_requires_gradient_sync(sync)
            self.syncing = sync

    def _counted(self, module: torch.nn.Module, args: Any) -> None:
        """The forward pre-hook of a model whose reduce-scatters are not deferred: counted only."""
        if torch.is_grad_enabled():
            self.forwards += 1

    def settle(self) -> None:
        """Average the gradients deferred backward passes left unsharded into the shards' (a
        collective where some are left; every rank has the same ones: the windows are alike)."""
        if not self.deferred:
            return
        for unit in self.units:
            if unit.pending():
                _into_shards(unit)
        self.deferred = self.syncing is False  # (a forward deferred and not yet backward: later)

    def drop(self, params: set[int] | None = None) -> None:
        """``zero_grad``: the unsharded gradients of ``params`` (ids of shards; None: all) go too."""
        if not self.deferred:
            return
        for unit in self.units:
            if unit.pending():
                for shard, full in zip(unit.sharded, unit.unsharded, strict=True):
                    if params is None or id(shard) in params:
                        full.grad = None

    def stepped(self) -> None:
        self.window.stepped(self.forwards)
        if self.why is not None and self.window.length > 1 and CURRENT.undeferred is None:
            CURRENT.undeferred = (self.window.length, self.why)  # (capture's notice says it once)

    def detach(self, model: torch.nn.Module) -> None:
        for handle in self.handles:
            handle.remove()
        if not self.syncing:
            model.set_requires_gradient_sync(True)


def _into_shards(unit: _Unit) -> None:
    """The unit's unsharded gradients averaged across ranks, this rank's slice added to its shards'."""
    _mean.average(unit.unsharded)
    for shard, param in zip(unit.sharded, unit.unsharded, strict=True):
        grad, param.grad = param.grad, None
        if grad is None:
            continue
        piece = _fsdp_state.shard_of(grad.to(shard.dtype), shard)
        if piece.to_local().shape != shard.to_local().shape:
            raise TorchCompatibilityError(
                f"FSDP2's shard of a parameter is {tuple(shard.to_local().shape)}, not the "
                f"{tuple(piece.to_local().shape)} autoddp cut a deferred gradient into"
            )
        if shard.grad is None:
            shard.grad = piece.clone()  # (a view would keep the whole gradient alive)
        else:
            shard.grad.to_local().add_(piece.to_local())


def of(model: torch.nn.Module) -> Deferral | None:
    return model.__dict__.get(_ATTR)


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, room: Callable[[], int]) -> None:
    """Defer ``model``'s reduce-scatters to the last backward of each window, where it is sharded
    without CPU offload or mixed precision and its unsharded gradients fit twice in ``room()`` (the
    bytes a process has left, the same on every rank: ``_plan.room``); ``optimizer.zero_grad`` then
    drops them too."""
    if _ATTR not in model.__dict__:
        deferral = _made(model, room)
        if deferral is None:
            return
        model.__dict__[_ATTR] = deferral
    deferring = model.__dict__[_ATTR].why is None
    if deferring and _ZERO_GRAD not in optimizer.__dict__:  # (an instance attribute: this optimizer's only)
        optimizer.__dict__[_ZERO_GRAD] = functools.partial(_zero_grad, type(optimizer).zero_grad, optimizer)


def _made(model: torch.nn.Module, room: Callable[[], int]) -> Deferral | None:
    """The model's deferral; one that only learns the window where deferring cannot be done."""
    world = CURRENT.world
    trainable = [p for p in model.parameters() if p.requires_grad]
    if world is None or not trainable or not _is_fsdp(model):
        return None
    if CURRENT.options.mixed_precision is not None:
        return Deferral(model, [], "FSDP2 keeps mixed precision's unsharded gradients out of reach")
    if world.device != "cpu" and any(p.device.type == "cpu" for p in trainable):
        return Deferral(model, [], "the shards are on the CPU")  # (CPU offload: forced, or "auto"'s plan)
    grads = sum(p.numel() * p.element_size() for p in trainable)
    left = room()
    if 2 * grads > left:
        return Deferral(
            model,
            [],
            f"deferring them would hold the model's gradients unsharded on every process, twice "
            f"{format_bytes(grads)}, more than the {format_bytes(max(left, 0))} this process has left "
            "beside the sharded state (a larger device_memory, or more processes, lets autoddp defer them)",
        )
    deferral = Deferral(model, [m for m in model.modules() if _is_fsdp(m)])
    if not all(unit.sharded_now() for unit in deferral.units):  # (a forward came before the optimizer)
        deferral.detach(model)
        return None
    return deferral


def _is_fsdp(module: torch.nn.Module) -> bool:
    """Whether FSDP2 shards ``module`` (a model wrapped in this run: autoddp sharded it)."""
    if not hasattr(module, "set_requires_gradient_sync"):  # (FSDP2 not even imported: no)
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _zero_grad(original: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """``optimizer.zero_grad``: the unsharded gradients of its parameters go with the shards'."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in CURRENT.wrapped_models():
        deferral = of(model)
        if deferral is not None:
            deferral.drop(params)
    return original(optimizer, *args, **kwargs)


def settle_all() -> None:
    """Before something reads gradients: every sharded model's deferred gradients averaged in."""
    for model in CURRENT.wrapped_models():
        deferral = of(model)
        if deferral is not None:
            deferral.settle()


def detach(model: torch.nn.Module) -> None:
    """The model's hooks removed and its gradients synchronised again (the world ends)."""
    deferral = model.__dict__.pop(_ATTR, None)
    if deferral is not None:
        deferral.detach(model)
