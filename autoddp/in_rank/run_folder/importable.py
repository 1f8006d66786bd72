"""Which modules a fresh interpreter can import by name: the others' functions and classes travel
by value.

cloudpickle sends a function or class by reference (its module's name and its own) when its module
is in ``sys.modules``. A module loaded under another name than its file's
(``importlib.util.spec_from_file_location("othername", path)``), made in memory, or shadowed by
another file of that name on the path is there, but a worker started as a fresh interpreter could
not import it (``ModuleNotFoundError`` there, or another module's code). ``ByValue`` has
cloudpickle send those by value for the time of one pickling.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import cloudpickle


def importable(name: str) -> bool:
    """Whether ``import name`` in a fresh interpreter with this ``sys.path`` finds the module this
    process holds under ``name`` (the same file), without importing anything."""
    module = sys.modules.get(name)
    if module is None:
        return False
    parent = name.rpartition(".")[0]
    if parent and not importable(parent):
        return False
    path = getattr(sys.modules[parent], "__path__", None) if parent else None
    if parent and path is None:
        return False
    found = _find_spec(name, path)
    if found is None:
        return False
    return _same_origin(getattr(getattr(module, "__spec__", None), "origin", None), found.origin)


def _find_spec(name: str, path: Any) -> Any:
    """What the import system's finders say about ``name``, ignoring ``sys.modules``."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        with contextlib.suppress(Exception):  # (a finder of a library's that fails is no answer)
            spec = find(name, path)
            if spec is not None:
                return spec
    return None


def _same_origin(held: str | None, found: str | None) -> bool:
    if held is None or found is None:
        return held == found  # (namespace packages: neither has a file)
    if os.path.isabs(held) and os.path.isabs(found):
        return os.path.realpath(held) == os.path.realpath(found)
    return held == found


class ByValue:
    """For one pickling: send by value the functions and classes of modules that are not
    ``importable`` (through cloudpickle's public registry, given back afterwards)."""

    def __init__(self) -> None:
        self.judged: dict[str, bool] = {}
        self.registered: list[types.ModuleType] = []

    def consider(self, obj: Any) -> None:
        """Before ``obj`` (any object) is pickled: a function or class of a module a fresh
        interpreter cannot import has its module sent by value."""
        if not isinstance(obj, (types.FunctionType, type)):
            return
        name = getattr(obj, "__module__", None)
        if not isinstance(name, str) or name in ("__main__", "builtins") or name in self.judged:
            return
        module = sys.modules.get(name)
        self.judged[name] = module is None or importable(name)
        if (
            module is not None
            and not self.judged[name]
            and name not in cloudpickle.list_registry_pickle_by_value()
        ):
            cloudpickle.register_pickle_by_value(module)
            self.registered.append(module)

    @contextlib.contextmanager
    def pickling(self) -> Iterator[None]:
        """Around one ``dump``: the registrations made during it are undone at its end."""
        try:
            yield
        finally:
            for module in self.registered:
                with contextlib.suppress(ValueError):
                    cloudpickle.unregister_pickle_by_value(module)
            self.registered.clear()
