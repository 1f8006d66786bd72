"""Byte sizes as the options take them (``"24GiB"``, ``"1200MiB"``, ``"1.5GB"``, ``123456``) and as
the notices print them (``"1.6 GiB"``)."""

from __future__ import annotations

import math
import operator
import re

from autoddp.core.errors import ConfigurationError

#: Each unit's bytes: binary (KiB, MiB, ...) and decimal (KB, MB, ...), as their names say.
UNITS = {
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_FORMS = (
    "a number of bytes (123456 or '123456'), or a number and a unit: '24GiB', '1200MiB', '1.5GB' "
    "(KiB, MiB, GiB, TiB are powers of 1024; KB, MB, GB, TB powers of 1000; B is bytes)"
)
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: int | float | str, *, name: str = "size") -> int:
    """The bytes ``value`` names (see ``_FORMS``), rounded down to a whole byte.

    Raises ConfigurationError naming the accepted forms for anything else: a negative size, an
    unknown unit, a boolean, nonsense. ``name`` is the option the value was given for.
    """
    if hasattr(type(value), "__index__") and not isinstance(value, bool):  # numpy.int64(2**30) too
        value = operator.index(value)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigurationError(f"{name}={value!r} is not a size: give {_FORMS}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise ConfigurationError(
                f"{name}={value!r}: a size is a number of bytes, 0 or more: give {_FORMS}"
            )
        return int(value)
    match = _SIZE.match(value)
    if match is None:
        problem = "a size is never negative" if value.strip().startswith("-") else "not a size"
        raise ConfigurationError(f"{name}={value!r}: {problem}: give {_FORMS}")
    number, unit = match.groups()
    factor = UNITS.get(unit.lower() or "b")
    if factor is None:
        raise ConfigurationError(f"{name}={value!r}: unknown unit {unit!r}: give {_FORMS}")
    return int(float(number) * factor)


def format_bytes(count: int | float) -> str:
    """``count`` bytes in the largest binary unit that keeps it at 1 or more: ``"1.6 GiB"``, ``"512 B"``."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
