"""Fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``): tensors with a shape, a dtype and
a device but no memory, whose operations take the paths of that device's own kernels (unlike plain
meta tensors, whose composite operations may decompose otherwise: attention, for one). The memory
estimate runs one forward of a copy of the model on them (``core.memory.activations``)."""

from __future__ import annotations

import importlib
from typing import Any

from autoddp.core._compat import _need


def fake_tensor_mode() -> Any:
    """A new mode in which tensors made by ``mode.from_tensor(t)`` and every operation on them are fake."""
    module = importlib.import_module("torch._subclasses.fake_tensor")
    mode = _need(module, "FakeTensorMode", "to run a forward without memory for the memory estimate")
    return mode(allow_non_fake_inputs=False)
