"""MPI launchers for real: Open MPI's mpirun (openmpi-bin) and MPICH's mpiexec (mpich), side by side."""

from __future__ import annotations

import pytest
from helpers import need_programs, results, run, scripts

pytestmark = pytest.mark.timeout(120)

#: (program, how it starts N ranks: as root Open MPI needs --allow-run-as-root, and
#: --oversubscribe for more ranks than cores), package, environment name.
LAUNCHERS = {
    "openmpi": (["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "-np"], "openmpi-bin"),
    "mpich": (["mpiexec.mpich", "-n"], "mpich"),
}
NAMES = {"openmpi": "Open MPI (mpirun)", "mpich": "MPICH / Intel MPI (mpiexec)"}


@pytest.fixture(params=sorted(LAUNCHERS))
def mpi(request, tmp_path):
    """(the launch command before N, the environment's name, the test scripts)."""
    command, package = LAUNCHERS[request.param]
    need_programs(command[0], packages=package)
    return command, NAMES[request.param], scripts(tmp_path)


def test_mpirun_two_ranks_are_a_world_of_two_in_place(mpi):
    launcher, name, job = mpi
    done = run([*launcher, "2", "python", str(job["decorated"])])
    assert done.returncode == 0, done.stderr
    found = results(done.stdout)
    assert sorted(r["result"]["rank"] for r in found) == [0, 1], done.stdout
    for r in found:
        assert r["env"] == name and r["result"]["world"] == 2 and r["result"]["sum"] == 3.0
        assert r["result"]["pid"] == r["caller"]  # in place: MPI started every process


def test_the_command_inside_one_rank_starts_its_own_workers(mpi):
    launcher, _, job = mpi
    done = run([*launcher, "1", "autoddp", "-n", "2", "--ranks", "all", str(job["torchrun_style"])])
    assert done.returncode == 0, done.stderr
    found = results(done.stdout)
    assert sorted((r["rank"], r["world"], r["sum"]) for r in found) == [(0, 2, 3.0), (1, 2, 3.0)]
    decorated = run([*launcher, "1", "python", str(job["decorated"]), "2"])
    assert decorated.returncode == 0, decorated.stderr
    (r,) = results(decorated.stdout)
    assert r["env"] == "plain process"  # an MPI world of one: autoddp starts the workers
    assert (r["result"]["rank"], r["result"]["world"], r["result"]["sum"]) == (0, 2, 3.0)
    assert r["result"]["pid"] != r["caller"]


def test_the_command_runs_a_torchrun_script_in_place_under_mpi(mpi):
    # MPI sets no RANK/MASTER_ADDR: the command gives the script torchrun's variables itself.
    launcher, _, job = mpi
    done = run([*launcher, "2", "autoddp", str(job["torchrun_style"])])
    assert done.returncode == 0, done.stderr
    found = results(done.stdout)
    assert sorted((r["rank"], r["local_rank"], r["world"], r["master"]) for r in found) == [
        (0, 0, 2, "127.0.0.1"),
        (1, 1, 2, "127.0.0.1"),
    ]
