"""Which module owns each parameter, and each module's parent: what capture climbs to find models.

Filled by torch's public global registration hooks while capture runs (every ``register_parameter``
and submodule assignment), so a model built inside the user's code is known by the time an
optimizer is made over it. Each module also remembers where the user's code created it, for the
notice. Models built before capture started are found by ``frame_candidates`` instead.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

import torch

from autoddp import _warn

Site = tuple[str, int]


class Registry:
    """Parameter owners, module parents and creation sites, all held weakly."""

    def __init__(self) -> None:
        self._owner: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self._parent: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self._site: dict[int, tuple[weakref.ref, Site]] = {}
        self._handles: list[Any] = []
        self.paused = False

    def install(self) -> None:
        from torch.nn.modules import module

        self._handles = [
            module.register_module_parameter_registration_hook(self._on_parameter),
            module.register_module_module_registration_hook(self._on_module),
        ]

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_parameter(self, module: torch.nn.Module, name: str, param: Any) -> None:
        if self.paused or param is None:
            return
        self._owner[id(param)] = (weakref.ref(param), weakref.ref(module))
        self._remember_site(module)

    def _on_module(self, module: torch.nn.Module, name: str, submodule: Any) -> None:
        if self.paused or submodule is None:
            return
        self._parent[id(submodule)] = (weakref.ref(submodule), weakref.ref(module))
        self._remember_site(module)

    def _remember_site(self, module: torch.nn.Module) -> None:
        known = self._site.get(id(module))
        if known is None or known[0]() is not module:
            self._site[id(module)] = (weakref.ref(module), user_site(sys._getframe(2), made=module))

    def owner(self, param: torch.Tensor) -> torch.nn.Module | None:
        return _lookup(self._owner, param)

    def parent(self, module: torch.nn.Module) -> torch.nn.Module | None:
        return _lookup(self._parent, module)

    def roots(self) -> list[torch.nn.Module]:
        """The outermost known modules above every parameter registered under capture (each once)."""
        found: dict[int, torch.nn.Module] = {}
        for param_ref, module_ref in list(self._owner.values()):
            module = module_ref()
            if module is None or param_ref() is None:
                continue
            while (parent := self.parent(module)) is not None:
                module = parent
            found.setdefault(id(module), module)
        return list(found.values())

    def site(self, module: torch.nn.Module) -> Site | None:
        known = self._site.get(id(module))
        return known[1] if known is not None and known[0]() is module else None


def _lookup(table: dict[int, tuple[weakref.ref, weakref.ref]], key: Any) -> Any:
    entry = table.get(id(key))
    if entry is None or entry[0]() is not key:
        return None
    return entry[1]()


def user_site(frame: FrameType | None, made: Any = None) -> Site:
    """(file, line) of the first frame outside autoddp, torch and the standard helpers.

    ``made``: an object being constructed; frames of its own ``__init__`` (a model's class body)
    are passed too, so the site is the line that created it (``model = Net()``).
    """
    while frame is not None and (
        _warn.is_library(frame.f_code.co_filename)
        or (made is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is made)
    ):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("<unknown>", 0)


def frame_candidates(frame: FrameType | None) -> Iterator[torch.nn.Module]:
    """Modules the user's frames can reach: their locals and globals, and one attribute deep
    (``self.model``), for models built before capture began."""
    seen: set[int] = set()
    while frame is not None:
        if not _warn.is_library(frame.f_code.co_filename):
            for namespace in (frame.f_locals, frame.f_globals):
                yield from _modules_in(namespace.values(), seen, depth=1)
        frame = frame.f_back


def _modules_in(values: Iterable[Any], seen: set[int], depth: int) -> Iterator[torch.nn.Module]:
    for value in values:
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.nn.Module):
            yield value
        elif depth and not isinstance(value, (type, types.ModuleType)) and hasattr(value, "__dict__"):
            attributes = getattr(value, "__dict__", None)
            if isinstance(attributes, dict):
                yield from _modules_in(list(attributes.values()), seen, depth - 1)
