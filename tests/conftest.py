"""Shared test helpers: every test that starts processes must leave none behind."""

from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from autoddp.core.errors import ConfigurationError
from autoddp.in_rank.models.fsdp import fsdp_api
from autoddp.launch.contract import TORCHRUN_VARIABLES


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


#: The processes this pytest process started (forks; spawns and subprocesses while a ``unit`` test
#: runs): a test marked ``unit`` must start none, so that ``pytest -m unit`` runs in seconds.
_STARTS = [0]


def _count_start(*_: object) -> None:
    _STARTS[0] += 1


_START_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.system"})
os.register_at_fork(before=_count_start)
sys.addaudithook(lambda event, _: _count_start() if event in _START_EVENTS else None)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """Fail a test marked ``unit`` that starts a process (multiprocessing's spawn starts its own
    through ``_posixsubprocess.fork_exec``, which raises no audit event)."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    fork_exec = _posixsubprocess.fork_exec

    def counted(*args, **kwargs):
        _count_start()
        return fork_exec(*args, **kwargs)

    monkeypatch.setattr(_posixsubprocess, "fork_exec", counted)
    before = _STARTS[0]
    yield
    assert _STARTS[0] == before, (
        "this test is marked unit but started a process: take its @pytest.mark.unit off "
        "(pytest -m unit runs the tests that start none, in seconds)"
    )


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
    except subprocess.TimeoutExpired as expired:
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        for child in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        out, err = proc.communicate()
        expired.add_note(f"what it printed before it was killed:\n{out[-2000:]}\n{err[-6000:]}")
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


#: The folder whose tests share one resource of the machine (the SLURM cluster and the two network
#: hosts): under pytest-xdist (``--dist loadgroup``) they run in one worker, one test after another.
#: (Another such group, the sweep of /dev/shm and the temporary folder, is marked in its own file:
#: ``pytestmark`` in core/test_leftovers.py.) The fast part of the suite that CI runs on the lowest
#: and the newest torch (``-m smoke``) is marked in each of its files the same way.
CLUSTERS = pathlib.Path(__file__).resolve().parent / "clusters"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (it names each item by its group)
def pytest_collection_modifyitems(items):
    for item in items:
        if CLUSTERS in item.path.parents:
            item.add_marker(pytest.mark.xdist_group("clusters"))


_COUNTED = ("passed", "failed", "skipped")


def clusters_summary(reports) -> str | None:
    """One line on the tests of tests/clusters/ (real SLURM, MPI, two hosts) in ``reports`` (the
    terminal reporter's, all outcomes): how many passed, failed and skipped, and each skip's reason,
    so that a run where they could not run never passes unseen; None where none of them ran."""
    counts: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for report in reports:
        if not report.nodeid.startswith("tests/clusters/") or report.outcome not in _COUNTED:
            continue
        if report.outcome == "passed" and report.when != "call":
            continue
        word = "errors" if report.when != "call" and report.outcome == "failed" else report.outcome
        counts[word] = counts.get(word, 0) + 1
        if report.outcome == "skipped":
            why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            why = why.removeprefix("Skipped: ")
            reasons[why] = reasons.get(why, 0) + 1
    if not counts:
        return None
    words = ("passed", "failed", "errors", "skipped")
    line = "clusters: " + ", ".join(f"{counts.get(word, 0)} {word}" for word in words)
    if reasons:
        line += " (" + "; ".join(f"{n} because {why}" for why, n in sorted(reasons.items())) + ")"
    return line


#: Where the clusters' line is also written (``.ci/run`` prints that file in its very last lines).
CLUSTERS_SUMMARY_FILE = "CLUSTERS_SUMMARY_FILE"


def pytest_terminal_summary(terminalreporter, config):
    """Say at the end of a run how many cluster tests ran and why the others skipped."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller says it once
        return
    stats = terminalreporter.stats
    reports = [report for key in ("passed", "failed", "error", "skipped") for report in stats.get(key, [])]
    line = clusters_summary(reports)
    if line is None:
        return
    terminalreporter.write_line(line)
    if os.environ.get(CLUSTERS_SUMMARY_FILE):
        pathlib.Path(os.environ[CLUSTERS_SUMMARY_FILE]).write_text(line + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``forks_here`` forks its workers from this pytest process. Where an earlier
    test of this worker ran a backward here on a CUDA build of torch, autograd's device threads make
    fork unsafe and autoddp refuses it by design: the test then runs alone in a fresh pytest
    process, and its outcome there is its outcome (never skipped, never order-dependent)."""
    if pyfuncitem.get_closest_marker("forks_here") is None:
        return None
    from autoddp.launch.start_method import choose_start_method

    try:
        choose_start_method("fork")
        return None
    except ConfigurationError:
        pass
    args = ["-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:xdist", pyfuncitem.nodeid]
    result = run_python(args, cwd=pyfuncitem.config.rootpath, timeout=110)
    assert result.returncode == 0, (
        f"run alone in a fresh process:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    )
    return True


def pytest_collection_finish(session):
    """Under ``--dist loadgroup`` every grouped test must carry its group in its node id (that is
    how pytest-xdist sends a group to one worker): where a pytest/xdist pair drops it, the cluster
    tests would run at once on two workers and fail by each other's faults, so stop here instead."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(session.config.option, "loadgroup", False):
        return
    lost = [
        item.nodeid
        for item in session.items
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
    ]
    if lost:
        why = (
            f"pytest {pytest.__version__} with this pytest-xdist ignores xdist_group ({lost[0]} has no "
            "group in its id): install the test extras' pytest (pip install 'pytest<9.2')"
        )
        print(why, file=sys.stderr)  # a worker's UsageError reaches the screen only as an INTERNALERROR
        raise pytest.UsageError(why)


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
