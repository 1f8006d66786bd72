"""SLURM for real: a one-node cluster (Debian's slurm-wlm and munge) started by tests/clusters/setup.sh.

Tasks run under slurmstepd, not as children of this test: each test checks that no job of its own
is left (``slurm_jobs``: the session's jobs carry one name; only they are ever cancelled). A cluster
that cannot place two tasks now is a skip within seconds, saying why.
"""

from __future__ import annotations

import pytest
import slurm_jobs
from helpers import need_programs, results, scripts
from slurm_jobs import run_job

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster():
    """Once per session: skip unless this cluster can place the tests' tasks now."""
    need_programs("srun", "sbatch", "salloc", "sinfo", "squeue", "scancel", packages="slurm-wlm, munge")
    reason = slurm_jobs.refusal()
    if reason:
        pytest.skip(reason)
    yield
    slurm_jobs.cancel()


@pytest.fixture
def job(cluster, tmp_path):
    """The test scripts, and afterwards: no SLURM job of this test may be left behind."""
    yield scripts(tmp_path)
    left = slurm_jobs.wait_until_gone()
    assert not left, f"SLURM jobs of this test left behind (now cancelled): {left}"


def _in_place(found: list[dict], tasks: int, env: str) -> None:
    """Each task ran the function itself (no new process), in one world of ``tasks``."""
    assert sorted(r["result"]["rank"] for r in found) == list(range(tasks)), found
    for r in found:
        assert r["env"] == env
        assert r["result"]["world"] == tasks and r["result"]["sum"] == tasks * (tasks + 1) / 2
        assert r["result"]["pid"] == r["caller"]


def _own_workers(found: list[dict], env: str) -> None:
    """One process started two workers and got rank 0's result back."""
    assert len(found) == 1, found
    (r,) = found
    assert r["env"] == env
    assert (r["result"]["rank"], r["result"]["world"], r["result"]["sum"]) == (0, 2, 3.0)
    assert r["result"]["pid"] != r["caller"]


def test_srun_two_tasks_are_a_world_of_two_in_place(job):
    done = run_job("srun", "-n", "2", "python", str(job["decorated"]))
    assert done.returncode == 0, done.stderr
    _in_place(results(done.stdout), 2, "SLURM step (srun)")


def test_srun_one_task_autoddp_starts_its_own_workers(job):
    command = run_job("srun", "-n", "1", "autoddp", "-n", "2", "--ranks", "all", str(job["torchrun_style"]))
    assert command.returncode == 0, command.stderr
    found = results(command.stdout)
    assert sorted((r["rank"], r["local_rank"], r["world"], r["sum"]) for r in found) == [
        (0, 0, 2, 3.0),
        (1, 1, 2, 3.0),
    ]
    decorated = run_job("srun", "-n", "1", "python", str(job["decorated"]), "2")
    assert decorated.returncode == 0, decorated.stderr
    _own_workers(results(decorated.stdout), "SLURM allocation, single process (not a multi-task srun step)")


def test_srun_autoddp_runs_a_torchrun_script_in_place(job):
    # srun sets no RANK/MASTER_ADDR: the command gives the script torchrun's variables itself.
    done = run_job("srun", "-n", "2", "autoddp", str(job["torchrun_style"]))
    assert done.returncode == 0, done.stderr
    found = results(done.stdout)
    assert sorted((r["rank"], r["local_rank"], r["world"], r["sum"]) for r in found) == [
        (0, 0, 2, 3.0),
        (1, 1, 2, 3.0),
    ]
    assert "terminate called" not in done.stderr


def test_sbatch_wait_with_a_two_task_step(job, tmp_path):
    output = tmp_path / "job.out"
    batch = tmp_path / "job.sh"
    batch.write_text(
        "#!/bin/bash\n"
        "#SBATCH -n 2\n"
        f"#SBATCH -o {output}\n"
        f"srun python {job['decorated']}\n"  # a two-task step: a world of 2
        f"python {job['decorated']} 2\n"  # the batch script itself: autoddp starts 2 workers
    )
    done = run_job("sbatch", "--wait", str(batch), timeout=150)
    assert done.returncode == 0, done.stderr + output.read_text()
    found = results(output.read_text())
    _in_place(found[:2], 2, "SLURM step (srun)")
    _own_workers(found[2:], "SLURM allocation, single process (not a multi-task srun step)")


def test_salloc_then_srun(job):
    done = run_job("salloc", "-n", "2", "srun", "python", str(job["decorated"]))
    assert done.returncode == 0, done.stderr
    _in_place(results(done.stdout), 2, "SLURM step (srun)")
    shell = run_job("salloc", "-n", "2", "python", str(job["decorated"]), "2")  # the salloc shell
    assert shell.returncode == 0, shell.stderr
    _own_workers(results(shell.stdout), "SLURM allocation, single process (not a multi-task srun step)")


def test_two_steps_of_one_job_at_once_get_their_own_ports(job):
    # Rank 0's port is derived from the job and the step: two steps at once cannot collide.
    script = job["decorated"]
    both = f"srun --overlap -n 2 python {script} & srun --overlap -n 2 python {script} & wait"
    done = run_job("salloc", "-n", "2", "bash", "-c", both, timeout=150)
    assert done.returncode == 0, done.stderr
    found = results(done.stdout)
    assert len(found) == 4 and all(r["result"]["world"] == 2 and r["result"]["sum"] == 3.0 for r in found)


def test_autoddp_env_in_a_step_names_it(job):
    done = run_job("srun", "-n", "2", "-l", "autoddp", "env")
    assert done.returncode == 0, done.stderr
    rank0 = " ".join(line[3:].strip() for line in done.stdout.splitlines() if line.startswith("0:"))
    assert "SLURM step (srun); launched: @distributed runs in place" in rank0
    assert "rank 0 of 2" in rank0 and "20000 + SLURM_JOB_ID % 10000" in rank0
