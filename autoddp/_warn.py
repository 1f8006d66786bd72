"""Warnings that point at the user's line, not at autoddp's (or torch's) own frames.

``warn`` walks out of every frame that belongs to autoddp, torch, wrapt or the standard library's
``functools``/``contextlib`` and attributes the warning to the first frame beyond them: the
line of the user's code that led to it. Where no such frame is on the stack (a worker preparing
the arguments before the user's function runs), the warning is attributed to the function being
run (``state.CURRENT.function``), so it never shows as ``sys:1`` or a line inside autoddp.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import torch

from autoddp.state import CURRENT

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIPPED = (
    _HERE,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(functools.__file__)) + os.sep + "functools.py",
    os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep + "contextlib.py",
    os.sep + "wrapt" + os.sep,
)
#: The one call path (``running.run_in_world``): frames beyond it are never the user's.
_CALL_PATH = _HERE + "running.py"
#: Which (text, category, line) were shown when attributed explicitly: each is shown once.
_REGISTRY: dict = {}


def is_library(filename: str) -> bool:
    """True for code of autoddp, torch, wrapt or the standard helpers: never the user's line."""
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    return path.startswith(_SKIPPED[:4]) or _SKIPPED[4] in path


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Issue ``message`` attributed to the user's line (see the module docstring)."""
    frame = sys._getframe(1)
    level = 2  # 1 would be this function's own call of warnings.warn
    while frame is not None and is_library(frame.f_code.co_filename):
        if frame.f_code.co_filename == _CALL_PATH:  # below it: the worker's machinery, not user code
            frame = None
            break
        frame = frame.f_back
        level += 1
    if frame is not None:
        warnings.warn(message, category, stacklevel=level)
        return
    filename, lineno = CURRENT.function or ("<autoddp>", 0)
    warnings.warn_explicit(message, category, filename, lineno, module="autoddp", registry=_REGISTRY)
