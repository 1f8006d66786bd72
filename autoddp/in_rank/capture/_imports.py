"""Modules watched for while capture runs: a callback once each has been imported, never an import of ours.

Capture adapts libraries the user's code may import before capture begins (the decorator: the
module's imports ran in the caller) or while it runs (a script: ``import wandb`` comes after
capture is installed). ``Watch`` takes both: ``start`` hands over the watched modules already
imported, and a finder first on ``sys.meta_path`` hands over each one the moment its own code
has run (its loader wrapped for that one import: the module, its ``__spec__`` and ``__loader__``
are exactly as without it). Nothing is imported that the user's code does not import itself
(``import autoddp`` and capture stay as fast as before; a library's own start-up cost and side
effects are the user's to ask for). ``stop`` takes the finder out.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any


class Watch:
    """Calls ``loaded(module)`` once for each module named in ``names`` imported while it watches."""

    def __init__(self, names: Iterable[str], loaded: Callable[[ModuleType], None]) -> None:
        self.names = frozenset(names)
        self.loaded = loaded
        self._seen: dict[str, ModuleType] = {}
        self._finder = _Finder(self)

    def start(self) -> None:
        """Watch from now on; the watched modules imported already are handed over at once."""
        if self._finder not in sys.meta_path:
            sys.meta_path.insert(0, self._finder)
        for name in sorted(self.names):
            module = sys.modules.get(name)
            if isinstance(module, ModuleType) and not _initializing(module):
                self.arrived(module)

    def stop(self) -> None:
        """Watch no more (idempotent)."""
        while self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._seen.clear()

    def arrived(self, module: ModuleType) -> None:
        """``module`` has been imported: handed over once (again only if it is imported anew)."""
        if self._seen.get(module.__name__) is module:
            return
        self._seen[module.__name__] = module
        self.loaded(module)


def _initializing(module: ModuleType) -> bool:
    """True while a module's own code is still running (an import under way)."""
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class _Finder:
    """First on ``sys.meta_path``: finds a watched module as the finders after it do, with a loader
    that tells the watch once the module's code has run."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.watch.names:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # (found by nobody, or an old-style loader: imported as it is, unwatched)
        spec.loader = _Then(loader, self.watch)
        return spec

    def invalidate_caches(self) -> None:
        return None


class _Then:
    """A module's own loader for one import, and then the watch told."""

    def __init__(self, loader: Any, watch: Watch) -> None:
        self.loader, self.watch = loader, watch

    def create_module(self, spec: Any) -> Any:
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        if spec is not None and spec.loader is self:
            spec.loader = self.loader  # the module as its own loader leaves it
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.watch.arrived(sys.modules.get(module.__name__, module))  # (a module may put another there)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
