"""@distributed on functions defined in notebook cells: one real notebook, executed headless."""

from __future__ import annotations

import ast
import json
import os
import sys
import time

import pytest
from helpers import running

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

KERNEL = "autoddp-test-python"

CELLS = [
    """
import sys
import torch
import torch.distributed as dist
import autoddp
from autoddp.in_rank import console
sys.executable
""",
    """
@autoddp.distributed(nproc=2)
def total():
    t = torch.tensor([autoddp.rank() + 1.0])
    dist.all_reduce(t)
    console.print("from the workers:", autoddp.world_size())
    console.print("every rank", all_ranks=True)
    print("plain print of rank", autoddp.rank())
    return t.item(), autoddp.world_size()

total()
""",
    """
scale = 10
offset = 0.5
""",
    """
def make(factor, method):
    @autoddp.distributed(nproc=2, start_method=method)
    def scaled():  # a closure over `factor`, reading `offset` from an earlier cell
        t = torch.tensor([autoddp.rank() + 1.0])
        dist.all_reduce(t)
        return factor * t.item() + offset

    return scaled

make(scale, "fork")(), make(scale, "spawn")()
""",
    """
@autoddp.distributed(nproc=2)
def fails():
    if autoddp.rank() == 1:
        raise KeyError("no such sample")
    autoddp.barrier()

try:
    fails()
except KeyError as error:
    print("caught", type(error).__name__, error)
""",
    """
import os

@autoddp.distributed(nproc=2)
def pids():
    every = [None, None]
    dist.all_gather_object(every, os.getpid())
    return every

os.getpid(), pids()
""",
]


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernelspec that runs this very interpreter, and a private Jupyter/IPython home."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    return KERNEL


def _result(cell) -> str:
    [result] = [out for out in cell.outputs if out.output_type == "execute_result"]
    return result.data["text/plain"]


def _stdout(cell) -> str:
    return "".join(out.text for out in cell.outputs if out.output_type == "stream" and out.name == "stdout")


def test_functions_defined_in_notebook_cells(tmp_path, kernel):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src.strip()) for src in CELLS])
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name=kernel, resources={"metadata": {"path": str(tmp_path)}}
    )
    # Run the kernel as Jupyter does: seeing pytest's variable, ipykernel would not capture file
    # descriptors, and its sys.stdout would have no fileno().
    env = {name: value for name, value in os.environ.items() if name != "PYTEST_CURRENT_TEST"}
    client.execute(env=env)  # starts the kernel, runs every cell (an error in one fails here), shuts it down

    imports, total, _, closures, fails, pids = nb.cells
    assert _result(imports) == repr(sys.executable)  # the kernel runs this interpreter (the venv's)
    assert _result(total) == "(3.0, 2)"
    printed = _stdout(total).splitlines()
    # ranks='0': only rank 0's output reaches the cell, a plain print too (a forked worker's
    # sys.stdout, ipykernel's stream, would send rank 1's over the kernel's socket, past the filter)
    assert printed.count("from the workers: 2") == 1
    assert "[rank 0] every rank" in printed and "[rank 1] every rank" not in printed, printed
    assert "plain print of rank 0" in printed and "plain print of rank 1" not in printed, printed
    assert _result(closures) == "(30.5, 30.5)"
    assert _stdout(fails).splitlines() == ["caught KeyError 'no such sample'"]
    # the kernel and its workers are gone (workers orphaned by a dead kernel would escape conftest)
    kernel_pid, worker_pids = ast.literal_eval(_result(pids))
    assert len(set(worker_pids) | {kernel_pid}) == 3
    deadline = time.monotonic() + 10
    while any(map(running, [kernel_pid, *worker_pids])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(running, [kernel_pid, *worker_pids]))
