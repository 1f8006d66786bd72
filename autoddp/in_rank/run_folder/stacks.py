"""The Python stacks a worker writes when autoddp stops it (faulthandler's dump), and reading them
back cut before the worker's own frames: what the caller shows of a rank that hung or was stopped."""

from __future__ import annotations

import os

from autoddp.core import _frames


def user_stack(stack: str) -> str:
    """A faulthandler dump (most recent call first) cut before the worker's own frames."""
    kept = []
    for line in stack.splitlines():
        if _frames.runner_line(line):
            break
        kept.append(line)
    return "\n".join(kept)


def stack_path(folder: str, rank: int) -> str:
    """Where a worker's stacks are written when autoddp stops it."""
    return os.path.join(folder, f"stack-{rank}.txt")


def read_stack(folder: str, rank: int) -> str:
    """The stacks a stopped worker wrote, or '' if it wrote none."""
    try:
        with open(stack_path(folder, rank)) as handle:
            return user_stack(handle.read().strip())
    except OSError:
        return ""
