"""The process groups of the user's DDP models, kept until the user's code and its atexit hooks end.

The DDP tutorial's shape (a Trainer holding a ``DistributedDataParallel``, ``main()`` calling
``destroy_process_group()`` and returning) frees the DDP after its group was destroyed. Its
C++ reducer then drops the last reference to the gloo group with the GIL held, and gloo's
destructor waits for its worker threads, one of which may still be freeing a finished all-reduce
made during a backward: such work carries a Python object (torch stashes the context of every
backward in the thread-local state the work copies), so that thread waits for the GIL. A
deadlock at exit, in about one run of six on a loaded machine.

Holding a Python reference to every group a DDP was built on moves the last reference here:
``release`` drops it after the user's code, when a group dropped from Python is destroyed with
the GIL released (torch >= 2.8, pytorch#154976), so gloo's threads finish and the process ends.
Before torch 2.8 the group's backends are held too and dropped after the groups
(``_compat.backends_to_outlive``): a backend's own Python object lets go of the GIL as it ends.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from autoddp.core import _compat, _patches


class KeptGroups:
    """While installed, every ``DistributedDataParallel`` made notes its process group here."""

    def __init__(self) -> None:
        self._groups: list[Any] = []
        self._backends: list[Any] = []  # (before torch 2.8: ended after the groups)
        self._patches = _patches.Patches()

    def install(self) -> None:
        """Note the group of each DDP made from now on (a class attribute: any import of DDP sees it)."""
        ddp = torch.nn.parallel.DistributedDataParallel
        original = ddp.__init__

        @functools.wraps(original)
        def init(ddp: Any, /, *args: Any, **kwargs: Any) -> None:
            original(ddp, *args, **kwargs)
            group = getattr(ddp, "process_group", None)
            if group is not None and not any(group is kept for kept in self._groups):
                self._groups.append(group)
                self._backends += _compat.backends_to_outlive(group)

        self._patches.install([(ddp, "__init__", init)])

    def uninstall(self) -> None:
        """Stop noting groups; those noted stay kept until ``release``."""
        self._patches.restore()

    def release(self) -> None:
        """Drop the kept groups, after the user's code and hooks let go of their models."""
        self.uninstall()
        self._groups.clear()
        self._backends.clear()

    def __len__(self) -> int:
        return len(self._groups)
