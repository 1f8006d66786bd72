"""The house's voice: warnings that point at the user's line, not at autoddp's (or torch's) own
frames, and ``say``: one ``autoddp: ...`` line on stderr.

Every warning is an ``errors.AutoDDPWarning`` (or a subclass) and its text begins ``autoddp:``, so
that a user can tell it and filter it (``warnings.filterwarnings("ignore", category=...)``).

``warn`` walks out of every frame that is not the user's (``_frames``: autoddp's, the standard
library's, an installed package's) and attributes the warning to the first frame beyond them: the
line of the user's code that led to it. Where no such frame is on the stack (a worker preparing
the arguments before the user's function runs), the warning is attributed to the function being
run (``state.CURRENT.function``), so it never shows as ``sys:1`` or a line inside autoddp.
"""

from __future__ import annotations

import sys
import warnings

from autoddp.core import _frames
from autoddp.core.errors import AutoDDPWarning
from autoddp.core.state import CURRENT

PREFIX = "autoddp: "

#: Which (text, category, line) were shown when attributed explicitly: each is shown once.
_REGISTRY: dict = {}
#: Which (text, category, file, line, module) were shown instead of raised (the user's filters said error).
_SHOWN: set = set()


def warn(message: str, category: type[AutoDDPWarning] = AutoDDPWarning) -> None:
    """Issue ``message`` attributed to the user's line (see the module docstring), never as an error,
    as autoddp's: of ``category`` (an ``AutoDDPWarning``), its text prefixed ``autoddp:`` once."""
    if not issubclass(category, AutoDDPWarning):
        raise TypeError(f"autoddp's warnings are AutoDDPWarnings, not {category.__name__}")
    message = _prefixed(message)
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


def _prefixed(message: str) -> str:
    """``message`` beginning ``autoddp:`` once (a text that begins with autoddp's name keeps it once:
    "autoddp cannot shard ..." reads "autoddp: cannot shard ...")."""
    if message.startswith(PREFIX):
        return message
    if message.startswith("autoddp "):
        message = message[len("autoddp ") :]
    return PREFIX + message


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


#: A warning filter by name, to travel to a fresh worker interpreter: (action, message pattern,
#: "module:qualname" of the category, module pattern, line).
Filter = tuple[str, "str | None", str, "str | None", int]


def filters_to_carry() -> list[Filter]:
    """The caller's warning filters (``warnings.filterwarnings`` calls, ``-W``), by name: a worker
    started as a fresh interpreter begins with its own, and must silence what the caller silenced."""
    return [
        (action, _pattern(message), f"{kind.__module__}:{kind.__qualname__}", _pattern(module), line)
        for action, message, kind, module, line in warnings.filters
    ]


def use_filters(carried: list[Filter] | None) -> None:
    """Make ``carried`` this process's warning filters (None: keep its own). A category this process
    has not imported (one of the caller's ``__main__``) is left out: nothing here can warn with it."""
    if carried is None:
        return
    warnings.resetwarnings()
    for action, message, name, module, line in carried:
        kind = _loaded_class(name)
        if kind is not None:
            warnings.filterwarnings(
                action, message=message or "", category=kind, module=module or "", lineno=line, append=True
            )


def _pattern(compiled: object) -> str | None:
    return getattr(compiled, "pattern", None)


def _loaded_class(name: str) -> type[Warning] | None:
    """The class ``module:qualname`` names, from a module already imported (never imports one)."""
    module, _, qualname = name.partition(":")
    found: object = sys.modules.get(module) if module != "__main__" else None
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, Warning) else None


def say(message: str) -> None:
    """One line for the user on stderr."""
    print(f"autoddp: {message}", file=sys.stderr, flush=True)


def one_line(error: BaseException) -> str:
    """The type and first line of an error's message, with the rank that raised it (a worker's
    exception re-raised by the launcher: ``[rank R of N]``, as its note says)."""
    text = str(error).splitlines()[0] if str(error) else ""
    rank, size = getattr(error, "autoddp_rank", None), getattr(error, "autoddp_world_size", None)
    if isinstance(rank, int) and isinstance(size, int):
        text = f"[rank {rank} of {size}] {text}".rstrip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
