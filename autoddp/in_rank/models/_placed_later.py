"""A model too large for one GPU waits in host memory until it is sharded (``strategy="auto"``).

A single-GPU script says ``model = Net().to("cuda")`` before it makes the optimizer. Where the
model's bytes alone are more than a process may use (``device_memory``), that move would fail on
every GPU although the sharded model fits: capture (``capture.too_large``) leaves the module in
host memory and records it here (``CURRENT.placed_later``) with the device it was sent to. When a
model is wrapped (``settle``), FSDP2's ``fully_shard`` moves each unit to the GPU as it shards it,
so a GPU holds its shards plus one unit, never the whole model; what waits outside the sharded
model (a parent of it) is moved then. A model that is not sharded after all (DDP, no trainable
parameters), or that runs a forward before it is wrapped (an evaluation model, a summary before
the optimizer: one global forward pre-hook, there while anything waits, sees any module in it),
is moved whole then, as the user asked: what would have happened without autoddp, out-of-memory
error included. ``.cpu()`` or ``.to("cpu")`` takes it off the list. Nothing is kept on the module
itself: a copy (an EMA's ``deepcopy``) or a pickle of it is a plain host module.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autoddp.core.state import CURRENT


@dataclass
class _Later:
    """Where a module was sent (``target``), and the move as torch makes it (``move(module)``)."""

    target: torch.device
    move: Callable[[torch.nn.Module], Any]


def defer(module: torch.nn.Module, target: torch.device, move: Callable[[torch.nn.Module], Any]) -> None:
    """Leave ``module`` where it is, to be moved to ``target`` by ``move`` when it is wrapped or runs."""
    CURRENT.placed_later[module] = _Later(target, move)
    root = weakref.ref(module)
    for sub in module.modules():
        CURRENT.placed_within[sub] = root
    if CURRENT.placed_later_hook is None:
        CURRENT.placed_later_hook = torch.nn.modules.module.register_module_forward_pre_hook(_before_forward)


def pending(module: torch.nn.Module) -> torch.device | None:
    """The device ``module`` waits to be moved to, or None."""
    later = CURRENT.placed_later.get(module)
    return None if later is None else later.target


def cancel(module: torch.nn.Module) -> None:
    """``module`` (or a part of one) was sent back to the host: nothing of it waits any more."""
    mine = _tensors(module)
    for root in list(CURRENT.placed_later):
        if _tensors(root) & mine or root is module:
            _forget(root)
    _unhook_when_done()


def settle(module: torch.nn.Module, sharded: bool) -> None:
    """``module`` is being wrapped: where ``sharded``, FSDP moves its units, and what waits beside
    it (the rest of a parent that was sent) is moved now; else every waiting module that shares
    its tensors is moved whole now, as asked."""
    mine = _tensors(module)
    for root in list(CURRENT.placed_later):
        later = CURRENT.placed_later.get(root)
        theirs = _tensors(root)
        if later is None or not (theirs & mine or root is module):
            continue
        _forget(root)
        if not sharded:
            later.move(root)
        elif not theirs <= mine:  # a parent was sent: all of it but the model
            _move_around(root, mine, later)
    _unhook_when_done()


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    """Any module's forward, while something waits: the waiting model it belongs to is moved whole."""
    ref = CURRENT.placed_within.get(module)
    root = ref() if ref is not None else None
    later = CURRENT.placed_later.get(root) if root is not None else None
    if later is not None:
        _forget(root)
        later.move(root)
        _unhook_when_done()


def _forget(root: torch.nn.Module) -> None:
    CURRENT.placed_later.pop(root, None)
    for sub in root.modules():
        ref = CURRENT.placed_within.get(sub)
        if ref is not None and ref() is root:
            del CURRENT.placed_within[sub]


def _tensors(module: torch.nn.Module) -> set[int]:
    return {id(t) for t in (*module.parameters(), *module.buffers())}


def _move_around(root: torch.nn.Module, sharded: set[int], later: _Later) -> None:
    """Every tensor of ``root`` not among the ``sharded`` model's (FSDP moves those) to ``later.target``."""
    for child in root.children():
        theirs = _tensors(child)
        if theirs <= sharded:
            continue
        if theirs & sharded:
            _move_around(child, sharded, later)
        else:
            later.move(child)
    with torch.no_grad():
        for param in root.parameters(recurse=False):
            if id(param) not in sharded:
                param.data = param.data.to(later.target)
        for name, buffer in list(root.named_buffers(recurse=False)):
            if id(buffer) not in sharded:
                setattr(root, name, buffer.to(later.target))


def _unhook_when_done() -> None:
    if not CURRENT.placed_later and CURRENT.placed_later_hook is not None:
        CURRENT.placed_within.clear()
        CURRENT.placed_later_hook.remove()
        CURRENT.placed_later_hook = None
