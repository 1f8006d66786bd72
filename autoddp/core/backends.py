"""The run's communication backend and its timeout, from the user's options: NCCL with gloo beside it
on GPUs, gloo on CPU; seconds or a timedelta, checked. Both doors check these before anything
starts, and every rank receives the result."""

from __future__ import annotations

import dataclasses
import datetime
import math
import numbers

from autoddp.core.errors import ConfigurationError

BACKENDS = ("auto", "gloo", "nccl")


@dataclasses.dataclass(frozen=True)
class Backend:
    """The communication backend of a run and whether its processes compute on CUDA."""

    name: str  # what init_process_group receives
    use_cuda: bool

    @property
    def label(self) -> str:
        return "nccl+gloo" if self.use_cuda else self.name


def resolve_backend(requested: str | None, gpus: int) -> Backend:
    """Turn the user's ``backend=`` choice into a backend, checking it against the GPUs present."""
    choice = "auto" if requested is None else str(requested).lower()
    if choice not in BACKENDS:
        raise ConfigurationError(
            f"unknown backend={requested!r}: use one of {', '.join(map(repr, BACKENDS))} "
            "(or leave it unset for NCCL on GPUs and gloo on CPU)"
        )
    if choice == "nccl" and gpus == 0:
        raise ConfigurationError(
            "backend='nccl' needs CUDA GPUs, and none is visible here; use backend='gloo' "
            "or leave backend unset to pick gloo on CPU"
        )
    if choice == "gloo" or gpus == 0:
        return Backend("gloo", use_cuda=False)
    # NCCL for CUDA tensors, gloo for CPU tensors (object collectives, CPU metrics).
    return Backend("cpu:gloo,cuda:nccl", use_cuda=True)


#: The longest wait torch's groups take: ``timeout=float("inf")`` means this (no timeout in
#: practice). Much longer ones overflow torch's clock (about 290 years: every wait fails at once).
LONGEST_TIMEOUT = datetime.timedelta(days=3650)


def as_timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    """Normalise a ``timeout=`` option (seconds or timedelta) for init_process_group.

    ``float("inf")`` is no timeout (``LONGEST_TIMEOUT``, 10 years); NaN, a timeout of 0 or less, or
    one longer than ``LONGEST_TIMEOUT`` is refused.
    """
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        seconds = math.nan
    else:
        seconds = float(timeout)
    if not seconds > 0:  # (NaN too)
        raise ConfigurationError(
            f"timeout={timeout!r} is not a positive number of seconds (or a datetime.timedelta); "
            "pass e.g. timeout=1800, or for no timeout float('inf') (the command: --timeout inf)"
        )
    if math.isinf(seconds):
        return LONGEST_TIMEOUT
    if seconds > LONGEST_TIMEOUT.total_seconds():
        raise ConfigurationError(
            f"timeout={timeout!r} is longer than torch's process groups can wait (at most "
            f"{LONGEST_TIMEOUT.total_seconds():.0f} seconds, 10 years); for no timeout pass float('inf') "
            "(the command: --timeout inf)"
        )
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=seconds)
