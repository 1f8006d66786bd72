"""The one rule for "the user's frame": which code is autoddp's, a library's, the runner's, or the user's.

Warnings point at the user's line, capture names the line that made a model or loader, the hang
report shows the user's frames of each rank's stack, and tracebacks leave out the frames that only
ran the user's code: all of them ask this module. A file is:

- **autoddp's** when it lies in autoddp's own package folder (compared by real path, so an
  editable or symlinked install counts too);
- **a library's** when it is autoddp's, one of Python's frozen modules (``<frozen runpy>``), or
  lies under the standard library, a site-packages folder, or torch's or wrapt's own folder;
- **a runner's** (its frames are below the user's code, never part of it) for autoddp's call path
  (``in_rank/worker/running.py``, ``process.py``, ``script.py``) and ``runpy``;
- **a pass-through** (left out of tracebacks, kept in stacks) for the hang report's marks and
  capture's ``open`` (``in_rank/capture/opens.py``);
- **the user's** otherwise, code given as text (``<string>``, ``<stdin>``) included.

This module imports nothing of autoddp (a leaf) and never imports torch or wrapt: it finds where
they are installed without loading them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import site
import sys
import sysconfig
import types
from collections.abc import Callable

#: autoddp's own package folder (real path, ending in a separator).
AUTODDP = os.path.join(os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "")
#: autoddp's call path, named once: the user's code runs below these frames.
CALL_PATH = ("in_rank/worker/running.py", "in_rank/worker/process.py", "in_rank/worker/script.py")
#: autoddp's frames that only pass a call of the user's on (the hang report's marks around torch's
#: collectives, capture's ``open``): left out of the tracebacks shown to the user.
PASS_THROUGH = ("in_rank/hang/marks.py", "in_rank/capture/opens.py")
#: Libraries found by their own folder (also where they are not installed in site-packages).
_PACKAGES = ("torch", "wrapt")

_USER, _LIBRARY, _RUNNER = 0, 1, 2
#: A frame's line in a traceback (``line 3, in f``) or a faulthandler dump (``line 3 in f``).
_FILE_LINE = re.compile(r'^\s*File "(.*)", line \d+,? in ')


def _package_folders() -> dict[str, str]:
    """{real folder with a trailing separator: package name} for autoddp, torch and wrapt."""
    folders = {AUTODDP: "autoddp"}
    for name in _PACKAGES:
        module = sys.modules.get(name)
        try:
            spec = module.__spec__ if module is not None else importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            folders[os.path.join(os.path.realpath(location), "")] = name
    return folders


def _library_roots() -> tuple[str, ...]:
    """The standard library's and the site-packages folders (real paths), longest first."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(os.path.dirname(os.__file__))
    roots.update(getattr(site, "getsitepackages", list)())
    if site.ENABLE_USER_SITE:
        roots.add(site.getusersitepackages())
    real = {os.path.join(os.path.realpath(root), "") for root in roots}
    real.discard(os.sep)  # (a root of "/" would make every file a library's)
    return tuple(sorted(real, key=len, reverse=True))


def _standard_library() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the standard library's folders, the site-packages folders), real paths: a site-packages
    folder may lie inside the standard library's (a Python without a venv)."""
    paths = sysconfig.get_paths()
    stdlib = {paths[k] for k in ("stdlib", "platstdlib") if k in paths} | {os.path.dirname(os.__file__)}
    packages = {paths[k] for k in ("purelib", "platlib") if k in paths}
    packages.update(getattr(site, "getsitepackages", list)())

    def real(roots: set[str]) -> tuple[str, ...]:
        return tuple({os.path.join(os.path.realpath(root), "") for root in roots})

    return real(stdlib), real(packages)


_FOLDERS = _package_folders()
_ROOTS = _library_roots()
_STDLIB, _SITE_PACKAGES = _standard_library()
_PASS_FILES = frozenset(os.path.join(AUTODDP, name) for name in PASS_THROUGH)
_RUNNER_FILES = frozenset(
    {os.path.join(AUTODDP, name) for name in CALL_PATH}
    | {os.path.realpath(os.path.join(os.path.dirname(os.__file__), "runpy.py"))}
)


@functools.lru_cache(maxsize=4096)
def _kind(path: str) -> int:
    if path.startswith("<"):  # code without a file: Python's frozen modules, or text (<string>)
        return _RUNNER if path == "<frozen runpy>" else _LIBRARY if path.startswith("<frozen ") else _USER
    real = os.path.realpath(path)
    if real in _RUNNER_FILES:
        return _RUNNER
    return _LIBRARY if real.startswith((*_FOLDERS, *_ROOTS)) else _USER


def is_autoddp(path: str) -> bool:
    """Whether ``path`` (a frame's file) is one of autoddp's own modules."""
    return not path.startswith("<") and os.path.realpath(path).startswith(AUTODDP)


def is_package(path: str, name: str) -> bool:
    """Whether ``path`` (a frame's file) is in package ``name``'s folder (autoddp, torch, wrapt)."""
    if path.startswith("<"):
        return False
    real = os.path.realpath(path)
    return any(package == name and real.startswith(folder) for folder, package in _FOLDERS.items())


@functools.lru_cache(maxsize=1024)
def is_standard_library(path: str) -> bool:
    """Whether ``path`` is Python's own (the standard library, a frozen module), not a package's."""
    if path.startswith("<"):
        return path.startswith("<frozen ")
    real = os.path.realpath(path)
    return real.startswith(_STDLIB) and not real.startswith(_SITE_PACKAGES)


def is_library(path: str) -> bool:
    """Whether ``path`` is never the user's code: autoddp's, the standard library's or a package's."""
    return _kind(path) != _USER


def is_user(path: str) -> bool:
    """Whether ``path`` is the user's own code (see the module docstring)."""
    return _kind(path) == _USER


def is_runner(path: str) -> bool:
    """Whether frames of ``path`` only run the user's code (autoddp's call path, runpy)."""
    return _kind(path) == _RUNNER


def user_frame(
    frame: types.FrameType | None, also: Callable[[types.FrameType], bool] | None = None
) -> types.FrameType | None:
    """The first frame from ``frame`` outwards that is the user's, or None.

    ``also``: frames it is true for are passed as well (capture passes a model's own ``__init__``).
    None where a runner's frame comes first: beyond it lies the worker's set-up, or in a forked
    worker the stack of the process it was copied from, never this run's user code.
    """
    while frame is not None:
        kind = _kind(frame.f_code.co_filename)
        if kind == _RUNNER:
            return None
        if kind == _USER and not (also is not None and also(frame)):
            return frame
        frame = frame.f_back
    return None


def without_runners(tb: types.TracebackType | None, keep_last: bool = False) -> types.TracebackType | None:
    """``tb`` without its leading runner frames, so that it begins at the user's code.

    ``keep_last``: never drop the innermost frame (a failure of the runner itself keeps its line).
    """
    while tb is not None and is_runner(tb.tb_frame.f_code.co_filename):
        if keep_last and tb.tb_next is None:
            break
        tb = tb.tb_next
    return without_pass_through(tb)


def without_pass_through(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without autoddp's pass-through frames (``PASS_THROUGH``; relinked in place), except
    an innermost one (a failure of autoddp's own there keeps its line)."""
    head = tb
    while head is not None and head.tb_next is not None and _passes(head):
        head = head.tb_next
    kept = head
    while kept is not None and kept.tb_next is not None:
        after = kept.tb_next
        while after.tb_next is not None and _passes(after):
            after = after.tb_next
        kept.tb_next = after
        kept = after
    return head


def _passes(tb: types.TracebackType) -> bool:
    return is_pass_through(tb.tb_frame.f_code.co_filename)


def is_pass_through(path: str) -> bool:
    """Whether frames of ``path`` only pass a call of the user's on (``PASS_THROUGH``)."""
    return os.path.realpath(path) in _PASS_FILES


def runner_line(line: str) -> bool:
    """Whether a line of a printed traceback or a faulthandler dump is a runner's frame."""
    found = _FILE_LINE.match(line)
    return found is not None and is_runner(found.group(1))


def short(path: str) -> str:
    """A frame's file as shown to the user: ``train.py`` for theirs, ``torch/nn/modules/module.py``
    (from the package down) for a library's."""
    if path.startswith("<"):
        return path
    if is_user(path):
        return os.path.basename(path)
    real = os.path.realpath(path)
    for folder, name in _FOLDERS.items():
        if real.startswith(folder):
            return os.path.join(name, real[len(folder) :])
    for root in _ROOTS:
        if real.startswith(root):
            return real[len(root) :]
    return path
