"""Collectives refused inside a ``rank0()`` body: only rank 0 runs it, so they could never complete.

While a body runs on rank 0, the collectives of ``torch.distributed``, the functional ones that
DTensor and FSDP2's state dicts gather through, DDP's buffer broadcast and ``autoddp.barrier`` are
replaced wherever a loaded ``torch.distributed`` module binds them (``_compat.collectives.sites``) by
stand-ins that raise ``CollectiveInRank0Error``; ``restore`` puts the originals back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch.distributed as dist

from autoddp.core import _compat, _patches
from autoddp.core._compat import collectives
from autoddp.core.errors import CollectiveInRank0Error


class _State:
    """Which body runs now (for messages) and the stand-ins, made again when modules were imported."""

    def __init__(self) -> None:
        self.running = ""
        self.refusals: list[tuple[ModuleType, str, Callable[..., Any]]] = []
        self.modules = -1  # len(sys.modules) when the stand-ins were made


_STATE = _State()

#: Said of a functional collective (DTensor's, so a sharded model's): how to gather outside the block.
_SHARDED_HINT = (
    " (a sharded model's (strategy='fsdp') or a DTensor's values are gathered this way: its "
    "state_dict() saved, autoddp.save(model, ...), or its weights read in full. Gather on every rank "
    "instead: call autoddp.save(model, path) outside the block (every rank gathers, rank 0 writes), "
    "or take state = autoddp.in_rank.models.state_dict(model) before it and use state inside)"
)


def refuse(where: str) -> _patches.Patches:
    """Put stand-ins that raise in place of the collectives while ``where`` runs; ``restore`` the unit."""
    _STATE.running = where
    if not _STATE.refusals or _STATE.modules != len(sys.modules):  # (a module imported since binds some)
        _STATE.refusals, _STATE.modules = _make_refusals(), len(sys.modules)
    return _patches.install(_STATE.refusals)


def restore(saved: _patches.Patches) -> None:
    """The collectives back (only where the stand-ins still stand)."""
    saved.restore()


def _make_refusals() -> list[tuple[ModuleType, str, Callable[..., Any]]]:
    """(module, name, stand-in) for every collective a body can reach by attribute (``collectives.sites``)."""
    _compat.ddp_buffer_broadcast()  # DDP's forward broadcasts buffers through it: refused too
    sharded = _compat.DTENSOR_MODULE in sys.modules  # (else nothing issues functional collectives)
    made = [
        (module, attribute, _refusal(f"{collectives.FUNCTIONAL_MODULE}.{name}", _SHARDED_HINT))
        if functional
        else (module, attribute, _refusal(f"torch.distributed.{name}"))
        for module, attribute, name, functional in collectives.sites(functional_too=sharded)
    ]
    made.append(
        (dist, _compat.DDP_BUFFER_BROADCAST, _refusal(f"torch.distributed.{_compat.DDP_BUFFER_BROADCAST}"))
    )
    for name in ("autoddp", "autoddp.in_rank.world"):
        module = sys.modules.get(name)
        if module is not None and vars(module).get("barrier") is not None:
            made.append((module, "barrier", _refusal("autoddp.barrier")))
    return made


def _refusal(qualified: str, hint: str = "") -> Callable[..., Any]:
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
