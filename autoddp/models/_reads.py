"""Values read from sharded (FSDP) tensors are the full tensor's, as one process would read them.

FSDP2 keeps each parameter as a DTensor sharded on dim 0, and what user code computes from it
(``w.norm()``, ``w.sum()``, a state dict's values) is a DTensor too, often with a pending
reduction. Torch turns a DTensor into a Python value from this rank's local part only: in
torch 2.13 ``w.norm().item()`` is the norm of this rank's shard (a silently different number), and
``tolist()``/``numpy()`` raise. While autoddp has a model sharded, ``install`` makes those exits
(``item``, ``tolist``, ``numpy``, ``float()``, ``int()``, ``bool()``, ``print``, f-strings) read the
full tensor (``DTensor.full_tensor``, public): a collective, so every rank reads the value, as
every rank runs the same code. Tensor computations are untouched: nothing costs the training step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from autoddp import _patches

#: The ways a tensor's values leave torch as Python values.
EXITS = (
    *("item", "tolist", "numpy", "__float__", "__int__", "__index__", "__complex__", "__bool__"),
    "__format__",
)
#: The whole reads, while installed (DTensor's own methods come back with ``uninstall``).
_READS = _patches.Patches()


def _full(tensor: Any) -> torch.Tensor:
    """The whole tensor behind a DTensor, as a plain tensor (every rank calls it)."""
    with torch.no_grad():
        return tensor.full_tensor()


def _reading(name: str) -> Callable[..., Any]:
    plain = getattr(torch.Tensor, name)

    @functools.wraps(plain)
    def read(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        return plain(_full(self), *args, **kwargs)

    return read


def _repr(self: Any, /, *args: Any, **kwargs: Any) -> str:
    full = _full(self).requires_grad_(self.requires_grad)  # (a new leaf: shown as one process shows it)
    text = torch.Tensor.__repr__(full, *args, **kwargs)
    return f"Parameter containing:\n{text}" if isinstance(self, torch.nn.Parameter) else text


def install() -> None:
    """Read DTensors whole from now on (idempotent)."""
    from torch.distributed.tensor import DTensor

    if _READS.installed:
        return
    _READS.install([*((DTensor, name, _reading(name)) for name in EXITS), (DTensor, "__repr__", _repr)])


def uninstall() -> None:
    """Give DTensor its own reads back (idempotent)."""
    _READS.restore()
