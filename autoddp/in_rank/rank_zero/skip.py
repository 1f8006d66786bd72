"""Skipping the body of a ``with`` statement in one frame, by tracing (pure Python, no torch).

``BodySkipper.start(frame)`` is called from a context manager's ``__enter__`` on a process that
must not run the body: it installs a no-op global tracer and points the caller frame's tracer
at a function raising ``_Skip``, so the frame's next opcode (before the body's first
statement) raises. ``__exit__`` then calls ``stop()``, which restores every tracer and returns
whether the body was skipped; the context manager swallows ``_Skip`` by returning that.

Measured constraints this module respects (see the spike notes):

* ``sys.settrace(previous)`` is the very last call of ``stop()``, and ``__exit__`` must call
  nothing after ``stop()``: a Python call after the previous tracer is back makes coverage's C
  tracer see a return it never saw enter, and it then loses or misplaces lines.
* CPython 3.12 honours ``f_trace_opcodes`` only when it is set before ``sys.settrace`` (until
  some frame has set it once; gh-103615), else one-line bodies run and an empty body leaks
  ``_Skip``; 3.13 (with coverage's sys.monitoring core) needs it after; 3.10 and 3.11 take after.
* Known: CPython 3.12.1 under ``coverage run`` with the ctrace or pytrace core crashes when a skip
  happens in a thread other than the main one (the sysmon core works); 3.10, 3.11, 3.13 do not.
* On 3.12+ a skip costs about 12 us (``sys.settrace`` re-instruments code), on 3.11 about 1.5 us.

``body_problem(frame)`` reads the caller's source to refuse bodies that cannot be skipped
safely (``return``, ``break``, ``yield`` ... and the ``as`` form).
"""

from __future__ import annotations

import ast
import dis
import itertools
import linecache
import sys
from types import FrameType
from typing import Any

# 3.12 only: f_trace_opcodes is read when sys.settrace instruments the code (gh-103615).
_OPCODES_BEFORE_SETTRACE = sys.version_info[:2] == (3, 12)

# The opcode that calls __enter__ for a ``with`` statement (3.14 has none: no check there).
_WITH_OPCODES = frozenset(dis.opmap[name] for name in ("BEFORE_WITH", "SETUP_WITH") if name in dis.opmap)


class _Skip(Exception):
    """Raised in the caller frame by the tracer to jump from the ``with`` line to ``__exit__``."""


def is_skip(exc_type: type[BaseException] | None) -> bool:
    """Whether an exception type reaching ``__exit__`` is the skip itself."""
    return exc_type is _Skip


def _ignore(frame: FrameType, event: str, arg: Any) -> None:
    """Global tracer while skipping: trace no new frame."""
    return None


def _raise_skip(frame: FrameType, event: str, arg: Any) -> None:
    """Local tracer of the skipping frame: leave the body before its first instruction."""
    raise _Skip


class BodySkipper:
    """Skips the body of the ``with`` statement whose ``__enter__`` is running in ``frame``.

    One instance per skipped block: ``start`` as the last step of ``__enter__``, ``stop`` as
    the last call of ``__exit__``.
    """

    __slots__ = ("_frame", "_global", "_local", "_opcodes")

    def __init__(self) -> None:
        self._frame: FrameType | None = None
        self._global: Any = None
        self._local: Any = None
        self._opcodes = False

    def start(self, frame: FrameType) -> None:
        """Arrange for ``frame`` to raise ``_Skip`` at its next instruction."""
        self._frame = frame
        self._global = sys.gettrace()
        self._local = frame.f_trace
        self._opcodes = frame.f_trace_opcodes
        if _OPCODES_BEFORE_SETTRACE:
            frame.f_trace_opcodes = True
        sys.settrace(_ignore)
        frame.f_trace = _raise_skip
        if not _OPCODES_BEFORE_SETTRACE:
            frame.f_trace_opcodes = True

    def stop(self, exc_type: type[BaseException] | None) -> bool:
        """Put every tracer back; True when ``exc_type`` is the skip (the caller swallows it).

        Restoring the global tracer is the last call here; call nothing after this returns.
        """
        frame, previous = self._frame, self._global
        skipped = exc_type is _Skip
        if frame is not None:
            frame.f_trace = self._local
            frame.f_trace_opcodes = self._opcodes
        self._frame = self._global = self._local = None
        sys.settrace(previous)
        return skipped


def entered_by_with(frame: FrameType) -> bool:
    """Whether ``frame`` is calling ``__enter__`` from a ``with`` statement (not ExitStack etc.)."""
    if not _WITH_OPCODES:
        return True
    code = frame.f_code.co_code
    lasti = frame.f_lasti
    return 0 <= lasti < len(code) and code[lasti] in _WITH_OPCODES


def body_problem(frame: FrameType, name: str = "rank0()") -> str | None:
    """Why the ``with`` statement entering in ``frame`` cannot have its body skipped, or None.

    Refused: an ``as`` target for ``name`` (unbound where skipped), and ``return``, ``yield``,
    ``await``, ``async for``/``async with``, and ``break``/``continue`` that leave the body
    (they would change control flow on one rank only). None when the source is unavailable.
    """
    code = frame.f_code
    lines = linecache.getlines(code.co_filename, frame.f_globals)
    if not lines:
        return None
    try:
        tree = ast.parse("".join(lines), code.co_filename)
    except (SyntaxError, ValueError):
        return None
    found = _find_with(tree, frame)
    if found is None:
        return None
    node, item = found
    where = f"{code.co_filename}:{node.lineno}"
    if item is not None and item.optional_vars is not None:
        target = ast.unparse(item.optional_vars)
        return (
            f"`with {name} as {target}:` at {where}: the body is skipped on the other ranks, "
            f"so {target} would be unbound there; drop `as {target}`"
        )
    statement = _control_flow(node.body, in_loop=False)
    if statement is not None:
        keyword, lineno = statement
        return (
            f"`{keyword}` at {code.co_filename}:{lineno} inside the `with {name}:` body at {where}: "
            "that body runs on one rank only, so it would change control flow there alone and "
            "the ranks would fall out of step; move it out of the block"
        )
    return None


def _position(frame: FrameType) -> tuple[int | None, int | None, int | None, int | None] | None:
    """Source position of the instruction ``frame`` is at (3.11+), else None."""
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is None:
        return None
    return next(itertools.islice(positions(), frame.f_lasti // 2, None), None)


def _find_with(tree: ast.AST, frame: FrameType) -> tuple[ast.With, ast.withitem | None] | None:
    """The ``with`` statement (and, when it can tell, the item) that ``frame`` is entering."""
    lineno = frame.f_lineno
    position = _position(frame)
    withs = [node for node in ast.walk(tree) if isinstance(node, ast.With)]
    if position is not None and position[2] is not None:
        start = (position[0], position[2])
        for node in withs:
            for item in node.items:
                expr = item.context_expr
                if (expr.lineno, expr.col_offset, expr.end_lineno, expr.end_col_offset) == (
                    position[0],
                    position[2],
                    position[1],
                    position[3],
                ):
                    return node, item  # 3.13+: the position is the item's expression
            if (node.lineno, node.col_offset) == start:
                return node, _our_item(node)  # 3.11, 3.12: the position is the whole statement
    candidates = [node for node in withs if node.lineno == lineno] or [
        node
        for node in withs
        if any(
            item.context_expr.lineno <= lineno <= (item.context_expr.end_lineno or 0) for item in node.items
        )
    ]
    if not candidates:
        return None
    node = max(candidates, key=lambda n: n.lineno)
    return node, _our_item(node)


def _our_item(node: ast.With) -> ast.withitem | None:
    """The item that is ours when the position cannot tell: the only one, or the only rank0 one."""
    if len(node.items) == 1:
        return node.items[0]
    named = [item for item in node.items if "rank0" in ast.dump(item.context_expr)]
    return named[0] if len(named) == 1 else None


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_LOOPS = (ast.For, ast.While)
_FORBIDDEN = {
    ast.Return: "return",
    ast.Yield: "yield",
    ast.YieldFrom: "yield from",
    ast.Await: "await",
    ast.AsyncFor: "async for",
    ast.AsyncWith: "async with",
}


def _control_flow(nodes: list[ast.AST], *, in_loop: bool) -> tuple[str, int] | None:
    """The first statement in ``nodes`` that leaves the block or suspends it: (keyword, line)."""
    for node in nodes:
        found = _visit(node, in_loop)
        if found is not None:
            return found
    return None


def _visit(node: ast.AST, in_loop: bool) -> tuple[str, int] | None:
    if isinstance(node, _SCOPES):
        return None  # a nested function or class body is its own scope
    keyword = _FORBIDDEN.get(type(node))
    if keyword is not None:
        return keyword, getattr(node, "lineno", 0)
    if isinstance(node, (ast.Break, ast.Continue)) and not in_loop:
        return ("break" if isinstance(node, ast.Break) else "continue"), node.lineno
    if isinstance(node, _LOOPS):
        # break/continue in the loop's own body stay inside the block; in its `else:` they do not.
        head = [node.test] if isinstance(node, ast.While) else [node.target, node.iter]
        return (
            _control_flow(head, in_loop=in_loop)
            or _control_flow(node.body, in_loop=True)
            or _control_flow(node.orelse, in_loop=in_loop)
        )
    return _control_flow(list(ast.iter_child_nodes(node)), in_loop=in_loop)
