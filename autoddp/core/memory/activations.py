"""The activations one forward keeps for its backward, measured on a copy of the model without memory.

The copy's parameters and buffers, and the batch, are fake tensors (``core._compat.fake``): shapes
on the real tensors' device with no memory behind them, whose operations take the paths of that
device's own kernels (plain meta tensors take other paths for some: attention saves its whole
weight matrix on meta, not on CPU or GPU). One forward runs with
``torch.autograd.graph.saved_tensors_hooks`` summing the bytes of every tensor autograd saves, each
storage once (a view and its base are one storage), the parameters', buffers' and batch's own left
out (they are counted elsewhere, or are the data's), plus the output's. Nothing of the real model
changes: not its weights, not its buffers (BatchNorm's statistics update the copy's), not the
random streams (restored after the forward).

Where fake tensors fail, the same forward runs on plain meta tensors; where that fails too (an
operation with no meta kernel, a model that reads values back with ``.item()``), the rule
``FALLBACK_PER_LAYER`` is taken, and the result says which.

What this does not see: workspaces a kernel sizes at run time (CPU's oneDNN LSTM saves one that
fake tensors show empty), and memory a kernel allocates and frees inside itself.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autoddp.core import _containers
from autoddp.core._compat import fake

#: The fallback: each module holding parameters keeps this many copies of the batch's bytes.
FALLBACK_PER_LAYER = 2


@dataclass(frozen=True)
class Activations:
    """What one forward keeps: ``saved`` (autograd's saved tensors and the output, in bytes),
    ``largest`` (the largest of them), and ``note`` (None where measured on fake tensors; else how)."""

    saved: int
    largest: int
    note: str | None = None


def measure(module: torch.nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None) -> Activations:
    """The activations one forward of ``module(*args, **kwargs)`` keeps (module docstring)."""
    batch = (tuple(args), dict(kwargs or {}))
    try:
        mode = fake.fake_tensor_mode()
        return _saved_by_forward(module, batch, mode.from_tensor, mode)
    except Exception as error:
        fake_error = _reason(error)
    try:
        found = _saved_by_forward(module, batch, _meta, contextlib.nullcontext())
        note = f"measured on meta tensors: fake tensors failed ({fake_error})"
        return Activations(found.saved, found.largest, note)
    except Exception as error:  # no meta kernel, a value read back, a module that cannot be copied
        layers = sum(1 for m in module.modules() if any(True for _ in m.parameters(recurse=False)))
        bytes_in = sum(t.numel() * t.element_size() for t in tensors_in(batch))
        return Activations(
            FALLBACK_PER_LAYER * max(layers, 1) * bytes_in,
            bytes_in,
            f"the forward could not run without memory ({_reason(error)}): activations taken as "
            f"{FALLBACK_PER_LAYER} copies of the batch per layer with parameters ({layers})",
        )


def _reason(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"[:200]


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="meta")


def copy_with(module: torch.nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers are ``make(tensor)`` (fake or meta: no memory)."""
    memo: dict[int, Any] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        made = make(tensor.detach())
        memo[id(tensor)] = (
            torch.nn.Parameter(made, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else made
        )
    return copy.deepcopy(module, memo)


def _saved_by_forward(
    module: torch.nn.Module,
    batch: tuple[tuple, dict],
    make: Callable[[torch.Tensor], torch.Tensor],
    mode: Any,
) -> Activations:
    """Run the forward of a copy made by ``make`` under ``mode``, summing what autograd saves."""
    copied = copy_with(module, make)
    args, kwargs = mapped(batch, make)
    held = (*copied.parameters(), *copied.buffers(), *tensors_in((args, kwargs)))
    own = [t.untyped_storage() for t in held]
    left_out = {id(storage) for storage in own}
    counted: dict[int, int] = {}
    keep: list[Any] = []  # the storages counted stay alive, so that no id is reused during the forward

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if id(storage) not in left_out:
            keep.append(storage)
            counted[id(storage)] = storage.nbytes()
        return tensor

    with torch.random.fork_rng(devices=_gpus(module)), torch.enable_grad(), mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            output = copied(*args, **kwargs)
        for tensor in tensors_in(output):
            pack(tensor)
    return Activations(sum(counted.values()), max(counted.values(), default=0))


def _gpus(module: torch.nn.Module) -> list[int]:
    """The CUDA devices the module's tensors are on: their random streams are kept too."""
    return sorted({t.device.index or 0 for t in (*module.parameters(), *module.buffers()) if t.is_cuda})


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def mapped(value: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor in it replaced by ``make(tensor)`` (its containers walked by
    ``_containers.map_items``, each of its own type)."""
    if torch.is_tensor(value):
        return make(value.detach()).requires_grad_(value.requires_grad)
    return _containers.map_items(value, lambda item: mapped(item, make))


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, however deep in its containers (``_containers.leaves``)."""
    return [item for item in _containers.leaves(value) if torch.is_tensor(item)]
