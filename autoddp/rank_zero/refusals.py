"""Collectives refused inside a ``rank0()`` body: only rank 0 runs it, so they could never complete.

While a body runs on rank 0, the collectives of ``torch.distributed`` (and DDP's buffer
broadcast, and ``autoddp.barrier``) are replaced in their modules' namespaces by stand-ins that
raise ``CollectiveInRank0Error``; ``restore`` puts the originals back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch.distributed as dist

from autoddp import _compat, _patches
from autoddp.errors import CollectiveInRank0Error


class _State:
    """Which body runs now (for messages) and the stand-ins, made once."""

    def __init__(self) -> None:
        self.running = ""
        self.refusals: list[tuple[ModuleType, str, Callable[..., Any]]] = []


_STATE = _State()


def refuse(where: str) -> _patches.Patches:
    """Put stand-ins that raise in place of the collectives while ``where`` runs; ``restore`` the unit."""
    _STATE.running = where
    if not _STATE.refusals:
        _STATE.refusals = _make_refusals()
    return _patches.install(_STATE.refusals)


def restore(saved: _patches.Patches) -> None:
    """The collectives back (only where the stand-ins still stand)."""
    saved.restore()


def _make_refusals() -> list[tuple[ModuleType, str, Callable[..., Any]]]:
    """(module, name, stand-in) for every collective a body can reach by attribute."""
    _compat.ddp_buffer_broadcast()  # DDP's forward broadcasts buffers through it: refused too
    modules: list[tuple[ModuleType, tuple[str, ...], str]] = [
        (dist, (*_compat.COLLECTIVES, _compat.DDP_BUFFER_BROADCAST), "torch.distributed"),
        (dist.distributed_c10d, _compat.COLLECTIVES, "torch.distributed"),
    ]
    for name in ("autoddp", "autoddp.world"):
        module = sys.modules.get(name)
        if module is not None:
            modules.append((module, ("barrier",), "autoddp"))
    return [
        (module, name, _refusal(f"{label}.{name}"))
        for module, names, label in modules
        for name in names
        if vars(module).get(name) is not None
    ]


def _refusal(qualified: str) -> Callable[..., Any]:
    hint = ""
    if qualified.endswith(f".{_compat.DDP_BUFFER_BROADCAST}"):
        hint = (
            " (a DistributedDataParallel model's forward with gradients on syncs its buffers this way: "
            "inside the block, call the plain module, autoddp.unwrap(model), or run under torch.no_grad())"
        )

    def refusal(*args: Any, **kwargs: Any) -> Any:
        raise CollectiveInRank0Error(
            f"{qualified}() was called inside {_STATE.running}{hint}: only rank 0 runs that body, so "
            "the other ranks never join this collective and it would hang. Move the call out of the "
            "block, to where every rank makes it"
        )

    refusal.__name__ = refusal.__qualname__ = qualified.rsplit(".", 1)[1]
    return refusal
