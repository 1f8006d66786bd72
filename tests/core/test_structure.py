"""The package's shape: the wings ARCHITECTURE.md draws (imported only downward, launch reaching in_rank
through the wire), no import cycle, small modules, few entries at the root, the public API as documented."""

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
MAX_ROOT_ENTRIES = 10


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


def _table(header: str) -> list[list[str]]:
    """The rows of ARCHITECTURE.md's table that starts with ``header``: each row's cells."""
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    table = text[text.index(header) :].split("\n\n", 1)[0]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]


#: The wings, top down: each imports only from the wings below it (doors -> launch -> in_rank ->
#: core); ``launch`` reaches ``in_rank`` only through the wire (ARCHITECTURE.md's wire table).
WINGS = ("doors", "launch", "in_rank", "core")


def _wing(name: str) -> str:
    """The wing of module ``name``: its folder under autoddp/, or the doors for the root's modules
    and ``command/``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else "doors"


def _wire() -> set[str]:
    """The modules and folders of ``in_rank`` that ARCHITECTURE.md's wire table lets launch/ import."""
    return {re.findall(r"`([^`]+)`", row[0])[0] for row in _table("| Wire | ")}


def _crossings(modules: dict[str, pathlib.Path]) -> list[str]:
    """Every import that breaks the wings' order, said in a line."""
    wire = {"autoddp." + name for name in _wire()}
    found = []
    for name, path in modules.items():
        for target in _imports(path, modules) - {name}:
            here, there = _wing(name), _wing(target)
            if WINGS.index(there) < WINGS.index(here):
                found.append(f"{name} ({here}) imports {target} ({there}), a wing above it")
            elif (here, there) == ("launch", "in_rank") and not any(
                target == w or target.startswith(w + ".") for w in wire
            ):
                found.append(f"{name} imports {target}, which is not on the wire")
    return sorted(found)


@pytest.mark.unit
def test_wings_import_only_downward_and_launch_reaches_in_rank_through_the_wire_only():
    """doors -> launch -> in_rank -> core: in_rank never imports launch, core imports neither, no
    wing imports the doors, and launch imports from in_rank only what the wire table names."""
    assert _crossings(_modules()) == []


@pytest.mark.unit
def test_the_wing_check_fails_on_each_kind_of_crossing(tmp_path):
    """The check above is not vacuous: an import up from in_rank or core, or from launch to an
    in_rank module off the wire, is each reported."""
    modules = dict(_modules())
    cases = {
        "autoddp.in_rank.capture.bad": "from autoddp.launch import local\n",
        "autoddp.core.bad": "from autoddp.in_rank.world import placement\n",
        "autoddp.core.worse": "from autoddp.launch import output\n",
        "autoddp.launch.bad": "from autoddp.in_rank.models import ddp\n",
        "autoddp.in_rank.bad": "from autoddp import options\n",
    }
    for name, source in cases.items():
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(source)
        found = _crossings({**modules, name: path})
        assert [line for line in found if line.startswith(name + " ")], name


@pytest.mark.unit
def test_the_wing_and_wire_tables_are_the_code():
    """ARCHITECTURE.md's wing table names the four wings top down; every wire entry exists, is
    in in_rank/, and is used by launch/ (the list does not rot); the wire stays short."""
    rows = _table("| Wing | ")
    named = [re.findall(r"`([^`/]+)/?`", row[0])[0] for row in rows]
    assert named[1:] == list(WINGS[1:]) and len(rows) == 4, named
    modules = _modules()
    wire = _wire()
    assert 0 < len(wire) <= 5, wire
    used = {
        target
        for name, path in modules.items()
        if _wing(name) == "launch"
        for target in _imports(path, modules)
    }
    for entry in wire:
        full = "autoddp." + entry
        assert full in modules and _wing(full) == "in_rank", entry
        assert any(u == full or u.startswith(full + ".") for u in used), f"launch/ no longer uses {entry}"


@pytest.mark.unit
def test_folders_are_layers_too_no_two_import_each_other():
    """Inside the wings a folder is a concept and a layer: the graph of folders (``in_rank/capture``,
    ``launch/hang``, ...; a wing's own modules each their own node) has no cycle."""
    modules = _modules()

    def folder(name: str) -> str:
        parts = name.split(".")
        package = ".".join(parts[:3])
        if (
            len(parts) >= 3
            and parts[1] in WINGS
            and package in modules
            and modules[package].name == "__init__.py"
        ):
            return "/".join(parts[1:3]) + "/"  # a folder inside a wing: in_rank/capture/
        if len(parts) >= 2 and parts[1] == "command":
            return "command/"
        return ".".join(parts[1:]) or "autoddp"  # a wing's own module, a door

    graph: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for name, path in modules.items():
        for target in _imports(path, modules) - {name}:
            a, b = folder(name), folder(target)
            if a != b:
                graph.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{name} imports {target}")
    cycle = _a_cycle(graph)
    assert cycle == [], "folders import each other: " + "; ".join(
        why[a, b] for a, b in itertools.pairwise(cycle)
    )
    assert {"in_rank/capture/", "in_rank/worker/", "launch/hang/", "core/environment/"} <= set(graph)


@pytest.mark.unit
def test_few_entries_at_the_root_and_strategies_behind_their_seam():
    """At most 10 entries in autoddp/ (the doors and the three wings); strategy-specific code is
    reached through in_rank.models only."""
    root = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(root) <= MAX_ROOT_ENTRIES, root
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
        "MemoryPlanError",
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
