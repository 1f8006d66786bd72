"""The one wrapper of ``torch.autograd.backward``: every part of autoddp that watches backward
passes registers a watcher with it, instead of wrapping the function itself.

Three parties watch each ``backward()``: the hang report's marks (for the worker), the step report
(for the user's code) and capture's first check (for a capture session). Each wrapper of its own
cost a step a frame of ``*args, **kwargs`` and a ``try``; here one frame, with
``torch.autograd.backward``'s own parameters (``PARAMETERS``: a call binds them without building a
tuple and a dict), calls each watcher's ``before`` and, where that asked for it, its ``after``: two
plain method calls, or one for a watcher with nothing to do in this pass. (Capture counts the
passes themselves, ``grad``'s too, at torch's engine call: ``in_rank.models._reduction``.)

A watcher is ``add``-ed (outermost: its ``before`` runs first and its ``after`` last, as the
wrappers' nesting gave) and ``remove``-d when its party ends; the wrapper stands while any
watcher is registered and goes with the last one, under the patch engine's rules (``_patches``:
only its own restored; nesting with anyone else's wrapper of the function). While torch.compile
traces the call, and in a thread that no watcher asked for, the call is exactly the original's.
A leaf of core: it knows no run.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
from collections.abc import Callable
from typing import Any, Protocol

import torch

from autoddp.core import _patches
from autoddp.core.errors import TorchCompatibilityError

#: What a watcher's ``before`` returns when it has nothing to do after the pass.
SKIP: Any = type("Skip", (), {"__repr__": lambda self: "<skip>"})()


class Watcher(Protocol):
    """One party's view of each ``torch.autograd.backward`` call."""

    def before(self, args: tuple, kwargs: dict, thread: int) -> Any:
        """Before the pass (``thread``: ``threading.get_ident()``; ``args``: the call's arguments in
        ``PARAMETERS``' order, ``kwargs`` empty): a token for ``after``, or ``SKIP``."""

    def after(self, token: Any, args: tuple, kwargs: dict, raised: bool) -> None:
        """After the pass (``raised``: it raised), with ``before``'s token."""


class BackwardCalls:
    """The registered watchers and the one wrapper that calls them: the module's one state."""

    def __init__(self) -> None:
        self.registered: tuple[Watcher, ...] = ()  # outermost first
        self.deaf: tuple[Watcher, ...] = ()  # registered, but not called now (``listen``)
        self.watchers: tuple[Watcher, ...] = ()  # those the wrapper calls: registered, not deaf
        self.calling: tuple[tuple[Watcher, ...], tuple[Watcher, ...]] = ((), ())  # (``listen``)
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
        self.calling = (self.watchers, self.watchers[::-1])  # and innermost first, for their ``after``

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
        """The wrapper, with ``torch.autograd.backward``'s own parameters: a call binds them
        directly (no ``*args, **kwargs`` tuple and dict built twice per step); the watchers get
        them as one tuple (``args``, in that order) and no keywords."""
        _check_parameters(original)
        calls, get_ident, compiling, no_keywords = (
            self,
            threading.get_ident,
            torch.compiler.is_compiling,
            _NO_KEYWORDS,
        )

        def backward(
            tensors: Any,
            grad_tensors: Any = None,
            retain_graph: Any = None,
            create_graph: Any = False,
            grad_variables: Any = None,
            inputs: Any = None,
        ) -> Any:
            watchers, innermost_first = calls.calling  # (one read: a pass keeps the ones it began with)
            if not watchers or compiling():  # traced: exactly the original
                return original(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
            args = (tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
            thread = get_ident()
            tokens: list[Any] = []  # each watcher's, outermost first (``SKIP``: no ``after``)
            try:
                for watcher in watchers:
                    tokens.append(watcher.before(args, no_keywords, thread))
                result = original(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
            except BaseException:
                _after(watchers, tokens, args, no_keywords)
                raise
            try:
                for watcher in innermost_first:
                    token = tokens.pop()
                    if token is not SKIP:
                        watcher.after(token, args, no_keywords, False)
            except BaseException:
                _after(watchers, tokens, args, no_keywords)  # (those whose ``after`` did not run yet)
                raise
            return result

        return backward


#: The parameters of ``torch.autograd.backward`` the wrapper takes (every release since 1.8).
PARAMETERS = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
#: The watchers' ``kwargs``: the wrapper binds every argument to its parameter (read-only, shared).
_NO_KEYWORDS: Any = types.MappingProxyType({})


def _check_parameters(original: Callable[..., Any]) -> None:
    """A TorchCompatibilityError where ``torch.autograd.backward`` takes other parameters."""
    found = tuple(inspect.signature(original).parameters)
    if found != PARAMETERS:
        raise TorchCompatibilityError(
            f"autoddp watches torch.autograd.backward{PARAMETERS}, and torch {torch.__version__}'s takes "
            f"{found}: this torch release changed it. Use a torch version autoddp supports, or report "
            "it to autoddp with this message"
        )


def _after(watchers: tuple[Watcher, ...], tokens: list[Any], args: tuple, kwargs: dict) -> None:
    """After a pass that raised: the ``after`` of the first ``len(tokens)`` watchers that asked for
    it, innermost first; one that raises does not keep the others from running (as nested
    ``finally`` blocks), the first error goes on."""
    error: BaseException | None = None
    for watcher, token in reversed(list(zip(watchers, tokens, strict=False))):
        if token is SKIP:
            continue
        try:
            watcher.after(token, args, kwargs, True)
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


CALLS = BackwardCalls()
