"""The one patch engine: attributes of torch's namespaces replaced while user code runs, put back exactly.

Capture (and its device habits), the hang report's marks, rank 0's refusals and FSDP's whole
reads each replace attributes of modules and classes (``torch.save``, ``dist.all_reduce``,
``DataLoader.__iter__``...) for a while. Each does it as one ``Patches`` unit: ``install`` puts a
set of ``(owner, name, replacement)`` in place (all or none), ``restore`` puts back what was
there before (idempotent; a ``with`` block restores on every exit path). The rules:

- **Only its own.** ``restore`` puts the earlier value back only where the unit's replacement
  still stands. Where someone else replaced the attribute since (the user's code, another
  library), theirs is left in place, silently: it is what they asked for, and a warning would
  fire for every deliberate monkeypatch.
- **Nesting.** Units over the same attribute form a stack; a unit restored from the middle is
  taken out of it (the unit above it will put back what this one found), so inner and outer
  units restored in any order leave the outer's replacement or the original exactly.
- **Exactly.** What is put back is the owner's own entry (``vars(owner)[name]``: a
  ``staticmethod`` stays one), and an attribute that was inherited (``Tensor.to`` lives on
  ``torch._C.TensorBase``) is deleted from the owner again rather than copied onto it.

Every attribute ever patched in this process is remembered with its value before the first patch
(``ever_patched``, ``unrestored``), so a test can check that a run left torch exactly as it was.
A leaf: it imports nothing of autoddp.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

#: The value of an attribute the owner does not hold itself (absent, or inherited).
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "<missing>"})()

_LOCK = threading.RLock()


class _Layer:
    """One unit's replacement of one attribute, and what it found there."""

    __slots__ = ("before", "name", "owner", "replacement")

    def __init__(self, owner: Any, name: str, before: Any, replacement: Any) -> None:
        self.owner, self.name, self.before, self.replacement = owner, name, before, replacement


#: (id(owner), name) -> the layers of the units over that attribute, innermost last.
_STACKS: dict[tuple[int, str], list[_Layer]] = {}
#: (id(owner), name) -> (owner, name, its value before autoddp first patched it in this process).
_EVER: dict[tuple[int, str], tuple[Any, str, Any]] = {}


def own_value(owner: Any, name: str) -> Any:
    """What ``owner`` itself holds under ``name`` (``MISSING``: nothing, or only an inherited value)."""
    return vars(owner).get(name, MISSING)


def _put(owner: Any, name: str, value: Any) -> None:
    if value is not MISSING:
        setattr(owner, name, value)
    elif name in vars(owner):
        delattr(owner, name)


class Patches:
    """A set of attribute replacements installed and restored as one unit."""

    def __init__(self, patches: Iterable[tuple[Any, str, Any]] = ()) -> None:
        """``patches``: installed by ``__enter__`` (or pass them to ``install``)."""
        self._pending = list(patches)
        self._layers: list[_Layer] = []

    @property
    def installed(self) -> bool:
        """Whether any of this unit's replacements is in place (or was, and was replaced since)."""
        return bool(self._layers)

    def install(self, patches: Iterable[tuple[Any, str, Any]]) -> Patches:
        """Put every ``(owner, name, replacement)`` in place now: all of them, or (on an error) none."""
        added: list[_Layer] = []
        stacks, ever = _STACKS, _EVER
        with _LOCK:
            try:
                for owner, name, replacement in patches:
                    key = (id(owner), name)
                    before = vars(owner).get(name, MISSING)
                    if key not in ever:
                        ever[key] = (owner, name, before)
                    layer = _Layer(owner, name, before, replacement)
                    setattr(owner, name, replacement)
                    stack = stacks.get(key)
                    if stack is None:
                        stacks[key] = [layer]
                    else:
                        stack.append(layer)
                    added.append(layer)
            except BaseException:
                for layer in reversed(added):
                    _take_out(layer)
                raise
            self._layers.extend(added)
        return self

    def restore(self) -> None:
        """Put back what this unit found, where its replacement still stands (idempotent)."""
        with _LOCK:
            layers, self._layers = self._layers, []
            for layer in reversed(layers):
                _take_out(layer)

    def forget(self) -> None:
        """Drop the unit without restoring anything (a forked child that never puts torch back)."""
        self._layers = []

    def __enter__(self) -> Patches:
        patches, self._pending = self._pending, []
        return self.install(patches)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()


def _take_out(layer: _Layer) -> None:
    """Remove ``layer`` from its attribute's stack, putting back what it found if it is on top."""
    owner, name = layer.owner, layer.name
    key = (id(owner), name)
    stack = _STACKS.get(key)
    if stack is None:
        return
    if stack[-1] is layer:
        if vars(owner).get(name, MISSING) is layer.replacement:  # else someone else's: theirs stays
            _put(owner, name, layer.before)
        stack.pop()
    else:
        index = next((i for i, each in enumerate(stack) if each is layer), None)
        if index is None:
            return
        above = stack[index + 1]
        if above.before is layer.replacement:  # the unit above will put back what this one found
            above.before = layer.before
        del stack[index]
    if not stack:
        del _STACKS[key]


def install(patches: Iterable[tuple[Any, str, Any]]) -> Patches:
    """A new unit with ``patches`` in place (``restore`` it when the code it watches ends)."""
    return Patches().install(patches)


def wrapping(owner: Any, name: str, make: Callable[[Any], Any]) -> tuple[Any, str, Any]:
    """The patch that replaces ``owner.name`` by ``make(current value)``, named and documented as it."""
    original = getattr(owner, name)
    return owner, name, functools.wraps(original)(make(original))


def ever_patched() -> list[tuple[Any, str, Any]]:
    """Every ``(owner, name, value before the first patch)`` any unit has patched in this process."""
    with _LOCK:
        return list(_EVER.values())


def active() -> list[tuple[Any, str]]:
    """The ``(owner, name)`` a unit replaces now."""
    with _LOCK:
        return [(stack[0].owner, stack[0].name) for stack in _STACKS.values()]


def replacements() -> list[tuple[Any, str, Any, Any]]:
    """``(owner, name, replacement, value before the first patch)`` of every unit's replacement in
    place now, innermost last (a test checks that each takes the calls the original takes)."""
    with _LOCK:
        return [
            (layer.owner, layer.name, layer.replacement, _EVER[key][2])
            for key, stack in _STACKS.items()
            for layer in stack
        ]


def label(owner: Any, name: str) -> str:
    """``owner.name`` as a reader knows it (``torch.distributed.all_reduce``, ``torch.Tensor.to``)."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{getattr(owner, '__name__', repr(owner))}.{name}"


def unrestored() -> list[str]:
    """The attributes ever patched that do not hold their value from before the first patch now."""
    patched = ever_patched()
    return [label(owner, name) for owner, name, original in patched if own_value(owner, name) is not original]
