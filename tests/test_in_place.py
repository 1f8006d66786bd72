"""The command and the decorator inside worlds other launchers made, without those launchers:
torchrun's variables for a torchrun-style script.
The real srun and mpirun: test_clusters_slurm.py and test_clusters_mpi.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

from autoddp.environment import shared_port
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
