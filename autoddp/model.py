"""Model wrapping: move to the device, wrap in DDP, keep the user's module transparent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from autoddp.world import World


def wrap_model(
    module: torch.nn.Module,
    world: World,
    *,
    ddp_kwargs: Mapping[str, Any] | None = None,
    sync_batchnorm: bool = False,
) -> torch.nn.Module:
    """Return ``module`` on this process's device, gradient-synchronised when the world has more
    than one process (placeholder: device placement only)."""
    return module.to(world.device)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's plain module behind DDP and ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model
