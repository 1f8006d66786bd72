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
import dataclasses
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
    ``largest`` (the largest of them), ``note`` (None where measured on fake tensors; else how),
    and ``checkpointed``: what it keeps with the ``units`` given to ``measure`` checkpointed
    (their inputs instead of what they save, plus the most one of them saves while it runs again
    in the backward pass; ``saved`` where no units were given)."""

    saved: int
    largest: int
    note: str | None = None
    checkpointed: int = 0
    #: Whether the forward ran (on fake or meta tensors): False where the rule was taken.
    ran: bool = True


def measure(
    module: torch.nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    rows: int | None = None,
    units: tuple[torch.nn.Module, ...] = (),
) -> Activations:
    """The activations one forward of ``module(*args, **kwargs)`` keeps (module docstring).

    ``rows``: the batch's tensors, each given with one row (a first dimension of 1), stand for
    ``rows`` rows (grown without memory). ``units``: modules of ``module`` whose checkpointing is
    weighed too (``Activations.checkpointed``).
    """
    batch = (tuple(args), dict(kwargs or {}))
    try:
        mode = fake.fake_tensor_mode()
        grown = _grown(mode.from_tensor, rows, mode)
        return _saved_by_forward(module, batch, mode.from_tensor, mode, units, grown)
    except Exception as error:
        fake_error = _reason(error)
    try:
        found = _saved_by_forward(
            module, batch, _meta, contextlib.nullcontext(), units, _grown(_meta, rows, None)
        )
        note = f"measured on meta tensors: fake tensors failed ({fake_error})"
        return dataclasses.replace(found, note=note)
    except Exception as error:  # no meta kernel, a value read back, a module that cannot be copied
        layers = sum(1 for m in module.modules() if any(True for _ in m.parameters(recurse=False)))
        bytes_in = sum(t.numel() * t.element_size() for t in tensors_in(batch))
        saved = FALLBACK_PER_LAYER * max(layers, 1) * bytes_in
        return Activations(
            saved,
            bytes_in,
            f"the forward could not run without memory ({_reason(error)}): activations taken as "
            f"{FALLBACK_PER_LAYER} copies of the batch per layer with parameters ({layers})",
            checkpointed=saved,
            ran=False,
        )


def _grown(
    make: Callable[[torch.Tensor], torch.Tensor], rows: int | None, mode: Any
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``make``, whose tensors of one row stand for ``rows`` rows (a new contiguous tensor without
    memory: fake or meta) where ``rows`` is given; ``make`` itself otherwise."""
    if rows is None:
        return make

    def grown(tensor: torch.Tensor) -> torch.Tensor:
        made = make(tensor)
        if made.dim() == 0 or made.shape[0] != 1:
            return made
        with mode if mode is not None else contextlib.nullcontext():
            return made.expand(rows, *made.shape[1:]).contiguous()

    return grown


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
    units: tuple[torch.nn.Module, ...] = (),
    make_batch: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Activations:
    """Run the forward of a copy made by ``make`` under ``mode`` on the batch made by ``make_batch``
    (``make`` too by default), summing what autograd saves (and, for each of ``units``, what it
    saves and what it is given)."""
    copied = copy_with(module, make)
    args, kwargs = mapped(batch, make_batch or make)
    held = (*copied.parameters(), *copied.buffers(), *tensors_in((args, kwargs)))
    own = [t.untyped_storage() for t in held]
    left_out = {id(storage) for storage in own}
    counted: dict[int, int] = {}
    keep: list[Any] = []  # the storages counted stay alive, so that no id is reused during the forward
    running = [0]  # the bytes counted so far

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if id(storage) not in left_out and id(storage) not in counted:
            keep.append(storage)
            counted[id(storage)] = storage.nbytes()
            running[0] += storage.nbytes()
        return tensor

    watch = _UnitWatch(module, copied, units, running)
    try:
        with torch.random.fork_rng(devices=_gpus(module)), torch.enable_grad(), mode:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                output = copied(*args, **kwargs)
            for tensor in tensors_in(output):
                pack(tensor)
    finally:
        watch.remove()
    saved = running[0]
    checkpointed = saved - sum(watch.saved) + sum(watch.given) + max(watch.saved, default=0)
    return Activations(saved, max(counted.values(), default=0), checkpointed=checkpointed)


class _UnitWatch:
    """Forward hooks on the copies of ``units`` in ``copied``: the bytes each saved, and those it was
    given (what checkpointing keeps of it), counted from ``running``."""

    def __init__(
        self,
        module: torch.nn.Module,
        copied: torch.nn.Module,
        units: tuple[torch.nn.Module, ...],
        running: list[int],
    ) -> None:
        names = {id(sub): name for name, sub in module.named_modules(remove_duplicate=False)}
        copies = dict(copied.named_modules(remove_duplicate=False))
        self.saved: list[int] = []
        self.given: list[int] = []
        self._handles: list[Any] = []
        for unit in units:
            if id(unit) not in names or unit is module:
                continue
            twin = copies[names[id(unit)]]
            self._handles.append(twin.register_forward_pre_hook(self._before(running)))
            self._handles.append(twin.register_forward_hook(self._after(running)))
        self._at: list[int] = []

    def _before(self, running: list[int]) -> Callable[..., None]:
        def before(unit: torch.nn.Module, args: Any) -> None:
            self._at.append(running[0])
            self.given.append(sum({id(t.untyped_storage()): t.nbytes for t in tensors_in(args)}.values()))

        return before

    def _after(self, running: list[int]) -> Callable[..., None]:
        def after(unit: torch.nn.Module, args: Any, output: Any) -> None:
            self.saved.append(running[0] - self._at.pop())

        return after

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


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
