"""Whether a forked process can use what its parent started: CUDA, and autograd's device threads.

Torch marks a child forked after either as a "bad fork"; autoddp asks before it forks workers
(``launch.start_method``) and in a worker before it touches CUDA (``worker.process``). And what a
``multiprocessing`` process the user's code starts will run (``capture.children``).
"""

from __future__ import annotations

from typing import Any

import torch

from autoddp.core._compat import _need


def cuda_in_bad_fork() -> bool:
    """True in a process forked after its parent initialised CUDA (CUDA cannot work there)."""
    return bool(_need(torch.cuda, "_is_in_bad_fork", "to tell whether a forked worker can use CUDA")())


AUTOGRAD_FORK_MESSAGE = "Unable to handle autograd's threading in combination with fork-based multiprocessing"


def autograd_in_bad_fork() -> bool:
    """True in a process forked after its parent started autograd's device threads: every
    backward there raises. Torch keeps this flag private, so a one-element backward asks."""
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError as error:
        if AUTOGRAD_FORK_MESSAGE in str(error):
            return True
        raise
    return False


def process_call(process: Any) -> tuple[Any, tuple, dict]:
    """The target, args and kwargs a ``multiprocessing`` process will run (CPython keeps them
    private; a subclass with a ``run()`` of its own may have none: ``(None, (), {})``)."""
    target = getattr(process, "_target", None)
    return target, tuple(getattr(process, "_args", ()) or ()), dict(getattr(process, "_kwargs", {}) or {})
