"""Where-am-I detection: which launcher (if any) started this process, and what world it gives.

Each environment is a small class that recognises itself from environment variables and
describes the world it implies. ``detect()`` tries them in a fixed order; the first that
matches wins. Reading only: nothing here changes the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import ClassVar

import torch

from autoddp.errors import ConfigurationError
from autoddp.world import World

LOOPBACK = "127.0.0.1"


def gpu_count() -> int:
    """Visible CUDA GPUs, counted without initialising CUDA (so fork stays usable)."""
    if not torch.backends.cuda.is_built():
        return 0
    return torch.cuda.device_count()


def cpu_count() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_device(local_rank: int) -> str:
    gpus = gpu_count()
    return f"cuda:{local_rank}" if gpus > local_rank else "cpu"


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise ConfigurationError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(
            f"environment variable {name}={value!r} is not an integer; fix or unset it"
        ) from None


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
        return all(name in environ for name in cls.markers)

    def world(self) -> World:
        return World(device=default_device(0))

    def explain(self) -> str:
        if not self.markers:
            return "no launcher variables set"
        return ", ".join(f"{name}={self.environ[name]}" for name in self.markers)


class _RankVariables(Environment):
    """Launchers that export torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*."""

    launched = True
    markers = ("RANK", "WORLD_SIZE")

    def world(self) -> World:
        env = self.environ
        rank = _int(env, "RANK")
        world_size = _int(env, "WORLD_SIZE")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigurationError(
                f"RANK={rank} and WORLD_SIZE={world_size} do not describe a valid world "
                "(need 0 <= RANK < WORLD_SIZE); fix or unset them"
            )
        local_rank = _int(env, "LOCAL_RANK", rank if "LOCAL_WORLD_SIZE" not in env else None)
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
        port = env.get("MASTER_PORT")
        return World(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=_int(env, "GROUP_RANK", rank // max(local_world_size, 1)),
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT") if port is not None else None,
            device=default_device(local_rank),
        )


class AutoDDPWorker(_RankVariables):
    """A worker started by autoddp (the decorator or the ``autoddp`` command)."""

    name = "autoddp worker"
    markers = ("AUTODDP_RUN_ID", "RANK", "WORLD_SIZE")


class TorchElastic(_RankVariables):
    """A worker started by torchrun / torch.distributed.elastic."""

    name = "torchrun (torch.distributed.elastic)"
    markers = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")


class RankEnv(_RankVariables):
    """Any other launcher that sets RANK and WORLD_SIZE (Kubeflow PyTorchJob, custom scripts)."""

    name = "RANK/WORLD_SIZE variables"
    markers = ("RANK", "WORLD_SIZE")


class Plain(Environment):
    """An ordinary process: autoddp starts the workers itself."""


#: Detection order: most specific first; ``Plain`` always matches.
ENVIRONMENTS: tuple[type[Environment], ...] = (AutoDDPWorker, TorchElastic, RankEnv, Plain)


def _check_consistent(environ: Mapping[str, str]) -> None:
    has_rank, has_size = "RANK" in environ, "WORLD_SIZE" in environ
    if has_rank != has_size:
        present, missing = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
        raise ConfigurationError(
            f"{present} is set but {missing} is not: this looks like a half-configured launcher "
            f"environment. Unset {present} to let autoddp start the processes, or set {missing} too."
        )


def detect(environ: Mapping[str, str] | None = None) -> Environment:
    """The environment this process runs in (the first class of ``ENVIRONMENTS`` that matches)."""
    environ = os.environ if environ is None else environ
    _check_consistent(environ)
    for cls in ENVIRONMENTS:
        if cls.matches(environ):
            return cls(environ)
    raise AssertionError("Plain always matches")  # pragma: no cover
