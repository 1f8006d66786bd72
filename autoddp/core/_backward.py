"""The one wrapper of ``torch.autograd.backward``: every part of autoddp that watches backward
passes registers a watcher with it, instead of wrapping the function itself.

Four parties watch each ``backward()``: the hang report's marks (for the worker), the step report
(for the user's code), capture's first check and its count of backward passes (for a capture
session). Each wrapper of its own cost a step a frame of ``*args, **kwargs`` and a ``try``; here
one frame calls each watcher's ``before`` and, where that asked for it, its ``after``: two plain
method calls, or one for a watcher with nothing to do in this pass.

A watcher is ``add``-ed (outermost: its ``before`` runs first and its ``after`` last, as the
wrappers' nesting gave) and ``remove``-d when its party ends; the wrapper stands while any
watcher is registered and goes with the last one, under the patch engine's rules (``_patches``:
only its own restored; nesting with anyone else's wrapper of the function). While torch.compile
traces the call, and in a thread that no watcher asked for, the call is exactly the original's.
A leaf of core: it knows no run.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from autoddp.core import _patches

#: What a watcher's ``before`` returns when it has nothing to do after the pass.
SKIP: Any = type("Skip", (), {"__repr__": lambda self: "<skip>"})()


class Watcher(Protocol):
    """One party's view of each ``torch.autograd.backward`` call."""

    def before(self, args: tuple, kwargs: dict, thread: int) -> Any:
        """Before the pass (``thread``: ``threading.get_ident()``): a token for ``after``, or ``SKIP``."""

    def after(self, token: Any, args: tuple, kwargs: dict, raised: bool) -> None:
        """After the pass (``raised``: it raised), with ``before``'s token."""


class BackwardCalls:
    """The registered watchers and the one wrapper that calls them: the module's one state."""

    def __init__(self) -> None:
        self.registered: tuple[Watcher, ...] = ()  # outermost first
        self.deaf: tuple[Watcher, ...] = ()  # registered, but not called now (``listen``)
        self.watchers: tuple[Watcher, ...] = ()  # those the wrapper calls: registered, not deaf
        self.patches = _patches.Patches()
        self.wrappers: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, its wrapper)

    def add(self, watcher: Watcher, listening: bool = True) -> None:
        """Watch every backward from now on, outermost (the wrapper put in place if it was not)."""
        if any(each is watcher for each in self.registered):
            return
        if not self.patches.installed:
            self.patches.install([self._patch()])
        self.registered = (watcher, *self.registered)
        self.listen(watcher, listening)

    def listen(self, watcher: Watcher, listening: bool) -> None:
        """Whether ``watcher`` is called (one with nothing to do for a while costs no call then)."""
        deaf = tuple(each for each in self.deaf if each is not watcher)
        self.deaf = deaf if listening else (*deaf, watcher)
        self.watchers = tuple(each for each in self.registered if not any(each is d for d in self.deaf))

    def remove(self, watcher: Watcher) -> None:
        """Stop watching (idempotent); the last one out puts the function back (``_patches``' rule)."""
        self.registered = tuple(each for each in self.registered if each is not watcher)
        self.listen(watcher, True)
        if not self.registered:
            self.patches.restore()

    def _patch(self) -> tuple[Any, str, Any]:
        """The wrapper over today's ``torch.autograd.backward``, made once per original (a function
        patched again is replaced by the very same object: Python's specialised calls stay valid)."""
        original = torch.autograd.backward
        if id(original) not in self.wrappers:
            self.wrappers[id(original)] = (original, functools.wraps(original)(self._wrap(original)))
        return torch.autograd, "backward", self.wrappers[id(original)][1]

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        calls, get_ident, compiling = self, threading.get_ident, torch.compiler.is_compiling

        def backward(*args: Any, **kwargs: Any) -> Any:
            watchers = calls.watchers
            if not watchers or compiling():  # traced by torch.compile: exactly the original
                return original(*args, **kwargs)
            thread = get_ident()
            pending = []  # (watcher, token) of those asking for ``after``, outermost first
            try:
                for watcher in watchers:
                    token = watcher.before(args, kwargs, thread)
                    if token is not SKIP:
                        pending.append((watcher, token))
                result = original(*args, **kwargs)
            except BaseException:
                _after(pending, args, kwargs)
                raise
            if pending:
                entry = None
                try:
                    for entry in reversed(pending):  # innermost first
                        entry[0].after(entry[1], args, kwargs, False)
                except BaseException:
                    _after(pending[: next(i for i, e in enumerate(pending) if e is entry)], args, kwargs)
                    raise
            return result

        return backward


def _after(pending: list[tuple[Watcher, Any]], args: tuple, kwargs: dict) -> None:
    """After a pass that raised: each ``after`` asked for, innermost first; one that raises does not
    keep the others from running (as nested ``finally`` blocks), the first error goes on."""
    error: BaseException | None = None
    for watcher, token in reversed(pending):
        try:
            watcher.after(token, args, kwargs, True)
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


CALLS = BackwardCalls()
