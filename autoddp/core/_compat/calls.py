"""A module's call without ``Module.__call__``'s two frames, where that call would run ``forward`` alone.

``module(x)`` runs ``Module._wrapped_call_impl`` then ``_call_impl``, two frames of ``*args,
**kwargs`` that, with no hook anywhere, no compiled call and no TorchScript tracing, call
``module.forward`` and nothing else. The routing of a wrapped model's calls (``in_rank.models._routing``)
runs two such calls a step (its DDP's, and DDP's call of the module): calling ``forward`` itself
where that is all they would do saves a step four frames. Anything else (a hook of the user's or a
global one, ``Module.compile()``, ``torch.jit.trace``, a class with its own ``__call__``) takes
the module's own call, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as _nn_module

# Module-level dicts torch fills and empties in place (``register_module_forward_hook``, ...),
# never rebound: read once here, their truth each call.
_GLOBAL_BACKWARD_PRE = _nn_module._global_backward_pre_hooks
_GLOBAL_BACKWARD = _nn_module._global_backward_hooks
_GLOBAL_FORWARD = _nn_module._global_forward_hooks
_GLOBAL_FORWARD_PRE = _nn_module._global_forward_pre_hooks
_TRACING = torch._C._get_tracing_state
_MODULE_CALL = torch.nn.Module.__call__


def bare_forward(module: torch.nn.Module, cls: type) -> Callable[..., Any] | None:
    """``module.forward`` where ``cls.__call__`` (``module``'s class, or the one it is called as)
    would run that alone; None where the module's own call must run (hooks, compiled, traced)."""
    if (
        cls.__call__ is not _MODULE_CALL
        or module._forward_pre_hooks
        or module._forward_hooks
        or module._backward_pre_hooks
        or module._backward_hooks
        or _GLOBAL_FORWARD_PRE
        or _GLOBAL_FORWARD
        or _GLOBAL_BACKWARD_PRE
        or _GLOBAL_BACKWARD
        or module._compiled_call_impl is not None  # (Module's own None unless compiled or routed)
        or _TRACING()
    ):
        return None
    return module.forward
