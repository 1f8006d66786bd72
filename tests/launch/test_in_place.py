"""The command and the decorator inside worlds other launchers made, without those launchers:
torchrun's variables for a torchrun-style script, rank 0's port, and a taken port.
The real srun and mpirun: test_clusters_slurm.py and test_clusters_mpi.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import pytest

from autoddp.core.environment import SlurmStep, shared_port, slurm_port
from conftest import write

SCRIPT = """
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")  # env://: needs RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    sys.stdout.write(f"{dist.get_rank()} {dist.get_world_size()} {os.environ['LOCAL_RANK']} {t.item()}\\n")
"""


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def _together(command: list[str], envs: list[dict[str, str]], timeout: float = 90) -> list[tuple[str, str]]:
    """Start ``command`` once per environment at once, as a launcher would: (stdout, stderr) of each."""
    procs = [
        subprocess.Popen(command, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for e in envs
    ]
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _env(variables: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **variables}


def test_the_command_gives_a_torchrun_script_the_mpi_world(tmp_path):
    # Open MPI's variables (no RANK, WORLD_SIZE, MASTER_*), as mpirun -np 2 gives them.
    script = write(tmp_path / "job.py", SCRIPT)
    spaces = (f"prterun-{uuid.uuid4().hex}@1" for _ in range(100))
    namespace = next(space for space in spaces if _free(shared_port(space)))
    envs = [
        _env(
            {
                "OMPI_COMM_WORLD_RANK": str(rank),
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "PMIX_NAMESPACE": namespace,
            }
        )
        for rank in (0, 1)
    ]
    runs = _together([sys.executable, "-m", "autoddp.cli", str(script)], envs)
    outputs = sorted(out.strip() for out, _ in runs)
    assert outputs == ["0 2 0 3.0", "1 2 1 3.0"], [err[-2000:] for _, err in runs]


def test_a_taken_port_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        decorated = write(
            tmp_path / "decorated.py",
            """
            import autoddp

            @autoddp.distributed
            def train():
                return autoddp.world_size()

            train()
            """,
        )
        proc = subprocess.run(
            [sys.executable, str(decorated)], env=env, capture_output=True, text=True, timeout=60
        )
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in proc.stderr
    assert "Set MASTER_PORT to a free port" in proc.stderr


@pytest.mark.unit
def test_steps_of_one_slurm_job_get_different_ports():
    ports = [slurm_port("1234567", step) for step in range(10)]
    assert ports[0] == 24567 and len(set(ports)) == 10
    assert all(20000 <= p < 30000 for p in ports)
    task = {
        "SLURM_JOB_ID": "1234567",
        "SLURM_STEP_ID": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "node1",
    }
    step1 = SlurmStep(task)
    assert step1.world().master_port == ports[1]
    assert "20000 + (SLURM_JOB_ID + 1009 * SLURM_STEP_ID) % 10000" in step1.explain()
