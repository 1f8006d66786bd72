"""The model-strategy seam: everything autoddp does to a model, behind one small interface.

A strategy wraps a module for the current world and can undo or export what it did. DDP is the
first implementation (``autoddp.in_rank.models.ddp``); a sharded strategy fits the same methods, where
``state_dict`` and ``portable`` may be collectives (every rank calls them, ``save`` and the
result transport do). The base class is also the behaviour of a plain, unwrapped module.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from autoddp.core.state import RunOptions, World


class Strategy:
    """How models are distributed; one stateless instance per strategy."""

    name: ClassVar[str] = "none"

    def wrap(
        self, module: torch.nn.Module, world: World, options: RunOptions, *, move: bool = True
    ) -> torch.nn.Module:
        """``module`` distributed across ``world`` (the same object if it can), moved to this
        process's device unless ``move`` is False."""
        raise NotImplementedError

    def distributed(self, model: torch.nn.Module) -> bool:
        """True when this strategy already distributes ``model`` in the current world."""
        return False

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's own module behind what ``wrap`` did."""
        return model

    def release(self, model: torch.nn.Module) -> None:
        """Let go of the process group (called before it is destroyed); the model stays usable."""

    def state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The model's full, plain state dict (the user's keys, ordinary tensors). Every rank calls it."""
        return self.unwrap(model).state_dict()

    def portable(self, model: torch.nn.Module, keep: bool = True) -> torch.nn.Module:
        """The model fit to travel to another process: plain, on the CPU. Every rank calls it.

        ``keep=False`` (a rank whose result does not travel): only the collectives a copy on
        another rank needs, no copy here; the model comes back as it is.
        """
        return self.unwrap(model).cpu() if keep else model


#: What a module nobody wrapped gets.
PLAIN = Strategy()
