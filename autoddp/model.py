"""Model wrapping: the plain module behind whatever wrapped it."""

from __future__ import annotations

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's plain module behind DDP and ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model
