"""The last word on the cluster tests (real SLURM, MPI, two hosts): how many ran and why the others
skipped, said at the end of every run that had them, so that a skip never passes unseen in CI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import CLUSTERS_SUMMARY_FILE, clusters_summary, pytest_terminal_summary

pytestmark = pytest.mark.unit  # every test here starts no process


def report(nodeid: str, outcome: str, when: str = "call", reason: str = ""):
    """A test report as the terminal reporter keeps it (a skip's longrepr: file, line, message)."""
    longrepr = (nodeid.split("::")[0], 1, f"Skipped: {reason}") if outcome == "skipped" else None
    return SimpleNamespace(nodeid=nodeid, outcome=outcome, when=when, longrepr=longrepr)


SLURM = "tests/clusters/test_clusters_slurm.py::test_{}@clusters"
MPI = "tests/clusters/test_clusters_mpi.py::test_{}"
NO_SRUN = "srun not installed (Debian: slurm-wlm); tests/clusters/setup.sh start (as root) installs it"
NO_ROOT = "two hosts needs root"


def test_counts_each_outcome_and_each_reason_of_a_skip():
    reports = [
        report(SLURM.format("a"), "passed"),
        report(SLURM.format("a"), "passed", when="setup"),  # setup and teardown are no test of their own
        report(MPI.format("b"), "passed"),
        report(MPI.format("c"), "failed"),
        report(MPI.format("d"), "failed", when="setup"),
        report(SLURM.format("e"), "skipped", when="setup", reason=NO_SRUN),
        report(SLURM.format("f"), "skipped", reason=NO_SRUN),
        report(MPI.format("g"), "skipped", when="setup", reason=NO_ROOT),
        report("tests/launch/test_cli.py::test_h", "skipped", reason="not a cluster test"),
        report("tests/launch/test_cli.py::test_i", "passed"),
    ]
    assert clusters_summary(reports) == (
        f"clusters: 2 passed, 1 failed, 1 errors, 3 skipped (2 because {NO_SRUN}; 1 because {NO_ROOT})"
    )


def test_says_nothing_where_no_cluster_test_ran():
    assert clusters_summary([report("tests/launch/test_cli.py::test_a", "passed")]) is None
    assert clusters_summary([]) is None


def test_all_ran_is_said_too():
    assert clusters_summary([report(MPI.format("a"), "passed")]) == (
        "clusters: 1 passed, 0 failed, 0 errors, 0 skipped"
    )


class Reporter:
    def __init__(self, stats):
        self.stats, self.lines = stats, []

    def write_line(self, line):
        self.lines.append(line)


def test_the_hook_prints_the_line_and_writes_it_for_ci(tmp_path, monkeypatch):
    skipped = report(SLURM.format("a"), "skipped", when="setup", reason=NO_SRUN)
    reporter = Reporter({"passed": [report(MPI.format("b"), "passed")], "skipped": [skipped]})
    monkeypatch.setenv(CLUSTERS_SUMMARY_FILE, str(tmp_path / "clusters.txt"))
    pytest_terminal_summary(reporter, SimpleNamespace())
    expected = f"clusters: 1 passed, 0 failed, 0 errors, 1 skipped (1 because {NO_SRUN})"
    assert reporter.lines == [expected]
    assert (tmp_path / "clusters.txt").read_text() == expected + "\n"
    worker = Reporter(reporter.stats)  # a pytest-xdist worker leaves it to the controller
    pytest_terminal_summary(worker, SimpleNamespace(workerinput={}))
    assert worker.lines == []
