"""The DDP strategy: move to the device, wrap in DDP, and keep the user's module transparent.

The object the user gets back is their own module: its class is swapped for a cached subclass
whose ``__call__`` goes through DistributedDataParallel when gradients are being recorded. So
``isinstance`` holds, attributes read and write the module itself, ``state_dict`` keys have no
``module.`` prefix, ``model.to(...)``/``.train()`` return the same wrapped object, and a user
method that calls ``self(x)`` is synchronised too. Pickling, ``torch.save(model)`` and
``copy.deepcopy`` give a plain copy of the user's class. Only a direct ``model.forward(x)``
bypasses DDP.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from autoddp import _compat
from autoddp.errors import ConfigurationError
from autoddp.models.strategy import Strategy
from autoddp.state import CURRENT, RunOptions, World

_DDP_ATTR = "_autoddp_ddp"

#: BatchNorm layers (torch's public classes) whose statistics stay per process without sync_batchnorm.
_BATCHNORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.LazyBatchNorm1d,
    torch.nn.LazyBatchNorm2d,
    torch.nn.LazyBatchNorm3d,
)


class _Routing(threading.local):
    """Per-thread state of the call routing: inside DDP's forward, and how many DDP calls ran."""

    inside = False
    calls = 0


_ROUTING = _Routing()


def wrap_model(
    module: torch.nn.Module,
    world: World,
    *,
    ddp_kwargs: Mapping[str, Any] | None = None,
    sync_batchnorm: bool = False,
) -> torch.nn.Module:
    """Return ``module`` on this process's device, its gradients synchronised across the world.

    With one process, or a model with nothing to train, the module is only moved. A model that
    is already wrapped (by autoddp or in a DistributedDataParallel) is returned unchanged.
    """
    if is_wrapped(module) or isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return module
    compiled = _compat.compiled_parts(module)
    if compiled is not None:  # torch.compile(model): wrap the real module, keep its compilation
        inner, dynamo_ctx = compiled
        _compat.compile_in_place(inner, dynamo_ctx)
        module = inner
    if world.world_size > 1 and sync_batchnorm:
        if not world.device.startswith("cuda"):
            raise ConfigurationError(
                "sync_batchnorm=True needs CUDA devices: torch's SyncBatchNorm does not run on the CPU. "
                "Leave it off for CPU (gloo) runs."
            )
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if not _on_device(module, world.device):
        module = module.to(world.device)
    if world.world_size == 1 or not any(p.requires_grad for p in module.parameters()):
        return module
    if not sync_batchnorm and any(isinstance(m, _BATCHNORMS) for m in module.modules()):
        warnings.warn(
            f"{type(module).__name__} has BatchNorm layers: each process normalises with the statistics "
            "of its own batch. Pass sync_batchnorm=True to @distributed to synchronise them.",
            UserWarning,
            stacklevel=4,
        )
    device_ids = [torch.device(world.device).index] if world.device.startswith("cuda") else None
    ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids, **dict(ddp_kwargs or {}))
    object.__setattr__(module, _DDP_ATTR, ddp)
    module.__class__ = _wrapped_class(type(module))
    CURRENT.track(module, DDP)
    return module


def _on_device(module: torch.nn.Module, device: str) -> bool:
    """True when every parameter and buffer already lives on ``device`` (``.to`` would be a no-op)."""
    target = torch.device(device)
    tensors = [*module.parameters(), *module.buffers()]
    return all(t.device == target or (target.index is None and t.device.type == target.type) for t in tensors)


def is_wrapped(model: Any) -> bool:
    """True for a module that autoddp wrapped in DDP."""
    return isinstance(model, torch.nn.Module) and _DDP_ATTR in model.__dict__


def ddp_of(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel behind a wrapped module (None if it is not wrapped)."""
    return model.__dict__.get(_DDP_ATTR)


def release(model: torch.nn.Module) -> None:
    """Detach the DDP wrapper from ``model`` (before its process group is destroyed).

    Freeing a DDP wrapper after ``destroy_process_group`` can deadlock gloo, so the group's
    lifecycle releases every wrapped model first; the module is then plain again.
    """
    if is_wrapped(model):
        del model.__dict__[_DDP_ATTR]
        model.__class__ = model.__class__._autoddp_plain_class


# --- the swapped class --------------------------------------------------------------------


def _call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    plain = type(self)._autoddp_plain_class
    ddp = self.__dict__.get(_DDP_ATTR)
    if ddp is None or _ROUTING.inside or not torch.is_grad_enabled():
        return plain.__call__(self, *args, **kwargs)
    _ROUTING.inside = True
    _ROUTING.calls += 1
    try:
        return ddp(*args, **kwargs)
    finally:
        _ROUTING.inside = False


def _reduce_ex(self: torch.nn.Module, protocol: int) -> tuple:
    plain = type(self)._autoddp_plain_class
    getstate = getattr(plain, "__getstate__", None)
    state = getstate(self) if getstate is not None and getstate is not object.__getstate__ else None
    if state is None:
        state = self.__dict__
    if isinstance(state, dict):
        state = {key: value for key, value in state.items() if key != _DDP_ATTR}
    return (_new_plain, (plain,), state)


def _new_plain(cls: type) -> Any:
    return cls.__new__(cls)


def _no_sync(self: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Skip gradient synchronisation inside the block (gradient accumulation); DDP's ``no_sync``."""
    ddp = self.__dict__.get(_DDP_ATTR)
    return ddp.no_sync() if ddp is not None else contextlib.nullcontext()


def _watched(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a user method so that computing with gradients while bypassing DDP warns once."""

    @functools.wraps(method)
    def watched(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _ROUTING.inside or not torch.is_grad_enabled() or _DDP_ATTR not in self.__dict__:
            return method(self, *args, **kwargs)
        calls = _ROUTING.calls
        result = method(self, *args, **kwargs)
        if _ROUTING.calls == calls and _carries_grad(result):
            warnings.warn(
                f"{type(self).__name__}.{name}() computed a result with gradients without calling the "
                f"model itself, so DDP did not see it and will not synchronise those gradients across "
                f"processes. Call self(...) inside {name}(), or compute through the model's forward.",
                UserWarning,
                stacklevel=2,
            )
        return result

    return watched


def _carries_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.grad_fn is not None
    if isinstance(value, (list, tuple)):
        return any(_carries_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_carries_grad(v) for v in value.values())
    return False


def _user_methods(cls: type) -> Iterator[tuple[str, Callable[..., Any]]]:
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass is torch.nn.Module or not issubclass(klass, torch.nn.Module):
            break
        for name, attr in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if isinstance(attr, types.FunctionType) and not name.startswith("_") and name != "forward":
                yield name, attr


@functools.cache
def _wrapped_class(cls: type) -> type:
    """A subclass of ``cls`` with the same name whose calls go through the instance's DDP."""
    namespace: dict[str, Any] = {
        "__call__": _call,
        "__reduce_ex__": _reduce_ex,
        "no_sync": _no_sync,
        "_autoddp_plain_class": cls,
        "_autoddp_strategy": DDP,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    for name, method in _user_methods(cls):
        namespace[name] = _watched(name, method)
    return types.new_class(cls.__name__, (cls,), exec_body=lambda ns: ns.update(namespace))


class DDPStrategy(Strategy):
    """DistributedDataParallel behind the user's own module (class swap, see the module docstring)."""

    name = "ddp"

    def wrap(self, module: torch.nn.Module, world: World, options: RunOptions) -> torch.nn.Module:
        return wrap_model(module, world, ddp_kwargs=options.ddp_kwargs, sync_batchnorm=options.sync_batchnorm)

    def release(self, model: torch.nn.Module) -> None:
        release(model)


DDP = DDPStrategy()
