"""Fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``): tensors with a shape, a dtype and
a device but no memory, whose operations take the paths of that device's own kernels (unlike plain
meta tensors, whose composite operations may decompose otherwise: attention, for one). The memory
estimate runs one training step of a copy of the model on them (``core.memory.tracker``), watching
the tensors each operation makes (``new_tensors_watch``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from autoddp.core._compat import _need


def fake_tensor_mode() -> Any:
    """A new mode in which tensors made by ``mode.from_tensor(t)`` and every operation on them are fake."""
    module = importlib.import_module("torch._subclasses.fake_tensor")
    mode = _need(module, "FakeTensorMode", "to run a forward without memory for the memory estimate")
    return mode(allow_non_fake_inputs=False)


def new_tensors_watch(seen: Callable[[str, list[torch.Tensor]], None]) -> Any:
    """A context manager in which the tensors each operation returns are handed to ``seen`` with the
    operation's name (``"aten.mm.default"``; new storages and views of old ones alike), through
    torch's ``TorchDispatchMode``: each operation,
    the backward's and the optimizer's included, is one call of its ``__torch_dispatch__``. Entered
    inside a fake tensor mode, it sees the fake results, which the fake mode makes below it."""
    module = importlib.import_module("torch.utils._python_dispatch")
    base = _need(module, "TorchDispatchMode", "to see the tensors each operation makes (memory estimate)")

    class _Watch(base):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            result = func(*args, **(kwargs or {}))
            seen(str(func), _returned(result))
            return result

    return _Watch()


def _returned(result: Any) -> list[torch.Tensor]:
    """The tensors an operation returned: one, or those in its tuple or list."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [item for item in result if isinstance(item, torch.Tensor)]
    return []
