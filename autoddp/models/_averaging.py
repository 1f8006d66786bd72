"""The safety net for steps DDP did not see: gradients averaged before ``optimizer.step()``.

DDP averages gradients only for forwards that go through it (``model(x)``). Code that calls a
model's submodules itself (``model.decoder(model.encoder(x))``) or its ``forward`` trains with
gradients DDP never saw, and the ranks would drift apart. An optimizer autoddp found a model
through gets a step pre-hook (torch's public ``register_step_pre_hook``): when no forward went
through the model's DDP since that optimizer's last step, or a submodule was called with gradients
beside it (an auxiliary loss through ``model.encoder(x2)``, counted by ``_routing.watch``), it
averages every gradient across ranks itself and says so once. Averaging again what DDP averaged
changes nothing (the values are equal on every rank), so DDP's part plus the bypass's comes out
averaged: the single-process gradient. The check is a few integer comparisons per step.
"""

from __future__ import annotations

from typing import Any

import torch

from autoddp import _warn
from autoddp.models import _routing

_GUARDED = "_autoddp_guarded"


class _Guard:
    """An optimizer's step pre-hook: the models it trains, and their counts at its last step."""

    def __init__(self) -> None:
        self.models: list[torch.nn.Module] = []
        self.seen: dict[int, tuple[int, int]] = {}  # id(model) -> (DDP forwards, bypasses)
        self.warned: set[int] = set()

    def add(self, models: list[torch.nn.Module]) -> None:
        for model in models:
            replica = model.__dict__.get(_routing.REPLICA_ATTR)
            if replica is not None and id(model) not in self.seen:
                replica.watch_submodules(model)  # (the counts this hook compares)
                self.models.append(model)
                self.seen[id(model)] = (replica.forwards, replica.bypasses)

    def __call__(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for model in self.models:
            replica = model.__dict__.get(_routing.REPLICA_ATTR)
            if replica is None:
                continue
            forwards, bypasses = self.seen[id(model)]
            unseen = replica.forwards == forwards
            if (unseen or replica.bypasses != bypasses) and _average(model) and id(model) not in self.warned:
                self.warned.add(id(model))
                _warn.warn(_without_ddp(model) if unseen else _beside_ddp(model))
            self.seen[id(model)] = (replica.forwards, replica.bypasses)


def _without_ddp(model: torch.nn.Module) -> str:
    name = type(model).__name__
    return (
        f"{name}'s gradients were computed without calling {name} itself (its submodules or its "
        "forward were called directly), so DDP did not average them; autoddp averaged them before "
        "optimizer.step() instead. Call the model itself (model(x)) to let DDP overlap that "
        "communication with the backward pass"
    )


def _beside_ddp(model: torch.nn.Module) -> str:
    name = type(model).__name__
    return (
        f"{name}'s submodules were called directly with gradients (model.encoder(x) beside "
        f"model(x), e.g. an auxiliary loss), so part of its gradients did not go through DDP; "
        "autoddp averaged all of them again before optimizer.step() (one more all-reduce per such "
        f"step). Compute that loss inside {name}'s forward to leave it to DDP alone"
    )


def guard(optimizer: torch.optim.Optimizer, models: list[torch.nn.Module]) -> None:
    """Average the gradients of ``models`` before ``optimizer``'s steps that their DDP did not see.

    Called again (a param group added later), it adds the models not yet guarded to the same hook.
    """
    existing = optimizer.__dict__.get(_GUARDED)
    if isinstance(existing, _Guard):
        existing.add(models)
        return
    if not any(_routing.REPLICA_ATTR in m.__dict__ for m in models):
        return
    hook = _Guard()
    hook.add(models)
    optimizer.register_step_pre_hook(hook)
    optimizer.__dict__[_GUARDED] = hook


def _average(model: torch.nn.Module) -> bool:
    """Average every trainable parameter's gradient across ranks; False when there was none."""
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    if not any(p.grad is not None for p in params):
        return False
    world = dist.get_world_size()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    works = [dist.all_reduce(g, async_op=True) for g in grads]  # the same list, in order, everywhere
    for work in works:
        work.wait()
    for p, g in zip(params, grads, strict=True):
        if p.grad is not None:
            p.grad.div_(world)
        elif torch.count_nonzero(g):
            p.grad = g.div_(world)
    return True
