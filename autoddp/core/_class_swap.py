"""The class swap that every strategy uses: the user's module keeps its identity, its class
becomes a cached subclass with the same name and qualified name.

``cached_subclass`` makes such a subclass once per class and contents; ``swap_class`` gives it to
a module; ``plain_reduce`` pickles and deep-copies a swapped module as its plain class;
``redirect_compiled`` has a ``torch.compile`` result call through its swapped module. A swapped
class keeps its plain class in ``PLAIN_CLASS`` and its strategy's name in ``_autoddp_strategy``.
Strategy-specific behaviour (DDP's routing: ``models._routing``; FSDP's loads: ``models.fsdp``)
lives with its strategy.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from autoddp.core import _compat

#: The class attribute of a swapped class that names the user's own class.
PLAIN_CLASS = "_autoddp_plain_class"
#: Instance attributes autoddp keeps on a module are named so; they never travel in a pickle.
PRIVATE_PREFIX = "_autoddp_"


def plain_reduce(self: torch.nn.Module, protocol: int) -> tuple:
    """Pickle as the plain class, exactly as one process pickles it: the same globals and opcodes
    (``copyreg.__newobj__`` and the user's class, so ``torch.load`` under ``safe_globals([Net])``
    loads it), nothing of autoddp in it (it loads where autoddp is not installed); ``copy`` too.

    The plain class's own reduction runs with the module's class set to the plain one for the
    moment (the pickler checks ``__class__`` against the class it writes); the class swaps back
    when the pickler reads the reduction's (empty) list items, or when the reduction is dropped.
    """
    swapped, plain = type(self), getattr(type(self), PLAIN_CLASS)
    self.__class__ = plain
    try:
        reduced = plain.__reduce_ex__(self, protocol)
    except BaseException:
        self.__class__ = swapped
        raise
    if isinstance(reduced, str):  # a global's name: nothing of the instance is pickled
        self.__class__ = swapped
        return reduced
    func, args, state, items, *rest = (*reduced, None, None, None)[:5]
    if isinstance(state, dict):
        state = {key: value for key, value in state.items() if not key.startswith(PRIVATE_PREFIX)}
    return (func, args, state, _SwapBack(self, swapped, items), *rest)


class _SwapBack:
    """The list items of a swapped module's reduction (none, or the plain class's own): reading
    them gives the module its swapped class back, as does dropping them unread (an error)."""

    __slots__ = ("cls", "items", "module")

    def __init__(self, module: torch.nn.Module, cls: type, items: Any) -> None:
        self.module, self.cls, self.items = module, cls, items

    def __iter__(self) -> _SwapBack:
        return self

    def __next__(self) -> Any:
        self.swap_back()
        if self.items is None:
            raise StopIteration
        return next(self.items)

    def swap_back(self) -> None:
        if self.module is not None:
            self.module.__class__, self.module = self.cls, None

    def __del__(self) -> None:
        self.swap_back()


def _call_inner(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _compat.compiled_inner(self)(*args, **kwargs)


_SUBCLASSES: dict[tuple[type, tuple[tuple[str, Any], ...]], type] = {}


def cached_subclass(cls: type, extra: dict[str, Any]) -> type:
    """A subclass of ``cls`` with the same name and qualified name and ``extra`` in it, made once."""
    key = (cls, tuple(sorted(extra.items())))
    found = _SUBCLASSES.get(key)
    if found is None:
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        namespace.update(extra)
        found = _SUBCLASSES[key] = types.new_class(
            cls.__name__, (cls,), exec_body=lambda ns: ns.update(namespace)
        )
    return found


def swap_class(module: torch.nn.Module, cls: type) -> None:
    """Give ``module`` the class ``cls`` (a subclass of its own, from ``cached_subclass``)."""
    module.__class__ = cls


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile`` result holds, compiled in place with the result's settings,
    the result's calls redirected to it; any other module as it is. DDP and FSDP wrap the real
    module and keep its compilation."""
    compiled = _compat.compiled_parts(module)
    if compiled is None:
        return module
    inner, dynamo_ctx = compiled
    _compat.compile_in_place(inner, dynamo_ctx)
    redirect_compiled(module)
    return inner


def redirect_compiled(compiled: torch.nn.Module) -> None:
    """Have calls of a ``torch.compile`` result go to its (wrapped, compiled-in-place) module.

    Its own ``forward`` was bound to the module's original ``__call__`` when it was made, which
    would bypass the swapped class; code that kept the compiled object calls through it.
    """
    if PLAIN_CLASS not in type(compiled).__dict__:
        cls = type(compiled)
        extra = {"__call__": _call_inner, "__reduce_ex__": plain_reduce, PLAIN_CLASS: cls}
        compiled.__class__ = cached_subclass(cls, extra)
