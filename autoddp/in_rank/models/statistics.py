"""Statistics a model keeps in buffers, which DDP does not average: said once, with the fix.

BatchNorm's running statistics are known by their class and hinted where the model is wrapped.
Any other buffer that the forward updates (a running normaliser in RL or tabular code) is seen at
the first forwards through the DDP: each process updates it from its own part of the batch, and
DDP gives every process rank 0's before the next forward (``broadcast_buffers``), so it is not the
value one process computes over the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autoddp.core import _compat, _warn

#: BatchNorm layers (torch's public classes) whose statistics stay per process without sync_batchnorm.
BATCHNORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.LazyBatchNorm1d,
    torch.nn.LazyBatchNorm2d,
    torch.nn.LazyBatchNorm3d,
)


def batchnorm_hint(name: str, device: str) -> str:
    """The hint for a model with BatchNorm layers: per-process statistics, and what to do on ``device``."""
    text = f"{name} has BatchNorm layers: each process normalises with the statistics of its own batch. "
    if device.startswith("cuda"):
        return text + "Pass sync_batchnorm=True to @distributed to synchronise them across processes."
    return text + (
        "torch's SyncBatchNorm runs on CUDA only, so CPU processes keep per-process statistics; "
        "if that matters, use larger per-process batches or GroupNorm/LayerNorm."
    )


class UpdatedBuffers:
    """Looks, in the first forwards through the DDP, for buffers the forward changed in place."""

    #: Forwards looked at: a buffer updated at every training step shows at the first.
    LOOKS = 3

    def __init__(self, rank: int) -> None:
        self.looks = self.LOOKS if rank == 0 else 0  # said by rank 0 only: every rank would say the same
        #: Whether the next forward is still looked at (after that, the forward costs nothing): a
        #: plain attribute, read at every forward through the DDP (no property call there).
        self.looking = self.looks > 0

    def around(self, module: torch.nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run the module's own ``forward`` (inside DDP's, after its buffer broadcast) and look."""
        self.looks -= 1
        self.looking = self.looks > 0
        versions = {name: _compat.version(buffer) for name, buffer in _own_statistics(module)}
        result = forward(module, *args, **kwargs)
        self._say_changed(module, versions)
        return result

    def _say_changed(self, module: torch.nn.Module, versions: dict[str, int]) -> None:
        """Say, once, which buffers the forward changed since ``versions`` were read."""
        changed = [
            name for name, buffer in _own_statistics(module) if versions.get(name) != _compat.version(buffer)
        ]
        if not changed:
            return
        self.looks, self.looking = 0, False
        named = ", ".join(changed[:4]) + (" ..." if len(changed) > 4 else "")
        _warn.warn(
            f"{type(module).__name__}'s forward updates buffers ({named}), running statistics that DDP "
            "does not average: each process updates them from its own part of the batch and DDP gives "
            "every process rank 0's before each forward, so they differ from one process's, computed "
            "over the whole batch. If that matters, update them from the global batch: all-reduce the "
            "batch's sums and counts across processes (torch.distributed.all_reduce) before the update"
        )


def _own_statistics(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's buffers outside BatchNorm layers (hinted on their own), by qualified name."""
    found = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, (*BATCHNORMS, torch.nn.SyncBatchNorm)):
            continue
        for name, buffer in sub.named_buffers(recurse=False):
            found.append((f"{prefix}.{name}" if prefix else name, buffer))
    return found
