"""The safety net for steps DDP did not see: gradients averaged before ``optimizer.step()``.

DDP averages gradients only for forwards that go through it (``model(x)``). Code that calls a
model's submodules itself (``model.decoder(model.encoder(x))``) or its ``forward`` trains with
gradients DDP never saw, and the ranks would drift apart. An optimizer autoddp found a model
through gets a step pre-hook (torch's public ``register_step_pre_hook``): when no forward went
through the model's DDP since that optimizer's last step, or a submodule was called with gradients
beside it (an auxiliary loss through ``model.encoder(x2)``, counted by ``_routing.watch``), it
averages every gradient across ranks itself and says so once. Averaging again what DDP averaged
changes nothing (the values are equal on every rank), so DDP's part plus the bypass's comes out
averaged: the single-process gradient. The same holds for gradients DDP did not average though
the forward went through it (``_reduction``: ``torch.autograd.grad``'s results put into ``.grad``,
a second backward through one forward). A step inside a backward pass (an optimizer stepped from
a post-accumulate-grad hook) averages its own parameters' gradients first, DDP's being still
under way. With ``step(closure)`` the check follows each closure call, and the closure's loss is
the mean over the ranks (LBFGS's line search decides on it). The check is a few integer
comparisons per step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from autoddp.core import _warn
from autoddp.core.state import CURRENT
from autoddp.in_rank.models import _deferral, _mean, _plan, _reduction, _routing, _window

_GUARDED = "_autoddp_guarded"


class _Guard:
    """An optimizer's step pre-hook: the models it trains, and their counts at its last step."""

    def __init__(self) -> None:
        self.models: list[torch.nn.Module] = []
        self.seen: list[tuple[int, int]] = []  # per model, in the order of models: (forwards, bypasses)
        self.sharded: list[Any] = []  # the ``_deferral.Deferral`` of each sharded model it trains

    def add(self, models: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        for model in models:
            replica = model.__dict__.get(_routing.REPLICA_ATTR)
            if replica is None and CURRENT.capture is not None:  # (sharded: its window, ``_deferral``)
                room = functools.partial(_plan.room, CURRENT.world, model, optimizer)
                _deferral.attach(model, optimizer, room)
                deferral = _deferral.of(model)
                if deferral is not None and not any(known is deferral for known in self.sharded):
                    self.sharded.append(deferral)
            elif replica is not None and not any(known is model for known in self.models):
                _reduction.count_passes()  # (its ledger tells one backward pass from the next)
                replica.watch_submodules(model)  # (the counts this hook compares)
                if CURRENT.capture is not None and replica.window is None:
                    probe = next((p for p in model.parameters() if p.requires_grad), None)
                    replica.window = _window.Window(probe)  # (capture averages what reads gradients early)
                self.models.append(model)
                self.seen.append((replica.forwards, replica.bypasses))

    def __call__(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if len(args) == 1 and not kwargs and CURRENT.backward_kind != _reduction.BACKWARD:
            self.check()  # the usual step: ``step()``, no closure, outside a backward pass
            return None
        return self._step(opt, args, kwargs)

    def _step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """``__call__`` of a step with a closure, or inside a backward pass."""
        if CURRENT.backward_kind == _reduction.BACKWARD:  # a step from a hook: DDP has not averaged yet
            params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
            if self.models and _mean.average(params):
                self._say(self.models[0], "in backward", _in_backward())
            return None
        closure = kwargs["closure"] if kwargs and "closure" in kwargs else args[1] if len(args) > 1 else None
        if closure is None or not callable(closure):
            self.check()
            return None
        made = functools.partial(self._closure, closure)  # (the gradients come from each call)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": made}
        return (args[0], made, *args[2:]), kwargs  # (args[0]: the optimizer)

    def check(self) -> None:
        """Average the gradients of each model whose ``.grad`` DDP did not (wholly) average, and
        those deferred backward passes left unsharded (``_deferral``)."""
        for deferral in self.sharded:
            deferral.settle()
            deferral.stepped()
        seen = self.seen
        for index, model in enumerate(self.models):
            replica = model.__dict__.get(_routing.REPLICA_ATTR)
            if replica is None:
                continue
            forwards, bypasses = seen[index]
            ledger = replica.reduction
            now = replica.forwards
            if (
                now != forwards and ledger.unreduced is None and replica.bypasses == bypasses
            ):  # the usual step, DDP averaged all of it: ``_check``'s outcome without its work
                window = replica.window
                if window is None:
                    pass
                elif window.length == 1 and now - window.at_step == 1:  # (``stepped``'s usual step, inline)
                    window.at_step, window.boundary, window.candidate = now, 0, 0
                else:
                    window.stepped(now)
                seen[index] = (now, bypasses)
            else:
                self._check(index, model, replica, forwards, bypasses)

    def _check(self, index: int, model: torch.nn.Module, replica: Any, forwards: int, bypasses: int) -> None:
        """``check`` of one model whose gradients DDP may not have (wholly) averaged."""
        unseen = replica.forwards == forwards
        unreduced = replica.reduction.take()  # (taken by the first optimizer: it averages all)
        if unseen or unreduced or replica.bypasses != bypasses:
            params = [p for p in model.parameters() if p.requires_grad]
            unseen_why = "functional" if replica.reparametrized else "unseen"
            reason = unseen_why if unseen else unreduced or "beside"
            if _mean.average(params) and reason not in _reduction.SILENT:  # (a window guessed wrong: silent)
                self._say(model, reason, _WORDS[reason](type(model).__name__))
        if replica.window is not None:
            replica.window.stepped(replica.forwards)
        self.seen[index] = (replica.forwards, replica.bypasses)
        replica.reparametrized = False

    def _closure(self, closure: Callable[[], Any]) -> Any:
        """``step(closure)``'s closure: its gradients checked, its loss the mean over the processes.

        An optimizer deciding on the loss (LBFGS's line search) then decides as one process would
        with the whole batch, and alike on every rank: the same number of closure calls everywhere.
        """
        loss = closure()
        self.check()
        return _global_value(loss)

    def _say(self, model: torch.nn.Module, reason: str, text: str) -> None:
        _say_once(model, reason, text)


def _say_once(model: torch.nn.Module, reason: str, text: str) -> None:
    """Said once per model and reason, whichever of its optimizers (one per parameter) stepped."""
    replica = model.__dict__.get(_routing.REPLICA_ATTR)
    said = replica.reduction.said if replica is not None else set()
    if reason not in said:
        said.add(reason)
        _warn.warn(text)


def _without_ddp(name: str) -> str:
    return (
        f"{name}'s gradients were computed without calling {name} itself (its submodules or its "
        "forward were called directly), so DDP did not average them; autoddp averaged them before "
        "optimizer.step() instead. Call the model itself (model(x)) to let DDP overlap that "
        "communication with the backward pass"
    )


def _beside_ddp(name: str) -> str:
    return (
        f"{name}'s submodules were called directly with gradients (model.encoder(x) beside "
        f"model(x), e.g. an auxiliary loss), so part of its gradients did not go through DDP; "
        "autoddp averaged all of them again before optimizer.step() (one more all-reduce per such "
        f"step). Compute that loss inside {name}'s forward to leave it to DDP alone"
    )


def _by_hand(name: str) -> str:
    return (
        f"{name}'s gradients came from torch.autograd.grad and were put into .grad by hand, so DDP "
        "did not average them (it averages backward passes only); autoddp averaged them across "
        "processes before optimizer.step() (one more all-reduce per step). Call loss.backward() to "
        "let DDP average them while the backward pass runs"
    )


def _second_backward(name: str) -> str:
    return (
        f"a second backward through the forwards of {name} (backward(retain_graph=True), then another "
        "backward; or two forwards, then a backward for each) added gradients DDP does not average "
        "(it averages one backward after the forwards); "
        "autoddp averaged all of them again before optimizer.step() (exact: DDP's part is already "
        "equal on every rank; one more all-reduce per such step). Add the losses and call backward "
        "once to leave it to DDP alone"
    )


def _in_backward() -> str:
    return (
        "an optimizer stepped inside the backward pass (from a hook, e.g. "
        "register_post_accumulate_grad_hook), before DDP had averaged the gradients; autoddp "
        "averages the gradients of that optimizer's parameters across processes just before each "
        "such step (one all-reduce per step, not overlapped with the backward pass)"
    )


def _functional(name: str) -> str:
    return (
        f"{name} was called through torch.func.functional_call (with parameters of the caller's, as "
        "torch.func.grad needs), which DDP cannot run, so DDP did not average its gradients; autoddp "
        "averaged them before optimizer.step() instead (exact; one all-reduce per such step, not "
        "overlapped with the backward pass). Nothing to change unless that communication matters"
    )


_WORDS = {
    "functional": _functional,
    "unseen": _without_ddp,
    "beside": _beside_ddp,
    _reduction.GRAD: _by_hand,
    _reduction.BACKWARD: _second_backward,
}


def _global_value(loss: Any) -> Any:
    """A loss averaged across ranks, exactly the same number on every rank (anything else as it is)."""
    import torch.distributed as dist

    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        total = loss.detach().clone()
    elif isinstance(loss, (int, float)) and not isinstance(loss, bool) and CURRENT.world is not None:
        total = torch.tensor(float(loss), dtype=torch.float64, device=CURRENT.world.device)
    else:
        return loss
    dist.all_reduce(total)
    total.div_(dist.get_world_size())
    return total if isinstance(loss, torch.Tensor) else total.item()


def guard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Average gradients DDP did not see before ``optimizer``'s steps (those of the models wrapped
    in this run that it trains)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    guard(optimizer, [m for m in CURRENT.wrapped_models() if any(id(p) in params for p in m.parameters())])


def guard(optimizer: torch.optim.Optimizer, models: list[torch.nn.Module]) -> None:
    """Average the gradients of ``models`` before ``optimizer``'s steps that their DDP did not see.

    Called again (a param group added later), it adds the models not yet guarded to the same hook.
    """
    existing = optimizer.__dict__.get(_GUARDED)
    if isinstance(existing, _Guard):
        existing.add(models, optimizer)
        return
    hook = _Guard()
    hook.add(models, optimizer)
    if not hook.models and not hook.sharded:
        return
    optimizer.register_step_pre_hook(hook.__call__)  # (a bound method: a cheaper call than the instance)
    optimizer.__dict__[_GUARDED] = hook


def average_before_read() -> None:
    """Average now, in every model wrapped in this run, the gradients ``step()`` would average
    (``no_sync``'s, a second backward's, ``torch.autograd.grad``'s put into ``.grad``), before
    something reads them (``clip_grad_norm_``, ``GradScaler.unscale_``): it sees one process's.

    A collective where some model has such gradients; every rank has the same ones (the windows and
    the backward passes are alike everywhere).
    """
    _deferral.settle_all()
    for model in CURRENT.wrapped_models():
        replica = model.__dict__.get(_routing.REPLICA_ATTR)
        if replica is None or not replica.watched or replica.reduction.due() is None:
            continue
        reason = replica.reduction.take()
        if (
            _mean.average([p for p in model.parameters() if p.requires_grad])
            and reason not in _reduction.SILENT
        ):
            _say_once(model, reason, _WORDS[reason](type(model).__name__))
