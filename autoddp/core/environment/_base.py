"""What every environment shares: the variable parsers, derived ports, the base class, ``Plain``.

Parsers come in two contracts: ``read_int``/``read_port`` for a variable that must be a number
(``ConfigurationError`` naming it otherwise), ``as_number`` for comparing launcher values
(``"03"`` and ``"3"`` agree; text stays text). Nothing here writes the environment.
"""

from __future__ import annotations

import functools
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import ClassVar

from autoddp.core.environment import hardware
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import World

LOOPBACK = "127.0.0.1"

#: Derived ports lie in [PORT_BASE, PORT_BASE + PORT_SPAN): unprivileged, below the ephemeral range.
PORT_BASE = 20000
PORT_SPAN = 10000


def parse_int(value: str) -> int | None:
    """A whole number written plainly (``"03"``, ``" 3"``), else None (no ``1_0``, no ``٣``)."""
    return int(value) if re.fullmatch(r"\s*[-+]?\d+\s*", value, re.ASCII) else None


def read_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """The number in variable ``name`` (``default`` when unset and given); ConfigurationError otherwise."""
    value = environ.get(name)
    if value is None:
        if default is None:
            raise ConfigurationError(f"environment variable {name} is not set")
        return default
    number = parse_int(value)
    if number is None:
        raise ConfigurationError(f"environment variable {name}={value!r} is not an integer; fix or unset it")
    return number


def read_port(environ: Mapping[str, str], name: str = "MASTER_PORT") -> int:
    """The port number in variable ``name``; ConfigurationError when it is not one."""
    port = read_int(environ, name)
    if not 0 < port < 65536:
        raise ConfigurationError(f"{name}={port} is not a port number (1-65535); fix or unset it")
    return port


def as_number(value: str | None) -> int | str | None:
    """A launcher value as a number when it is one (``"03"`` and ``"3"`` agree), else as given."""
    if value is None:
        return None
    number = parse_int(value)
    return value.strip() if number is None else number


def show(environ: Mapping[str, str], names: Sequence[str]) -> str:
    """``NAME=value, ...`` for those of ``names`` that are set."""
    return ", ".join(f"{name}={environ[name]}" for name in names if name in environ)


def shared_port(key: str) -> int:
    """A port derived from a value all ranks share: ``20000 + crc32(key) % 10000``."""
    return PORT_BASE + zlib.crc32(key.encode()) % PORT_SPAN


class Environment:
    """One way a process can have been started. Subclasses recognise themselves in ``matches``."""

    name: ClassVar[str] = "plain process"
    #: True when the launcher already started every process: autoddp runs in place.
    launched: ClassVar[bool] = False
    #: The variables that identify this environment (shown by ``explain``).
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    @classmethod
    def matches(cls, environ: Mapping[str, str]) -> bool:
        """True when ``environ`` is this environment's."""
        for name in cls.markers:  # noqa: SIM110 - a loop, not all(): detection runs on every call
            if name not in environ:
                return False
        return True

    def world(self) -> World:
        """The world this process belongs to (raises ``ConfigurationError`` if the variables are broken)."""
        return _single_world(hardware.default_device(0))

    def explain(self) -> str:
        """The variables that made the decision, and what it means for ``@distributed``."""
        if not self.markers:
            return "no launcher variables set"
        return show(self.environ, self.markers)

    def port_policy(self) -> str:
        """Where rank 0's port comes from in this environment."""
        if "MASTER_PORT" in self.environ:
            return f"MASTER_PORT={self.environ['MASTER_PORT']}, set by the launcher"
        return "MASTER_PORT is not set"


@functools.lru_cache(maxsize=8)
def _single_world(device: str) -> World:
    """The world of one process computing on ``device`` (immutable, so one per device is shared)."""
    return World(device=device)


def own_port_policy(environ: Mapping[str, str]) -> str:
    """The port policy where autoddp starts its own workers."""
    if "MASTER_PORT" in environ:
        return f"autoddp's own launches: rank 0's store on 127.0.0.1:{environ['MASTER_PORT']} (MASTER_PORT)"
    return "autoddp's own launches: rank 0's store on 127.0.0.1, a free port the operating system picks"


class Plain(Environment):
    """An ordinary process: autoddp starts the workers itself."""

    def explain(self) -> str:
        single = show(self.environ, ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
        if single:
            return (
                f"{single}: an MPI world of one process; @distributed starts its own workers here "
                "(one per visible GPU)"
            )
        return "no launcher variables set: @distributed starts its own workers (one per visible GPU)"

    def port_policy(self) -> str:
        return own_port_policy(self.environ)
