"""The package's shape: no import cycle, small modules, the public API as documented."""

from __future__ import annotations

import ast
import json
import pathlib

import autoddp
from conftest import run_python

PACKAGE = pathlib.Path(autoddp.__file__).resolve().parent
MAX_LINES = 400


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (``autoddp.launch`` for a package's __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The autoddp modules ``path`` imports, at module level or inside functions alike.

    ``from P import name`` counts as importing ``P.name`` when that is a module, else ``P``.
    The implicit import of a module's parent packages is not counted (Python finishes a package's
    ``__init__`` before its submodules need it back).
    """
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                targets.add(name if name in modules else node.module)
    return {name for name in targets if name in modules}


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycle = [*stack[stack.index(target) :], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert "autoddp" not in set().union(*(graph[n] for n in graph if n != "autoddp")), (
        "a submodule imports the package itself"
    )


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Whatever module a program imports first, the package loads (no order-dependent import)."""
    code = (
        "import importlib, json, sys\n"
        "import torch\n"
        f"names = {sorted(_modules())!r}\n"
        "failed = {}\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'autoddp' or m.startswith('autoddp.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed[name] = repr(exc)\n"
        "print(json.dumps(failed))\n"
    )
    result = run_python(["-c", code], timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {}


def test_no_module_is_over_the_size_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_the_public_api_is_the_documented_one():
    assert sorted(autoddp.__all__) == [
        "AutoDDPError",
        "CollectiveInRank0Error",
        "ConfigurationError",
        "Rank0Error",
        "RemoteError",
        "SerializationError",
        "UnevenBatchesError",
        "WorkerError",
        "barrier",
        "device",
        "distributed",
        "gather",
        "is_main",
        "load",
        "local_rank",
        "prepare",
        "progress",
        "rank",
        "rank0",
        "save",
        "unwrap",
        "world_size",
    ]
    from autoddp import console

    assert autoddp.print is console.print and "print" not in autoddp.__all__
    readme = (PACKAGE.parent / "README.md").read_text()
    undocumented = [n for n in autoddp.__all__ if f"autoddp.{n}" not in readme and f"`{n}" not in readme]
    assert undocumented == []
