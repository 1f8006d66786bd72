"""The one Python function both ``torch.autograd.backward`` and ``torch.autograd.grad`` call to run
a backward pass: ``torch.autograd._engine_run_backward``, looked up in ``torch.autograd``'s globals
at each call (torch 2.4 to 2.15), with ``accumulate_grad=True`` from ``backward`` and ``False``
from ``grad``.

Replacing it there sees every pass, whatever name the caller reached ``backward`` or ``grad`` by:
one bound before autoddp replaced them (``from torch.autograd import grad`` in a module imported
before a decorated call, a default argument) runs through it too.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from autoddp.core.errors import TorchCompatibilityError

#: The function's name in ``torch.autograd``.
ENGINE_CALL = "_engine_run_backward"


def engine_call() -> tuple[Any, str]:
    """``(torch.autograd, name)`` of the engine call, checked: ``backward`` and ``grad`` (torch's own,
    under any wrapper that says what it wraps) read it as a global of ``torch.autograd``; else a
    TorchCompatibilityError."""
    autograd = torch.autograd
    readers = [inspect.unwrap(reader) for reader in (autograd.backward, autograd.grad)]
    torchs = [reader for reader in readers if getattr(reader, "__module__", None) == autograd.__name__]
    if not callable(getattr(autograd, ENGINE_CALL, None)) or not all(
        ENGINE_CALL in reader.__code__.co_names and reader.__globals__ is vars(autograd) for reader in torchs
    ):
        raise TorchCompatibilityError(
            f"autoddp sees each backward pass through torch.autograd.{ENGINE_CALL}, which "
            f"torch.autograd.backward and grad called until now; torch {torch.__version__} changed "
            "that. Use a torch version autoddp supports, or report it to autoddp with this message"
        )
    return autograd, ENGINE_CALL


#: The keyword both callers pass: True from ``backward`` (into ``.grad``), False from ``grad``.
ACCUMULATES = "accumulate_grad"
#: Where both callers pass the pass's ``inputs`` (a tuple; empty from ``backward`` without them),
#: after the outputs: ``(grad_tensors, retain_graph, create_graph, inputs, ...)``.
INPUTS_AT = 3


def accumulates(kwargs: dict[str, Any]) -> bool:
    """Whether an engine call (its keyword arguments) accumulates into ``.grad`` (``backward``) or
    returns the gradients (``grad``); ``kwargs.get(ACCUMULATES, True)`` inline on a step's path."""
    return bool(kwargs.get(ACCUMULATES, True))


def inputs(args: tuple) -> tuple:
    """The ``inputs`` an engine call (its positional arguments after the outputs) was given: the
    tensors whose gradients it computes; empty where ``backward`` was given none (every leaf)."""
    return tuple(args[INPUTS_AT]) if len(args) > INPUTS_AT and args[INPUTS_AT] else ()
