"""Where a module's calls go: ``Module.__call__`` runs ``_compiled_call_impl`` when one is set in
the instance (``Module.compile()`` sets it), else the module's own call. autoddp routes a watched
submodule's calls there (``in_rank.models._routing``), and quiets the routes for a forward."""

from __future__ import annotations

from typing import Any

import torch

from autoddp.core._compat.needs import _need


def routed_call(module: torch.nn.Module) -> Any:
    """What ``module(...)`` runs instead of its own call (``route_calls``, ``Module.compile()``); or None."""
    _need(torch.nn.Module, "_compiled_call_impl", "to see calls of a submodule")
    return module.__dict__.get("_compiled_call_impl")


def own_call(module: torch.nn.Module) -> Any:
    """``module``'s own call (hooks and ``forward``), which ``module(...)`` runs unless routed."""
    return _need(module, "_call_impl", "to see calls of a submodule")


def route_calls(module: torch.nn.Module, handler: Any) -> None:
    """Have ``module(...)`` run ``handler`` (None: its own call again), pickled with nothing of it.

    ``Module.__call__`` runs ``_compiled_call_impl`` when one is set (``Module.compile()`` sets
    it), and ``Module.__getstate__`` leaves it out of pickles and copies: a submodule keeps its
    class, and ``torch.save(model)`` writes what one process writes.
    """
    _need(torch.nn.Module, "_compiled_call_impl", "to see calls of a submodule")
    if handler is None:
        module.__dict__.pop("_compiled_call_impl", None)
    else:
        module.__dict__["_compiled_call_impl"] = handler


def quiet_routes(routes: list[tuple[dict, Any, Any]]) -> list[tuple[dict, Any, Any]]:
    """For each ``(module.__dict__, handler, before)`` whose module routes its calls to ``handler``
    still, route them to ``before`` (None: its own call): those changed, for ``restore_routes``.

    A plain dict write per module, for a whole forward: cheaper than a handler passing through
    on each of its calls (``models._routing``: the watchers are quiet inside DDP's forward).
    """
    quieted = []
    for table, handler, before in routes:
        if table.get("_compiled_call_impl") is handler:
            table["_compiled_call_impl"] = before
            quieted.append((table, handler, before))
    return quieted


def restore_routes(quieted: list[tuple[dict, Any, Any]]) -> None:
    """Undo ``quiet_routes``, where nothing routed the calls elsewhere meanwhile."""
    for table, handler, before in quieted:
        if table.get("_compiled_call_impl") is before:
            table["_compiled_call_impl"] = handler
