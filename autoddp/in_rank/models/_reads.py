"""Values read from sharded (FSDP) tensors are the full tensor's, as one process would read them.

FSDP2 keeps each parameter as a DTensor sharded on dim 0, and what user code computes from it
(``w.norm()``, ``w.sum()``, a state dict's values) is a DTensor too, often with a pending
reduction. Torch turns a DTensor into a Python value from this rank's local part only: in
torch 2.13 ``w.norm().item()`` is the norm of this rank's shard (a silently different number), and
``tolist()``/``numpy()`` raise. While autoddp has a model sharded, ``install`` makes those exits
(``item``, ``tolist``, ``numpy``, ``float()``, ``int()``, ``bool()``, ``print``, f-strings) read the
full tensor (``DTensor.full_tensor``, public): a collective, so every rank reads the value, as
every rank runs the same code.

The operations DTensor cannot run on shards (``p.flatten()`` of an uneven shard, ``for row in p``,
``ema.copy_(p)`` or ``torch.equal(p, plain)`` that mix a plain tensor in) raise in torch; while
installed, DTensor's ``__torch_function__`` catches exactly those refusals and runs the operation
as one process would: on the full tensors (a read: a plain result, read-only unless it carries a
gradient, so that a write through a view of a gathered copy raises instead of vanishing), or, when
it writes into a sharded tensor (``p.copy_(plain)``), with the plain operands taken as rank 0's
and laid out like the target. Everything DTensor runs itself (the optimizer's step, FSDP's own
work) goes through unchanged: the cost is one Python call per DTensor operation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from autoddp.core import _containers, _patches

#: The ways a tensor's values leave torch as Python values.
EXITS = (
    *("item", "tolist", "numpy", "__float__", "__int__", "__index__", "__complex__", "__bool__"),
    "__format__",
)


class _Installed:
    """The whole reads while installed (DTensor's own methods come back with ``uninstall``), and
    DTensor's own ``__torch_function__`` put back for the length of each optimizer step (its
    operations on the shards all run: a Python call each would only cost)."""

    def __init__(self) -> None:
        self.reads = _patches.Patches()
        self.step = _patches.Patches()
        self.own: Any = None
        self.hooks: list[Any] = []


_READS = _Installed()


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


#: What torch says when DTensor cannot run an operation on the shards as they lie.
_NOT_ON_SHARDS = ("Sharding propagation failed", "got mixed torch.Tensor and DTensor")


def _as_one_process(plain: Any) -> Any:
    """DTensor's ``__torch_function__``: ``plain`` (DTensor's own), else what one process computes."""

    def torch_function(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_grad_enabled() and _mixes_in_a_gradient(args, kwargs):
            return _on_full_tensors(
                func, args, kwargs
            )  # (DTensor would hand the plain graph DTensor gradients)
        try:
            return plain(func, types, args, kwargs)
        except RuntimeError as error:
            if not any(text in str(error) for text in _NOT_ON_SHARDS) or torch.compiler.is_compiling():
                raise
        target = _written(func, args, kwargs)
        if target is not None and _is_dtensor(target):
            return plain(func, types, *_onto(target, args, kwargs))
        return _on_full_tensors(func, args, kwargs)

    return classmethod(torch_function)


def _mixes_in_a_gradient(args: Any, kwargs: dict) -> bool:
    """A plain tensor that requires a gradient meets a DTensor (a loss plus a parameters' penalty)."""
    values = list(_containers.leaves((args, kwargs)))
    dtensors = [_is_dtensor(v) for v in values]  # (first: a DTensor's attributes come back through here)
    return any(dtensors) and any(
        not is_d and isinstance(v, torch.Tensor) and v.requires_grad
        for v, is_d in zip(values, dtensors, strict=True)
    )


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _written(func: Any, args: Any, kwargs: dict) -> Any:
    """The tensor ``func`` writes into (an in-place method's self, ``out=``), or None."""
    name = getattr(func, "__name__", "")
    if kwargs.get("out") is not None:
        return kwargs["out"]
    in_place = (name.endswith("_") and not name.endswith("__")) or name == "__setitem__"
    in_place = in_place or (name.startswith("__i") and name[3:-2] in _AUGMENTED)
    return args[0] if in_place and args else None


_AUGMENTED = {
    "add",
    "sub",
    "mul",
    "truediv",
    "floordiv",
    "mod",
    "pow",
    "and",
    "or",
    "xor",
    "lshift",
    "rshift",
    "matmul",
}


def _onto(target: Any, args: Any, kwargs: dict) -> tuple[Any, dict]:
    """Plain tensor operands as DTensors laid out like ``target``: rank 0's values (one process's)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    def lay(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not _is_dtensor(value) and value.dim() > 0:
            replicated = [Replicate()] * target.device_mesh.ndim
            return distribute_tensor(value.to(target.device), target.device_mesh, replicated, src_data_rank=0)
        return value

    return _deep(args, lay), _deep(kwargs, lay)


def _deep(obj: Any, fn: Any) -> Any:
    """``obj`` with ``fn`` applied to every item that is not a container, however deep."""
    walked = _containers.map_items(obj, lambda item: _deep(item, fn))
    return fn(obj) if walked is obj and not isinstance(obj, (list, tuple, dict)) else walked


def _on_full_tensors(func: Any, args: Any, kwargs: dict) -> Any:
    """``func`` on the full tensors behind every DTensor operand (every rank gathers them).

    With a gradient to carry (an operand requires it, grad mode on), the gather stays in the
    graph: a backward through the result reaches the shards. Otherwise the result is an
    inference tensor: read freely, but written in place it raises (a gathered copy is no view).
    """
    grad = torch.is_grad_enabled() and any(
        _is_dtensor(v) and v.requires_grad for v in _containers.leaves((args, kwargs))
    )
    context = contextlib.nullcontext() if grad else torch.inference_mode()
    with context:
        whole = _deep((args, kwargs), lambda v: v.full_tensor() if _is_dtensor(v) else v)
        return func(*whole[0], **whole[1])


def install() -> None:
    """Read DTensors whole from now on (idempotent)."""
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    if _READS.reads.installed:
        return
    _READS.own = vars(DTensor)["__torch_function__"]
    _READS.reads.install(
        [
            *((DTensor, name, _reading(name)) for name in EXITS),
            (DTensor, "__repr__", _repr),
            (DTensor, "__torch_function__", _as_one_process(_READS.own)),
        ]
    )
    _READS.hooks = [
        register_optimizer_step_pre_hook(_step_begins),
        register_optimizer_step_post_hook(_step_ends),
    ]


def _step_begins(optimizer: Any, args: Any, kwargs: Any) -> None:
    from torch.distributed.tensor import DTensor

    if _READS.reads.installed and not _READS.step.installed:
        _READS.step.install([(DTensor, "__torch_function__", _READS.own)])


def _step_ends(optimizer: Any, args: Any, kwargs: Any) -> None:
    _READS.step.restore()


def uninstall() -> None:
    """Give DTensor its own reads back (idempotent)."""
    for hook in _READS.hooks:
        hook.remove()
    _READS.hooks = []
    _READS.step.restore()
    _READS.reads.restore()
