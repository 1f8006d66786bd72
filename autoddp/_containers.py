"""The one container walker: apply a function to the items of lists, tuples, dicts and dataclasses.

``prepare`` (arguments and results), the result sent back to the caller, and ``save`` all walk
containers the same way: a container comes back as itself when no item changed, else as a copy
of the same type (dict subclasses such as ``OrderedDict`` and ``defaultdict`` keep their type,
``default_factory`` and attributes like a state dict's ``_metadata``; namedtuples and dataclasses
are rebuilt field by field). The walk is one level deep: ``fn`` recurses by calling it again.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def map_items(obj: T, fn: Callable[[Any], Any]) -> T:
    """``obj`` with ``fn`` applied to each of its items; anything but a container comes back as is."""
    if isinstance(obj, dict):
        changed = {key: new for key, value in obj.items() if (new := fn(value)) is not value}
        if not changed:
            return obj
        result = copy.copy(obj)
        result.update(changed)
        return result
    if isinstance(obj, (list, tuple)):
        items = [fn(item) for item in obj]
        if all(new is old for new, old in zip(items, obj, strict=True)):
            return obj
        if type(obj) is list:
            return items  # type: ignore[return-value]
        if isinstance(obj, list):
            result = copy.copy(obj)
            result[:] = items
            return result
        if hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            new = fn(value)
            if new is not value:
                changed[field.name] = new
        if not changed:
            return obj
        result = copy.copy(obj)
        for name, value in changed.items():
            object.__setattr__(result, name, value)  # frozen dataclasses too
        return result
    return obj


def leaves(obj: Any) -> Iterator[Any]:
    """Every item inside ``obj`` that is not itself a container, however deep (the containers
    ``map_items`` walks: lists, tuples, dicts, dataclasses)."""
    if isinstance(obj, dict):
        for value in obj.values():
            yield from leaves(value)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from leaves(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from leaves(getattr(obj, field.name))
    else:
        yield obj
