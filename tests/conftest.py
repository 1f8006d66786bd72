"""Shared test helpers: every test that starts processes must leave none behind."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from autoddp.errors import ConfigurationError
from autoddp.launch.contract import TORCHRUN_VARIABLES
from autoddp.models import fsdp_api


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves any child process of this test process alive."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 10
    while True:
        alive = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        ]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {[(p.pid, p.cmdline()) for p in alive]}"


#: gloo's words for a collective that ran out of time: the wait that ran out, or another wait of
#: that rank on the pair the timeout closed (either may reach the user first).
GLOO_TIMEOUT = re.compile(r"Timed out waiting \d+ms|Application timeout caused pair closure")

#: Variables that launchers (torchrun, srun, mpirun, autoddp) set; tests start without them.
LAUNCHER_PREFIXES = (
    "SLURM_",
    "SLURMD_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MPI_LOCAL",
    "TORCHELASTIC_",
    "AUTODDP_",
    "PET_",
)
LAUNCHER_NAMES = tuple(
    name for name in TORCHRUN_VARIABLES if not name.startswith("TORCH") and name != "OMP_NUM_THREADS"
)


@pytest.fixture(autouse=True)
def _clean_launcher_env(monkeypatch):
    """Tests start as plain processes, whatever launched pytest (torchrun, srun, mpirun...)."""
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES:
            monkeypatch.delenv(name)


def run_python(
    args: list[str], *, cwd: str | os.PathLike | None = None, stdin: str | None = None, timeout: float = 90
) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` in a fresh interpreter and capture its output.

    On a timeout every process it started goes too (torchrun's workers would otherwise outlive a
    killed torchrun, reparented where ``no_leftover_processes`` cannot see them).
    """
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        stdin=subprocess.PIPE if stdin is not None else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(input=stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        for child in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


#: Test files that share one resource of the machine (the SLURM cluster and the two network hosts;
#: the sweep of /dev/shm and the temporary folder): under pytest-xdist (``--dist loadgroup``) each
#: group runs in one worker, one test after another.
SERIAL_GROUPS = {"test_clusters_": "clusters", "test_leftovers": "leftovers"}


#: The fast part of the suite that CI runs on the lowest and the newest torch (``-m smoke``): the
#: version seams, both fronts end to end (the demos, the decorator, one process's weights), the
#: torchrun contract, the data and FSDP paths.
SMOKE_FILES = frozenset(
    {
        "test_compat.py",
        "test_frames.py",
        "test_options.py",
        "test_examples.py",
        "test_decorator.py",
        "test_equivalence.py",
        "test_torchrun_contract.py",
        "test_fsdp.py",
        "test_data.py",
    }
)


def pytest_collection_modifyitems(items):
    for item in items:
        for prefix, group in SERIAL_GROUPS.items():
            if item.path.name.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))
        if item.path.name in SMOKE_FILES:
            item.add_marker(pytest.mark.smoke)


def _fsdp_missing() -> str | None:
    """Why strategy="fsdp" cannot run here (on CPU, as these tests do): autoddp's own error, or None."""
    try:
        fsdp_api("cpu")
    except ConfigurationError as error:
        return str(error)
    return None


#: Marks a test that shards a model on CPU: skipped, with the torch it needs, where FSDP2 lacks.
FSDP_MISSING = _fsdp_missing()
needs_fsdp = pytest.mark.skipif(FSDP_MISSING is not None, reason=FSDP_MISSING or "")
