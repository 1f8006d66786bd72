"""See, inside a forked worker, what autoddp's patches look like after the user's function returned.

A worker's last Python code after the user's function is ``running.portable`` on its result,
outside capture and the hang marks, on every rank: a result made by ``inspected`` runs its check
there, at its ``detach()``, and writes what it found to ``FOLDER/rank{R}.json``; the result
travels on as a plain tensor. The default check: which attributes autoddp ever patched in that
worker, which a unit replaces now, and which do not hold their original.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from autoddp import _patches


def registry_report() -> dict[str, list[str]]:
    """The engine's own account of this process's patches."""
    return {
        "patched": sorted(_patches.label(owner, name) for owner, name, _ in _patches.ever_patched()),
        "active": sorted(_patches.label(owner, name) for owner, name in _patches.active()),
        "unrestored": _patches.unrestored(),
    }


class Inspected(torch.Tensor):
    """A result that runs its check when autoddp readies it to travel."""

    folder = ""  # set in the worker, by ``inspected``
    check: Callable[[], Any] = staticmethod(registry_report)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            with open(os.path.join(cls.folder, f"rank{os.environ['RANK']}.json"), "w") as file:
                json.dump(cls.check(), file)
            return args[0].as_subclass(torch.Tensor).detach()
        return super().__torch_function__(func, types, args, kwargs or {})


def inspected(folder: str, check: Callable[[], Any] = registry_report) -> torch.Tensor:
    """A result whose workers write ``check()`` to ``folder`` after the call (make it in the function)."""
    Inspected.folder, Inspected.check = folder, staticmethod(check)
    return torch.zeros(1).as_subclass(Inspected)


def reports(folder: str, ranks: int = 2) -> list[Any]:
    """What each rank's worker found."""
    found = []
    for rank in range(ranks):
        with open(os.path.join(folder, f"rank{rank}.json")) as file:
            found.append(json.load(file))
    return found
