"""Checkpoints: ``save`` writes from rank 0 atomically, ``load`` reads onto this process's device.

A save never leaves a half-written file at its path: rank 0 writes a temporary file in the same
folder, flushes and fsyncs it, renames it over the path (``os.replace`` is atomic) and fsyncs
the folder, so a crash at any moment leaves either the previous checkpoint or the new one. A path
that is not a regular file (a device such as ``/dev/null``, a FIFO, ``/dev/stdout``) is written in
place, as one process writes it: a file renamed over it would replace the device itself.
Models are saved as their plain ``state_dict()`` (no DDP ``module.`` prefix), so a checkpoint
loads into the undecorated model too. Resume pattern::

    state = autoddp.load("ckpt.pt", default=None)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    ...
    autoddp.save({"model": model, "optimizer": optimizer, "epoch": epoch}, "ckpt.pt")
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from autoddp.core import _containers
from autoddp.in_rank import models
from autoddp.in_rank.rank_zero.block import run_on_rank0
from autoddp.in_rank.world import device

# Temporary files are named ".<checkpoint name>.<random>.autoddp-tmp" next to the checkpoint.
TEMPORARY_SUFFIX = ".autoddp-tmp"
_MISSING: Any = object()
_STANDARD_STREAMS = ("/dev/stdin", "/dev/stdout", "/dev/stderr")
_DESCRIPTORS = ("/dev/fd/", "/proc/")


def save(obj: Any, path: str | os.PathLike[str], *, sharded: bool = False) -> None:
    """Write ``obj`` to ``path`` from rank 0 only, atomically; every rank returns once it is complete.

    Modules (also DDP-wrapped or compiled), optimizers and anything else with ``state_dict()``,
    at the top or inside dicts, lists, tuples and dataclasses, are saved as their state dicts.
    Every rank builds that state first (a sharded model assembles its full state with a
    collective), then rank 0 writes it. A failure on rank 0 raises there and as ``Rank0Error`` on
    the other ranks. Called on rank 0 alone (``if autoddp.is_main():``) it writes without waiting
    for anyone: saves are paired across ranks per path, so such a save never satisfies a later
    save of another path that every rank makes.

    ``sharded=True``, or a ``path`` that ends with a separator or is a folder: every rank writes its
    own shards, as a distributed checkpoint (``checkpoint.distributed``); every rank must call it.
    """
    path = os.fspath(path)
    if sharded or path.endswith(os.sep) or os.path.isdir(path):
        from autoddp.in_rank.checkpoint import distributed

        distributed.save(obj, path)
        return
    state = _plain_state(obj)
    where = f"autoddp.save({path!r})"
    run_on_rank0(_write, (state, path), {}, where=where, series=f"save:{os.path.abspath(path)}")


def load(path: str | os.PathLike[str], default: Any = _MISSING, *, weights_only: bool = True) -> Any:
    """Read a checkpoint onto this process's device (``autoddp.device()``), e.g. to resume.

    When ``path`` does not exist, return ``default`` if one was given (``default=None`` starts
    fresh), else raise ``FileNotFoundError``. ``weights_only`` is passed to ``torch.load``: set it
    to False only for checkpoints you trust that hold objects other than tensors and containers.
    A folder written by ``save(..., sharded=True)`` loads on any world size
    (``autoddp.in_rank.checkpoint.distributed``).
    With ``strategy="fsdp"`` and several processes, a file's tensors come back memory-mapped on
    the CPU (``torch.load(mmap=True)``): loading them into the sharded model reads them on rank
    0 only, so no rank holds the whole model (move other tensors with ``.to(device)``).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        from autoddp.in_rank.checkpoint import distributed

        if distributed.is_checkpoint(path):
            return distributed.load(path)
    try:
        if _sharding_run():
            return _load_mapped(path, weights_only)
        return torch.load(path, map_location=device(), weights_only=weights_only)
    except FileNotFoundError:
        if default is not _MISSING:
            return default
        raise FileNotFoundError(
            errno.ENOENT,
            f"no checkpoint at {path!r}; to start fresh when there is none, "
            f"use autoddp.load({path!r}, default=None)",
            path,
        ) from None


def _sharding_run() -> bool:
    """True in a world of several processes that shards its models (strategy='fsdp', or 'auto'
    that chose it)."""
    from autoddp.core.state import CURRENT

    world = CURRENT.world
    return world is not None and world.world_size > 1 and models.sharding()


def _load_mapped(path: str, weights_only: bool) -> Any:
    """The checkpoint's tensors memory-mapped on the CPU: nothing is read until it is used.

    A full checkpoint loaded into a sharded model is read by rank 0 alone (which broadcasts one
    tensor at a time); the other ranks never read those tensors, so none holds the whole model.
    """
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
    from autoddp.core import _warn

    _warn.warn(
        f"autoddp.load({path!r}): this file is in torch's legacy format, which cannot be memory-mapped, "
        "so every rank reads it whole into host memory; save it again with torch.save (or autoddp.save) "
        "to load it in shards"
    )
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def _write(state: Any, path: str) -> None:
    """Rank 0's part of ``save``."""
    atomic_write(path, lambda file: torch.save(state, file))


def atomic_write(
    path: str, write: Callable[[BinaryIO], None], before_replace: Callable[[], None] | None = None
) -> None:
    """Have ``write`` fill a temporary file next to ``path``, fsync it, rename it over ``path``.

    A crash at any moment leaves either the previous file or the new one, never a torn one.
    ``before_replace`` runs between the two (a save waits there for the others' ``open``). A
    ``path`` that is not a regular file (``special``) is written in place instead, as by one process.
    """
    if special(path):
        with open(path, "wb") as file:
            write(file)
        return
    folder, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            errno.ENOENT,
            f"cannot save a checkpoint to {path!r}: the folder {folder!r} does not exist; "
            "create it first (os.makedirs(folder, exist_ok=True))",
            folder,
        )
    temporary = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}{TEMPORARY_SUFFIX}")
    # Created like open(path, "wb") would (permissions from the umask), but never replacing a file.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _remove_stale_temporaries(folder, name)
    _fsync_folder(folder)


def special(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` exists and is not a regular file (through symlinks): a device
    (``/dev/null``), a FIFO, a socket; or names an open file descriptor's file (``/dev/stdout``,
    ``/dev/fd/N``, ``/proc/...``), whatever that is. Such a path is written in place, never replaced
    by a file (``/dev/stdout`` sent to a file: that file stays the one the process writes to)."""
    absolute = os.path.abspath(os.fsdecode(os.fspath(path)))
    if absolute.startswith(_DESCRIPTORS) or absolute in _STANDARD_STREAMS:
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):  # absent (or unreadable): a regular file is made there
        return False


def _plain_state(obj: Any) -> Any:
    """``obj`` with every Module (unwrapped), optimizer and other ``state_dict()`` holder as its state.

    Containers are copied only where something inside changed, so state dicts keep their type and
    metadata. Sharded tensors (FSDP) are gathered whole: every rank takes part.
    """
    if isinstance(obj, torch.nn.Module):
        return models.state_dict(obj)
    if isinstance(obj, torch.optim.Optimizer):
        return models.optimizer_state_dict(obj)
    if isinstance(obj, (torch.Tensor, type)):
        return models.full_tensors(obj)
    if not isinstance(obj, (dict, list, tuple)):
        state_dict = getattr(obj, "state_dict", None)
        if callable(state_dict):
            return models.full_tensors(state_dict())
    return _containers.map_items(obj, _plain_state)


def _remove_stale_temporaries(folder: str, name: str) -> None:
    """Delete temporary files that earlier, interrupted saves of the same checkpoint left."""
    prefix = f".{name}."
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith(prefix) and entry.name.endswith(TEMPORARY_SUFFIX):
                middle = entry.name[len(prefix) : -len(TEMPORARY_SUFFIX)]
                if len(middle) == 12 and all(c in "0123456789abcdef" for c in middle):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)


def _fsync_folder(folder: str) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
