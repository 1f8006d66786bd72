"""Warnings that point at the user's line, not at autoddp's (or torch's) own frames.

``warn`` walks out of every frame that is not the user's (``_frames``: autoddp's, the standard
library's, an installed package's) and attributes the warning to the first frame beyond them: the
line of the user's code that led to it. Where no such frame is on the stack (a worker preparing
the arguments before the user's function runs), the warning is attributed to the function being
run (``state.CURRENT.function``), so it never shows as ``sys:1`` or a line inside autoddp.
"""

from __future__ import annotations

import sys
import warnings

from autoddp import _frames
from autoddp.state import CURRENT

#: Which (text, category, line) were shown when attributed explicitly: each is shown once.
_REGISTRY: dict = {}


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Issue ``message`` attributed to the user's line (see the module docstring)."""
    frame = sys._getframe(1)
    user = _frames.user_frame(frame)  # None beyond the call path: the worker's machinery
    if user is not None:
        level = 2  # 1 would be this function's own call of warnings.warn
        while frame is not user:
            frame = frame.f_back
            level += 1
        warnings.warn(message, category, stacklevel=level)
        return
    filename, lineno = CURRENT.function or ("<autoddp>", 0)
    warnings.warn_explicit(message, category, filename, lineno, module="autoddp", registry=_REGISTRY)
