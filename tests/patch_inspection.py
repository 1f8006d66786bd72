"""See, inside a forked worker, what autoddp's patches look like after the user's function returned.

A worker's last Python code after the user's function is ``running.portable`` on its result,
outside capture and the hang marks, on every rank: a result made by ``inspected`` runs its check
there, at its ``detach()``, and writes what it found to ``FOLDER/rank{R}.json``; the result
travels on as a plain tensor. The default check: which attributes autoddp ever patched in that
worker, which a unit replaces now, and which do not hold their original.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from autoddp.core import _patches


def registry_report() -> dict[str, list[str]]:
    """The engine's own account of this process's patches."""
    return {
        "patched": sorted(_patches.label(owner, name) for owner, name, _ in _patches.ever_patched()),
        "active": sorted(_patches.label(owner, name) for owner, name in _patches.active()),
        "unrestored": _patches.unrestored(),
    }


class Inspected(torch.Tensor):
    """A result that runs its check when autoddp readies it to travel."""

    folder = ""  # set in the worker, by ``inspected``
    check: Callable[[], Any] = staticmethod(registry_report)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            with open(os.path.join(cls.folder, f"rank{os.environ['RANK']}.json"), "w") as file:
                json.dump(cls.check(), file)
            return args[0].as_subclass(torch.Tensor).detach()
        return super().__torch_function__(func, types, args, kwargs or {})


def inspected(folder: str, check: Callable[[], Any] = registry_report) -> torch.Tensor:
    """A result whose workers write ``check()`` to ``folder`` after the call (make it in the function)."""
    Inspected.folder, Inspected.check = folder, staticmethod(check)
    return torch.zeros(1).as_subclass(Inspected)


def reports(folder: str, ranks: int = 2) -> list[Any]:
    """What each rank's worker found."""
    found = []
    for rank in range(ranks):
        with open(os.path.join(folder, f"rank{rank}.json")) as file:
            found.append(json.load(file))
    return found


# --- every wrapper takes the calls its original takes ---------------------------------------------


def defining_value(owner: Any, name: str, own: Any) -> Any:
    """What ``owner.name`` was before any patch: its own entry, else the one it inherited."""
    if own is not _patches.MISSING:
        return own
    for cls in owner.__mro__[1:] if isinstance(owner, type) else ():
        if name in vars(cls):
            return vars(cls)[name]
    return _patches.MISSING


def _calls(signature: inspect.Signature, method: bool) -> dict[str, tuple[tuple, dict]]:
    """The ways a caller calls a function of ``signature``, with one distinct value per parameter:
    every parameter by keyword (where it may be), every one by position, the required ones only."""
    shapes: dict[str, tuple[list, dict]] = {
        "by keyword": ([], {}),
        "by position": ([], {}),
        "required": ([], {}),
    }
    for index, parameter in enumerate(signature.parameters.values()):
        value = object()
        kind = parameter.kind
        if kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        positional = kind is parameter.POSITIONAL_ONLY or (method and index == 0)
        for shape, (args, kwargs) in shapes.items():
            if shape == "required" and parameter.default is not parameter.empty:
                continue
            if positional or (shape != "by keyword" and kind is parameter.POSITIONAL_OR_KEYWORD):
                args.append(value)
            else:
                kwargs[parameter.name] = value
    return {shape: (tuple(args), kwargs) for shape, (args, kwargs) in shapes.items()}


def _same(ours: Any, theirs: Any) -> bool:
    """The same value: the caller's own (one object per parameter), or equal defaults (a builtin's
    signature makes its own copy of ``open``'s ``"r"``)."""
    if ours is theirs:
        return True
    return type(ours) is type(theirs) and isinstance(ours, (str, int, float, bool, bytes)) and ours == theirs


def signature_faults(owner: Any, name: str, replacement: Any, original: Any) -> list[str]:
    """Where ``replacement`` (autoddp's wrapper of ``owner.name``) does not take a call exactly as
    ``original`` does: a parameter of its own that a caller's keyword collides with (the wrapper's
    ``module`` against ``DistributedDataParallel(module=...)``), a call it refuses, or a named
    parameter that receives another value than the original's parameter of that name."""
    where = _patches.label(owner, name)
    if not callable(replacement) or isinstance(replacement, property):
        return []  # (an attribute read or set: Parameter.data)
    if inspect.isbuiltin(replacement):
        return []  # (torch's own put back for a while: DTensor's handler during a step)
    method = isinstance(owner, type) and not isinstance(original, staticmethod)
    original = getattr(original, "__func__", original)  # a staticmethod's or classmethod's function
    ours = inspect.signature(replacement, follow_wrapped=False)
    named = [p for p in ours.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    faults = []
    first = next(iter(ours.parameters.values()), None)
    if method and first is not None and first.kind is first.POSITIONAL_OR_KEYWORD:
        faults.append(
            f"{where}: the wrapper's first parameter {first.name!r} (the instance) is not positional-only"
        )
    try:
        theirs = inspect.signature(original)
    except (TypeError, ValueError):  # a builtin without a signature: the wrapper must name nothing
        callers = [p.name for p in named if p.kind is not p.POSITIONAL_ONLY]
        if callers:
            faults.append(f"{where}: the original has no signature, yet the wrapper names {callers}")
        return faults
    for shape, (args, kwargs) in _calls(theirs, method).items():
        expected = theirs.bind(*args, **kwargs)
        expected.apply_defaults()
        try:
            got = ours.bind(*args, **kwargs)
        except TypeError as error:
            faults.append(f"{where}: a call {shape} fails at the wrapper, not at the original: {error}")
            continue
        got.apply_defaults()
        for parameter in named:
            if parameter.kind is parameter.POSITIONAL_ONLY:
                continue
            if parameter.name not in expected.arguments:
                faults.append(f"{where}: the wrapper's {parameter.name!r} is no parameter of the original")
            elif not _same(got.arguments[parameter.name], expected.arguments[parameter.name]):
                faults.append(
                    f"{where}: the wrapper's {parameter.name!r} gets another value than the original's"
                )
    return list(dict.fromkeys(faults))  # (one line per fault, whatever the calls that show it)
