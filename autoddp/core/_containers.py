"""The one container walker: apply a function to the items of lists, tuples, dicts and dataclasses.

``prepare`` (arguments and results), the result sent back to the caller, and ``save`` all walk
containers the same way: a container comes back as itself when no item changed, else as a copy
of the same type (dict subclasses such as ``OrderedDict`` and ``defaultdict`` keep their type,
``default_factory`` and attributes like a state dict's ``_metadata``; namedtuples and dataclasses
are rebuilt field by field). The walk is one level deep: ``fn`` recurses by calling it again.
``reachable`` is the bounded walk through objects too (attributes and slots), for what a call's
arguments hold: models built before capture, optimizers made before the call.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def map_items(obj: T, fn: Callable[[Any], Any]) -> T:
    """``obj`` with ``fn`` applied to each of its items; anything but a container comes back as is."""
    if isinstance(obj, dict):
        changed = {key: new for key, value in obj.items() if (new := fn(value)) is not value}
        if not changed:
            return obj
        result = copy.copy(obj)
        for key, new in changed.items():  # (item by item: HF's ModelOutput refuses update())
            result[key] = new
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


def leaves(obj: Any) -> Iterable[Any]:
    """Every item inside ``obj`` that is not itself a container, however deep (the containers
    ``map_items`` walks: lists, tuples, dicts, dataclasses).

    Anything but a container is its own one leaf, handed back without a generator: a model's
    output tensor, looked at on every training step, costs two type checks.
    """
    if isinstance(obj, (dict, list, tuple)) or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return _leaves(obj)
    return (obj,)


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for value in obj.values():
            yield from leaves(value)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from leaves(item)
    else:  # a dataclass instance
        for field in dataclasses.fields(obj):
            yield from leaves(getattr(obj, field.name))


def reachable(
    roots: Iterable[Any],
    found: tuple[type, ...],
    *,
    skip: tuple[type, ...] = (),
    depth: int = 3,
    per_container: int = 256,
    budget: int = 20_000,
) -> Iterator[Any]:
    """Objects of the ``found`` types that ``roots`` reach, breadth first and each once.

    The walk goes through list, tuple, set and dict items and through objects' attributes (their
    ``__dict__`` and ``__slots__``: ``trainer.model``), ``depth`` steps from the roots, at most
    ``per_container`` items of each and ``budget`` objects in all; it never goes into a found
    object nor into one of the ``skip`` types, and meets each object once (cycles end).
    """
    level = list(roots)
    seen: set[int] = set()
    for _ in range(depth + 1):
        below: list[Any] = []
        for value in level:
            if id(value) in seen or len(seen) >= budget:
                continue
            seen.add(id(value))
            if isinstance(value, found):
                yield value
            elif not isinstance(value, skip):
                below.extend(_held(value, per_container))
        level = below


def _held(value: Any, limit: int) -> list[Any]:
    """What ``value`` holds that the walk may go on into (at most ``limit`` items)."""
    if isinstance(value, (str, bytes, bytearray, type)):
        return []
    if isinstance(value, (list, tuple)):
        return list(value[:limit])
    if isinstance(value, dict):
        return list(itertools.islice(value.values(), limit))
    if isinstance(value, (set, frozenset)):
        return list(itertools.islice(value, limit))
    try:
        attributes = getattr(value, "__dict__", None)
    except Exception:  # (a proxy whose lookups fail: nothing to walk)
        attributes = None
    items = list(itertools.islice(attributes.values(), limit)) if isinstance(attributes, dict) else []
    for name in _slot_names(type(value)):
        if len(items) >= limit:
            break
        try:
            items.append(object.__getattribute__(value, name))
        except Exception:  # an empty slot
            continue
    return items


def _slot_names(cls: type) -> list[str]:
    """The names of the ``__slots__`` a class and its bases declare (not ``__dict__``/``__weakref__``)."""
    names: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                names.append(_mangled(klass, name))
    return names


def _mangled(klass: type, name: str) -> str:
    """A private slot's attribute name (``__x`` in class ``C`` is ``_C__x``)."""
    if name.startswith("__") and not name.endswith("__"):
        return f"_{klass.__name__.lstrip('_')}{name}"
    return name
