"""The package's shape: the layers ARCHITECTURE.md draws, no import cycle, small modules, few modules
at the root, the public API as documented."""

from __future__ import annotations

import ast
import itertools
import json
import pathlib
import re

import pytest

import autoddp
from conftest import run_python

PACKAGE = pathlib.Path(autoddp.__file__).resolve().parent
MAX_LINES = 400
MAX_ROOT_MODULES = 15


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


def _a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of ``graph`` (its nodes in order, the first again at the end), or [] for none."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str]:
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            found = visit(target) if target not in state else []
            if found:
                return found
        stack.pop()
        state[name] = "done"
        return []

    for name in sorted(graph):
        found = visit(name) if name not in state else []
        if found:
            return found
    return []


@pytest.mark.unit
def test_the_import_graph_has_no_cycle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    cycle = _a_cycle(graph)
    assert cycle == [], "import cycle: " + " -> ".join(cycle)
    assert "autoddp" not in set().union(*(graph[n] for n in graph if n != "autoddp")), (
        "a submodule imports the package itself"
    )


def _layers() -> list[tuple[str, list[str]]]:
    """ARCHITECTURE.md's layer table: (layer, the module names in its Modules column), in row order."""
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    table = text[text.index("| Layer | Modules | Holds |") :].split("\n\n", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
    return [
        (layer.strip(), [n for n in re.findall(r"`([^`]+)`", names) if n != "__init__"])
        for layer, names in rows
    ]


def _layer_of_each_module() -> dict[str, int]:
    """Each module's layer (0 for the first row): named exactly, else through the nearest folder
    named with a ``/``; every module in exactly one row."""
    modules = _modules()
    exact: dict[str, int] = {}
    folders: dict[str, int] = {}
    for index, (_layer, names) in enumerate(_layers()):
        for name in names:
            full = "autoddp" if name == "autoddp" else "autoddp." + name.rstrip("/")
            target = folders if name.endswith("/") else exact
            assert full not in target, f"{name} is in two rows of the layer table"
            assert full in modules, f"the layer table names {name}, which is not a module"
            target[full] = index
    found = {}
    for name in modules:
        if name in exact:
            found[name] = exact[name]
            continue
        parents = [f for f in folders if name == f or name.startswith(f + ".")]
        assert parents, f"{name} is in no row of ARCHITECTURE.md's layer table"
        found[name] = folders[max(parents, key=len)]
    return found


@pytest.mark.unit
def test_no_import_runs_back_up_a_layer():
    """Rows of the layer table are in dependency order: a module imports from its own row or
    those above it (the table's first row is the bottom layer, the leaves)."""
    modules = _modules()
    layer = _layer_of_each_module()
    names = [row for row, _ in _layers()]
    upward = sorted(
        f"{name} ({names[layer[name]]}) imports {target} ({names[layer[target]]})"
        for name, path in modules.items()
        for target in _imports(path, modules) - {name}
        if layer[target] > layer[name]
    )
    assert upward == []


def _folder_of(name: str, modules: dict[str, pathlib.Path]) -> str:
    """The folder (concept) a module belongs to; a module at the root is its own."""
    parts = name.split(".")
    top = ".".join(parts[:2])
    if len(parts) >= 2 and top in modules and modules[top].name == "__init__.py":
        return parts[1] + "/"
    return parts[-1]


@pytest.mark.unit
def test_folders_are_layers_too_no_two_import_each_other():
    """A folder is a concept and a layer: its imports of other folders run one way only (the
    folder graph, root modules each their own node, has no cycle)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for name, path in modules.items():
        for target in _imports(path, modules) - {name}:
            a, b = _folder_of(name, modules), _folder_of(target, modules)
            if a != b:
                graph.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{name} imports {target}")
    cycle = _a_cycle(graph)
    assert cycle == [], "folders import each other: " + "; ".join(
        why[a, b] for a, b in itertools.pairwise(cycle)
    )
    assert {"world/", "worker/", "capture/", "hang/", "launch/"} <= set(graph)


@pytest.mark.unit
def test_the_layer_table_is_checked():
    """The table read here is the one on the page (a module moved a row is caught)."""
    layers = dict(_layers())
    assert "errors" in layers["leaves"] and "launch/" in layers["launching"]
    assert layers["front doors"][-1] == "autoddp" and "worker" in layers["leaves"]
    layer = _layer_of_each_module()
    assert layer["autoddp.launch.local"] == [row for row, _ in _layers()].index("launching")
    assert layer["autoddp.in_rank.capture.passes"] == [row for row, _ in _layers()].index("in a world")


@pytest.mark.unit
def test_few_modules_at_the_root_and_strategies_behind_their_seam():
    root = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
    modules = _modules()
    strategies = {
        "autoddp.in_rank.models." + n
        for n in ("ddp", "fsdp", "_routing", "_averaging", "_reduction", "_reads", "_start", "_fsdp_state")
    }
    reached = sorted(
        f"{name} imports {target}"
        for name, path in modules.items()
        if not name.startswith("autoddp.in_rank.models")
        for target in _imports(path, modules) & strategies
    )
    assert reached == [], "strategy-specific code is reached through autoddp.in_rank.models only"


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


@pytest.mark.unit
def test_no_module_is_over_the_size_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


MAX_FUNCTION_LINES = 80


@pytest.mark.unit
def test_no_function_is_over_eighty_lines():
    """A function a reader can hold at once: the longest split into named steps."""
    long = sorted(
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    )
    assert long == []


@pytest.mark.unit
def test_the_public_api_is_the_documented_one():
    assert sorted(autoddp.__all__) == [
        "AutoDDPError",
        "AutoDDPWarning",
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
    from autoddp.in_rank import console

    assert autoddp.print is console.print and "print" not in autoddp.__all__
    pages = "".join(p.read_text() for p in sorted((PACKAGE.parent / "docs").rglob("*.md")))
    prose = pages.replace("::: autoddp.", "")  # the API page's directives are not prose
    undocumented = [n for n in autoddp.__all__ if f"autoddp.{n}" not in prose and f"`{n}" not in prose]
    assert undocumented == [], "every export is described in the docs' pages, beyond the API page"


@pytest.mark.unit
def test_the_package_ships_its_license_and_type_marker():
    """setup.cfg's license has its file, and the package says it is typed (PEP 561)."""
    root = PACKAGE.parent
    config = (root / "setup.cfg").read_text()
    assert "license = BSD-3-Clause" in config and "license_files = LICENSE" in config
    assert "BSD 3-Clause License" in (root / "LICENSE").read_text()
    assert (PACKAGE / "py.typed").exists() and "autoddp = py.typed" in config
    assert (root / "CHANGELOG.md").read_text().startswith("# Changelog")


@pytest.mark.unit
def test_each_autoddp_variable_is_spelled_once():
    """The launcher-worker contract's names live in ``autoddp/core/_variables.py``, nowhere else."""
    spelled = sorted(
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "_variables.py"
        for name in re.findall(r"[\"'](AUTODDP_[A-Z_]+)[\"']", path.read_text())
    )
    assert spelled == []
