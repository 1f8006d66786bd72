"""Launching: start and supervise workers through torch.distributed.elastic, on one machine or many.

The one door is ``run(request, target)`` (``door``): both the decorator and the command call it
with a ``request.Request`` and what runs (a function's ``Job``, or a ``request.Script``); ``way``
says where it would run; ``local`` (one machine, restarts), ``nodes`` (this node's share, elastic's
agent) and ``in_place`` (a script inside a launched world) are its three ways, ``hang/`` the
caller's half of the hang report; ARCHITECTURE.md lists every module. This package imports
nothing until ``run`` or ``way`` is first used, so that checking options never loads the launch
machinery.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """``run`` and ``way``, from ``door`` when first used (PEP 562)."""
    if name in ("run", "way"):
        from autoddp.launch import door

        return getattr(door, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
