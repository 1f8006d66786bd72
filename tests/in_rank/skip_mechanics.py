"""Checks autoddp/in_rank/rank_zero/skip.py on whatever Python runs this file: no torch, no autoddp import.

``python tests/in_rank/skip_mechanics.py`` prints ``skip mechanics ok on <version>`` and exits 0, or fails
with an AssertionError naming the case. tests/in_rank/test_rank0.py runs it with every Python it finds.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import pathlib
import sys
import textwrap
import threading

_PATH = pathlib.Path(__file__).resolve().parents[2] / "autoddp" / "in_rank" / "rank_zero" / "skip.py"
_spec = importlib.util.spec_from_file_location("autoddp_skip_under_test", _PATH)
skip = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(skip)


class block:
    """A minimal rank0-like block: skips its body when ``skipping`` is true."""

    def __init__(self, skipping: bool) -> None:
        self.skipping = skipping
        self.skipper = skip.BodySkipper()

    def __enter__(self) -> None:
        if self.skipping:
            self.skipper.start(sys._getframe(1))

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.skipping:
            return False
        return self.skipper.stop(exc_type)


def one_line() -> list:
    ran = []
    with block(True): ran.append("skipped")  # noqa: E701  # fmt: skip
    with block(False): ran.append("ran")  # noqa: E701  # fmt: skip
    return ran


def multi_line() -> list:
    ran = []
    with block(True):
        ran.append("a")
        ran.append("b")
    ran.append("after")
    return ran


def empty_body() -> str:
    with block(True):
        pass
    return "after"


def nested() -> list:
    ran = []
    with block(False):
        ran.append("outer")
        with block(True):
            ran.append("inner skipped")
        ran.append("outer again")
    with block(True):  # noqa: SIM117 - nesting is the case under test
        with block(False):
            ran.append("never")
    return ran


def loop() -> list:
    ran = []
    for i in range(200):
        with block(i % 2 == 0): ran.append(i)  # noqa: E701  # fmt: skip
        with block(i % 3 == 0):
            ran.append(-i)
    return ran


def generator():
    with block(True):
        x = 1
    yield "after"
    with block(False):
        x = 2
    yield x


async def coroutine() -> str:
    with block(True):
        await_free = "skipped"
    with block(False):
        await_free = "ran"
    return await_free


def in_thread() -> list:
    out: list = []

    def work() -> None:
        out.extend(multi_line())
        out.extend(one_line())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return out


def traced() -> list:
    """A user's tracer stays installed and sees the lines after the block, not the body."""
    seen: list[int] = []

    def tracer(frame, event, arg):
        if frame.f_code is traced_body.__code__:
            if event == "line":
                seen.append(frame.f_lineno - traced_body.__code__.co_firstlineno)
            return tracer
        return None

    sys.settrace(tracer)
    try:
        traced_body()
        still = sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert still, "the user's tracer was not restored"
    return seen


def traced_body() -> None:
    x = 0
    with block(True):
        x = 1
        x = 2
    x = 3
    x += 1


def problem(source: str) -> str | None:
    """body_problem() for the first ``with block(...)`` in ``source`` (given a file name)."""
    name = f"<skip-check-{abs(hash(source))}>"
    import linecache

    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    found: list = []

    class probe:
        def __enter__(self):
            found.append(skip.body_problem(sys._getframe(1), "block()"))
            found.append(skip.entered_by_with(sys._getframe(1)))

        def __exit__(self, *exc):
            return True  # the bodies below are never meant to finish

    namespace = {"block": probe, "asyncio": asyncio}
    exec(compile(source, name, "exec"), namespace)
    if "main" in namespace:
        result = namespace["main"]()
        if asyncio.iscoroutine(result):
            with contextlib.suppress(StopIteration):
                result.send(None)
            result.close()
        elif hasattr(result, "__next__"):
            next(result, None)
    assert found[1] is True, "entered_by_with() should see the with statement"
    return found[0]


def check_problems() -> None:
    refused = {
        "return": """
            def main():
                with block():
                    return 1
            """,
        "break": """
            def main():
                for i in range(3):
                    with block():
                        break
            """,
        "continue": """
            def main():
                for i in range(3):
                    with block():
                        if i:
                            continue
            """,
        "yield": """
            def main():
                with block():
                    yield 1
            """,
        "await": """
            async def main():
                with block():
                    await asyncio.sleep(0)
            """,
        "as x": """
            def main():
                with block() as x:
                    pass
            """,
        "break ": """
            def main():
                while True:
                    with block():
                        for i in range(2):
                            pass
                        else:
                            break
            """,
    }
    for keyword, source in refused.items():
        found = problem(textwrap.dedent(source))
        assert found is not None and keyword.strip() in found, (keyword, found)
    allowed = [
        """
        def main():
            with block():
                for i in range(3):
                    if i:
                        break
                    continue
        """,
        """
        def main():
            with block():
                def inner():
                    return 1
                inner()
        """,
        """
        def main():
            with block():
                f = lambda: (yield)
        """,
        """
        def main():
            with open("/dev/null") as fh, block():
                pass
        """,
        """
        with block():
            x = 1
        """,
    ]
    for source in allowed:
        found = problem(textwrap.dedent(source))
        assert found is None, (source, found)

    # Without source (python -c, exec of a string): allowed.
    found = []

    class probe:
        def __enter__(self):
            found.append(skip.body_problem(sys._getframe(1)))

        def __exit__(self, *exc):
            return False

    exec(
        compile("def main():\n    with block() as x:\n        pass\nmain()\n", "<string>", "exec"),
        {"block": probe},
    )
    assert found == [None], found

    class manual:
        def __enter__(self):
            found.append(skip.entered_by_with(sys._getframe(1)))

    manual().__enter__()
    assert found[-1] is False, "a direct __enter__() call is not a with statement"


def main() -> None:
    assert sys.gettrace() is None or "coverage" in sys.modules, sys.gettrace()
    before = sys.gettrace()
    assert one_line() == ["ran"], one_line()
    assert multi_line() == ["after"], multi_line()
    assert empty_body() == "after"
    assert nested() == ["outer", "outer again"], nested()
    expected = []
    for i in range(200):
        if i % 2:
            expected.append(i)
        if i % 3:
            expected.append(-i)
    assert loop() == expected, "loop"
    assert list(generator()) == ["after", 2]
    assert asyncio.run(coroutine()) == "ran"
    if not ("coverage" in sys.modules and sys.version_info[:2] == (3, 12)):
        # 3.12.1 + coverage crashes when a skip happens in a non-main thread (spike, section 3).
        assert in_thread() == ["after", "ran"]
    if sys.gettrace() is None:
        seen = traced()
        assert seen == [1, 2, 5, 6], seen  # x = 0, with, x = 3, x += 1
    check_problems()
    assert sys.gettrace() is before, "the global tracer was not restored"
    assert sys._getframe().f_trace is None or before is not None
    print(f"skip mechanics ok on {sys.version.split()[0]}")


if __name__ == "__main__":
    # The first skip of a process is the one the Python-version branches matter for (3.12 only
    # reads f_trace_opcodes once it has been set somewhere), so the case that goes first varies.
    first = sys.argv[1] if len(sys.argv) > 1 else "one-line"
    if first == "empty":
        assert empty_body() == "after"
    elif first == "thread":
        assert in_thread() == ["after", "ran"]
    ran_at_module_level = []
    with block(True): ran_at_module_level.append("skipped")  # noqa: E701  # fmt: skip
    with block(True):
        ran_at_module_level.append("skipped")
    ran_at_module_level.append("after")
    assert ran_at_module_level == ["after"], ran_at_module_level
    main()
