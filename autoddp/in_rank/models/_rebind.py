"""Optimizers made before a strategy replaced their model's parameters, bound to the new ones.

Sharding (FSDP2's ``fully_shard``) puts new parameter objects in the module. An optimizer made
before that still holds the old tensors: its steps would update tensors no forward reads, and
training would silently do nothing. After a wrap that replaced parameters, every optimizer that
holds an old one takes the new ones in its groups: those the garbage collector lists (every one
made in this process since it started or forked: a worker freezes what it inherited), those the
caller knows (the optimizers a decorated call reaches) and those the user's frames reach (their
locals and globals, a few attributes deep). State an optimizer already has (momentum after some
steps) is carried over as one process holds it, cut to this rank's shards by the optimizer's
load (``_fsdp_state.bind_optimizer``).
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autoddp.core import _containers, _frames
from autoddp.core.errors import ConfigurationError
from autoddp.in_rank.models import _fsdp_state

_REPLACED = "_autoddp_replaced"  # (a private attribute: it never travels in a pickle)


class Replaced:
    """The parameters a wrap replaced in one model, the old ones held weakly; kept on the model.

    Its step pre-hook (torch's public global one) refuses an optimizer that still holds an old
    parameter at its first step: one autoddp could not find, whose steps would do nothing.
    """

    def __init__(self, model: torch.nn.Module, before: list[tuple[str, torch.Tensor]]) -> None:
        after = dict(model.named_parameters())
        self.name = type(model).__name__
        self.old: dict[int, weakref.ref] = {}
        self.new: dict[int, weakref.ref] = {}  # (weak too: the hook outlives the model)
        for name, old in before:
            new = after.get(name)
            if new is not None and new is not old:
                self.old[id(old)], self.new[id(old)] = weakref.ref(old), weakref.ref(new)
        self._checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._handle: Any = None
        self.done = False

    def holds_old(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(
            (ref := self.old.get(id(p))) is not None and ref() is p
            for group in optimizer.param_groups
            for p in group["params"]
        )

    def rebind(self, optimizer: torch.optim.Optimizer) -> None:
        """Have ``optimizer`` train the new parameters where it holds old ones."""
        if self.holds_old(optimizer):
            pairs = ((key, self.old[key](), new()) for key, new in self.new.items())
            _rebind(
                optimizer,
                {key: new for key, old, new in pairs if old is not None and new is not None},
                self.name,
            )

    def watch(self) -> None:
        if self.old and self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.done:
            return
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        if self._checked.get(optimizer) == count:  # (each optimizer looked at once, and after a new group)
            return
        self._checked[optimizer] = count
        if not any(ref() is not None for ref in self.old.values()):
            self.done = True  # every old parameter is gone: no optimizer can hold one (the hook
            self.old, self.new = {}, {}  # stays: removing it while torch iterates its hooks
            return  # would break the step)
        if self.holds_old(optimizer):
            raise ConfigurationError(
                f"this {type(optimizer).__name__} trains parameters of {self.name} that sharding "
                "(strategy='fsdp') replaced, and autoddp could not find it to bind it to the sharded "
                "ones: its steps would change nothing the model uses. Make the optimizer after "
                "model = autoddp.prepare(model), or keep it where the call reaches it (an argument, "
                "self.opt, a variable of the function)"
            )


def remember(model: torch.nn.Module, before: list[tuple[str, torch.Tensor]]) -> Replaced | None:
    """What the wrap of ``model`` replaced (``before``: its named parameters before), kept on it."""
    replaced = Replaced(model, before)
    if not replaced.old:
        return None
    model.__dict__[_REPLACED] = replaced
    replaced.watch()
    return replaced


def rebind_known(optimizers: Iterable[torch.optim.Optimizer], models: Iterable[torch.nn.Module]) -> None:
    """Bind each of ``optimizers`` to the parameters that wrapping replaced in ``models``."""
    replaced = [r for m in models if isinstance(r := m.__dict__.get(_REPLACED), Replaced)]
    for optimizer in optimizers if replaced else ():
        for each in replaced:
            each.rebind(optimizer)


def rebind_optimizers(replaced: Replaced | None, known: Iterable[torch.optim.Optimizer] = ()) -> None:
    """Every optimizer over a parameter a wrap ``replaced`` that can be found trains the new ones
    instead (module docstring)."""
    if replaced is None:
        return
    done: set[int] = set()
    for found in _candidates(known):
        if id(found) in done:
            continue
        done.add(id(found))
        if isinstance(found.__dict__.get("param_groups"), list):  # (None while one is being made)
            replaced.rebind(found)


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


def _rebind(optimizer: torch.optim.Optimizer, mapping: dict[int, torch.Tensor], name: str) -> None:
    stateful = any(id(p) in mapping and state for p, state in optimizer.state.items())
    full = optimizer.state_dict() if stateful else None  # (plain tensors: the unsharded model's)
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]
    for old in [p for p in optimizer.state if id(p) in mapping]:
        optimizer.state.pop(old)
    _fsdp_state.bind_optimizer(optimizer)
    if full is None:
        return
    try:
        optimizer.load_state_dict(full)  # (cut to this rank's shards by the bound load)
    except Exception as error:
        raise ConfigurationError(
            f"{name} was sharded after its {type(optimizer).__name__} had taken steps, "
            f"and autoddp could not carry the optimizer's state into the shards ({error}). Make the "
            "optimizer after autoddp.prepare(model) (or let autoddp find the model through it: make "
            "the optimizer first, inside the decorated function, without calling prepare)"
        ) from error
