"""A model too large for one GPU waits in host memory until it is sharded (``strategy="auto"``).

A single-GPU script says ``model = Net().to("cuda")`` before it makes the optimizer. Where the
model's bytes alone are more than a process may use (``device_memory``), that move would fail on
every GPU although the sharded model fits: capture (``capture.too_large``) leaves the module in
host memory and marks it here with the device it was sent to. When the model is wrapped
(``settle``), FSDP2's ``fully_shard`` moves each unit to the GPU as it shards it, so a GPU holds
its shards plus one unit, never the whole model. A model that is not sharded after all (DDP, no
trainable parameters), or that runs a forward before it is wrapped (an evaluation model, a
summary before the optimizer), is moved whole then, as the user asked: what would have happened
without autoddp, out-of-memory error included.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

_ATTR = "_autoddp_placed_later"


@dataclass
class _Later:
    """Where ``module`` was sent (``target``), the move as torch makes it (``move(module)``), and
    the forward pre-hooks that make it before a forward of the module or of any module in it."""

    target: torch.device
    move: Callable[[torch.nn.Module], Any]
    handles: list[Any] = field(default_factory=list)


def defer(module: torch.nn.Module, target: torch.device, move: Callable[[torch.nn.Module], Any]) -> None:
    """Leave ``module`` where it is, to be moved to ``target`` by ``move`` when it is wrapped or runs."""
    later = _Later(target, move)
    module.__dict__[_ATTR] = later
    root = weakref.ref(module)

    def moved_before_forward(sub: torch.nn.Module, args: Any) -> None:
        whole = root()
        if whole is not None:
            settle(whole, sharded=False)

    for sub in module.modules():
        later.handles.append(sub.register_forward_pre_hook(moved_before_forward, prepend=True))


def pending(module: torch.nn.Module) -> torch.device | None:
    """The device ``module`` waits to be moved to, or None."""
    later = module.__dict__.get(_ATTR)
    return None if later is None else later.target


def settle(module: torch.nn.Module, sharded: bool) -> None:
    """``module`` is being wrapped: ``sharded``, FSDP moves its units (nothing to do); else it is
    moved whole now, as the user asked."""
    later = module.__dict__.pop(_ATTR, None)
    if later is None:
        return
    for handle in later.handles:
        handle.remove()
    if not sharded:
        later.move(module)
