"""Gloo's connection lines on standard output, on the torch releases that print them there."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any

from autoddp.core._compat import _need, releases

#: torch releases whose gloo writes "[Gloo] Rank N is connected to M peer ranks..." to file
#: descriptor 1 (C++ ``std::cout``, unconditionally) whenever a gloo group connects: 2.8 up to 2.11,
#: whose gloo logs it at INFO instead (shown only with ``GLOO_LOG_LEVEL=INFO``).
GLOO_PRINTS_CONNECTIONS = ((2, 8), (2, 11))
GLOO_LINE = re.compile(rb"\[Gloo\] Rank \d+ is (NOT )?connected to")


def quiet_gloo_connections(hold_lines: Callable[[re.Pattern[bytes]], ContextManager[Any]]) -> None:
    """Keep gloo's connection lines out of this process's standard output (torch 2.8-2.10).

    Every group torch makes (``init_process_group``, ``new_group``) is made by
    ``distributed_c10d._new_process_group_helper``: its calls run under ``hold_lines(GLOO_LINE)``
    (``world.stdout.without_lines``). Installed once per process.
    """
    low, high = GLOO_PRINTS_CONNECTIONS
    if not low <= releases.release() < high:
        return
    from torch.distributed import distributed_c10d as c10d

    make = _need(c10d, "_new_process_group_helper", "to keep gloo's connection lines off stdout")
    if getattr(make, "_autoddp_quiet", False):
        return

    @functools.wraps(make)
    def quietly(*args: Any, **kwargs: Any) -> Any:
        with hold_lines(GLOO_LINE):
            return make(*args, **kwargs)

    quietly._autoddp_quiet = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = quietly
