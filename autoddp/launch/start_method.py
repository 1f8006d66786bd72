"""How workers start: by fork where that is safe (CUDA untouched here), else as fresh interpreters."""

from __future__ import annotations

import os
import sys
import warnings

import torch

from autoddp.core import _compat
from autoddp.core._compat import forks
from autoddp.core.backends import Backend
from autoddp.core.environment import hardware
from autoddp.core.errors import ConfigurationError

START_METHODS = ("auto", "fork", "spawn")


def choose_start_method(requested: str, backend: Backend | None = None) -> tuple[str, str]:
    """Resolve ``start_method`` to ``"fork"`` or ``"spawn"``, with the reason for the choice."""
    if requested not in START_METHODS:
        raise ConfigurationError(
            f"unknown start_method={requested!r}: use 'auto' (default), 'fork' or 'spawn'"
        )
    fork_ok, why = _fork_is_safe()
    if requested == "fork":
        if not fork_ok:
            raise ConfigurationError(f"start_method='fork' cannot be used here: {why}; use 'spawn' or 'auto'")
        return "fork", "asked for"
    if requested == "spawn":
        return "spawn", "asked for"
    return ("fork", why) if fork_ok else ("spawn", why)


def _fork_is_safe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, "fork is used on Linux only"
    gpus = hardware.gpu_count() > 0
    if gpus and torch.cuda.is_initialized():
        return False, _CUDA_IN_USE
    poisoned = _what_poisons_fork(gpus)
    if poisoned:
        return False, poisoned
    return True, "CUDA and autograd's threads are untouched in this process"


_CUDA_IN_USE = (
    "CUDA was already initialised in this process (for example by "
    "torch.cuda.is_available()), and forked workers could not use it"
)
_AUTOGRAD_THREADS = (
    "autograd already ran here with its device threads started (a CUDA build of torch, after "
    "torch.compile or a GPU), and a backward in a forked worker would raise"
)
_CHILD_ANSWERS = {1: _CUDA_IN_USE, 2: _AUTOGRAD_THREADS}


def _what_poisons_fork(gpus: bool) -> str:
    """Ask a throw-away forked child whether torch marked it a bad fork, for CUDA or for
    autograd: the reason forked workers would fail, or "" where they would not."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            if gpus and forks.cuda_in_bad_fork():
                os._exit(1)
            os._exit(2 if forks.autograd_in_bad_fork() else 0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return ""
    return _CHILD_ANSWERS.get(code, f"a forked probe of this process failed (exit status {code})")


def preload_for_forked_workers(job_args: tuple, job_kwargs: dict, capture: bool) -> None:
    """Import here, once, what every forked worker would otherwise import on its own.

    Building a DDP imports ``torch._dynamo`` (about 800 modules, seconds); forked workers share
    what the caller imported, so importing it before the first fork makes every later call
    cheap, and spares N workers importing it side by side on the same cores. Done when a model
    is passed or capture may find one (capture is on).
    """
    if _compat.dynamo_imported():
        return
    passes_model = any(isinstance(v, torch.nn.Module) for v in (*job_args, *job_kwargs.values()))
    if passes_model or capture:
        _compat.import_dynamo()
