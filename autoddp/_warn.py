"""The house's voice: warnings that point at the user's line, not at autoddp's (or torch's) own
frames, and ``say``: one ``autoddp: ...`` line on stderr.

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
#: Which (text, category, file, line, module) were shown instead of raised (the user's filters said error).
_SHOWN: set = set()


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Issue ``message`` attributed to the user's line (see the module docstring), never as an error."""
    frame = sys._getframe(1)
    user = _frames.user_frame(frame)  # None beyond the call path: the worker's machinery
    if user is not None:
        where = (user.f_code.co_filename, user.f_lineno, user.f_globals.get("__name__", ""))
    else:
        where = (*(CURRENT.function or ("<autoddp>", 0)), "autoddp")
    if _would_raise(message, category, where[2], where[1]):
        if (message, category, *where) not in _SHOWN:  # (shown once per line, as "default" shows)
            _SHOWN.add((message, category, *where))
            warnings.showwarning(category(message), category, where[0], where[1])
        return
    if user is not None:
        level = 2  # 1 would be this function's own call of warnings.warn
        while frame is not user:
            frame = frame.f_back
            level += 1
        warnings.warn(message, category, stacklevel=level)
        return
    filename, lineno = CURRENT.function or ("<autoddp>", 0)
    warnings.warn_explicit(message, category, filename, lineno, module="autoddp", registry=_REGISTRY)


def _would_raise(text: str, category: type[Warning], module: str, lineno: int) -> bool:
    """Whether the user's warning filters turn this warning into an exception (``-W error``,
    ``PYTHONWARNINGS=error``, ``warnings.simplefilter("error")``), matched as ``warnings`` matches.

    autoddp's notes must never change a script's control flow: such a warning is printed instead.
    """
    for action, pattern, kind, modules, line in warnings.filters:
        if (
            (pattern is None or pattern.match(text))
            and issubclass(category, kind)
            and (modules is None or modules.match(module))
            and line in (0, lineno)
        ):
            return action == "error"
    return warnings.defaultaction == "error"


def say(message: str) -> None:
    """One line for the user on stderr."""
    print(f"autoddp: {message}", file=sys.stderr, flush=True)


def one_line(error: BaseException) -> str:
    """The type and first line of an error's message."""
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
