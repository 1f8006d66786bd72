"""One door for every launch: the decorator and the command both go through ``autoddp.launch.run``
with one request type, and where a target runs is decided once (``launch.door.way``).

The doors' real 2-process runs through it are test_decorator.py's and test_cli.py's.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import autoddp
from autoddp import launch
from autoddp.core import backends, environment
from autoddp.core.state import RunOptions
from autoddp.in_rank.worker.running import Job
from autoddp.launch import door
from autoddp.launch.plan import Nodes
from autoddp.launch.request import Request, Script
from autoddp.options import Options

PACKAGE = pathlib.Path(autoddp.__file__).parent
#: The launchers behind the door: named only inside launch/.
LAUNCHERS = {"local", "nodes", "in_place"}
ENTRY_POINTS = {
    "run_function",
    "run_script",
    "run_agent",
    "exec_script",
    "launch_function",
    "launch_script",
    "launch_nodes",
}


def _tree(relative: str) -> ast.Module:
    return ast.parse((PACKAGE / relative).read_text())


def _calls(tree: ast.Module) -> set[str]:
    """``a.b(...)`` calls in ``tree``, as "a.b"."""
    return {
        f"{node.func.value.id}.{node.func.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
    }


@pytest.mark.unit
def test_both_doors_call_the_one_launch_with_a_request_made_from_their_options():
    decorator, cli, runs = _tree("decorator.py"), _tree("cli.py"), _tree("command/runs.py")
    assert {"launch.run", "options.request"} <= _calls(decorator)
    assert {"flags_launch.launch_of", "runs.run"} <= _calls(cli)
    assert "settings.request" in _calls(_tree("command/flags_launch.py"))
    assert "launch.run" in _calls(runs)
    assert isinstance(Options().request(), Request)
    assert Options(nproc=2, max_restarts=1).request(role="trainer") == Request(
        nproc=2, max_restarts=1, role="trainer"
    )


@pytest.mark.unit
def test_no_module_outside_launch_names_a_launcher_or_its_entry_points():
    named = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("launch/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
                if modules & {f"autoddp.launch.{name}" for name in LAUNCHERS}:
                    named.append((relative, node.lineno, node.module))
                if node.module.startswith("autoddp.launch") and {a.name for a in node.names} & ENTRY_POINTS:
                    named.append((relative, node.lineno, node.module))
            elif isinstance(node, ast.Import):
                hits = [a.name for a in node.names if a.name.rpartition(".")[2] in LAUNCHERS]
                named += [(relative, node.lineno, hit) for hit in hits if hit.startswith("autoddp.launch")]
            elif isinstance(node, ast.Attribute) and node.attr in ENTRY_POINTS:
                named.append((relative, node.lineno, node.attr))
    assert named == []


def _job() -> Job:
    return Job(print, (), {}, backends.resolve_backend("gloo", 0), None, RunOptions())


@pytest.mark.unit
def test_where_a_target_runs_is_decided_once_for_both(monkeypatch):
    two_nodes = Nodes(2, 2, 0, "node0:29500")
    script = Script(("train.py",))
    assert not environment.detect().launched
    assert door.way(Request(nproc=1), _job()) == door.IN_PLACE  # one process of a function
    assert door.way(Request(nproc=2), _job()) == door.WORKERS
    assert door.way(Request(nproc=1), script) == door.WORKERS  # a script always gets its workers
    assert door.way(Request(nproc=2, nodes=two_nodes), _job()) == door.NODE_SHARE
    assert launch.way(Request(nproc=2, nodes=two_nodes), script) == door.NODE_SHARE
    world = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    world.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="x")
    for name, value in world.items():
        monkeypatch.setenv(name, value)
    assert environment.detect().launched
    assert door.way(Request(nproc=2), _job()) == door.IN_PLACE  # inside a launched world
    assert door.way(Request(nproc=2), script) == door.IN_PLACE
    assert door.way(Request(nproc=2, nodes=two_nodes), _job()) == door.IN_PLACE  # a nested call
    # one command per machine under srun, as torchrun there: that machine's share
    assert door.way(Request(nproc=2, nodes=two_nodes), script) == door.NODE_SHARE
