"""Helpers several test files share: one copy each (the fixtures and run helpers are conftest's)."""

from __future__ import annotations

import os
import signal
import socket
import time

import psutil


def free_port() -> int:
    """A TCP port free on loopback now (a rendezvous for a test's own processes)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def gather(value):
    """Every rank's ``value``, in rank order (inside a distributed run)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def interleave(shares):
    """The global order whose position i * W + r is rank r's i-th item."""
    return [share[i] for i in range(len(shares[0])) for share in shares]


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (ended, waiting to be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pids: list[int], timeout: float = 10, *, kill: bool = False) -> bool:
    """Whether every process of ``pids`` ends within ``timeout`` seconds; ``kill``: those that
    did not are killed then (the test failed, and leaves nothing behind)."""
    deadline = time.monotonic() + timeout
    while any(running(pid) for pid in pids):
        if time.monotonic() > deadline:
            for pid in pids if kill else ():
                if running(pid):
                    os.kill(pid, signal.SIGKILL)
            return False
        time.sleep(0.1)
    return True


def torchrun_worker(rank: int, world_size: int = 8, local_world_size: int = 4) -> dict[str, str]:
    """The variables torchrun gives worker ``rank`` (ranks placed node by node)."""
    return {
        "TORCHELASTIC_RUN_ID": "job-1",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(rank // local_world_size),
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "29400",
    }


def open_mpi_rank(
    rank: int, size: int = 4, local_size: int = 4, namespace: str = "prterun-host-4711@1", **extra: str
) -> dict[str, str]:
    """The variables Open MPI's mpirun gives a rank (ranks placed node by node), and ``extra``."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank % local_size),
        "OMPI_UNIVERSE_SIZE": str(size),
        "OMPI_FIRST_RANKS": "0",
        "OMPI_APP_CTX_NUM_PROCS": str(size),
        "PMIX_RANK": str(rank),
        "PMIX_NAMESPACE": namespace,
        "OMPI_MCA_ess_base_vpid": str(rank),
        **extra,
    }


def fork_or_skip() -> None:
    """Skip a test that needs workers forked from this process where autoddp (rightly) refuses
    fork here: torch's CUDA builds, after an earlier test's torch.compile and backward in this
    process started autograd's device threads. The reason is autoddp's own."""
    import pytest

    from autoddp.core.errors import ConfigurationError
    from autoddp.launch.start_method import choose_start_method

    try:
        choose_start_method("fork")
    except ConfigurationError as refused:
        pytest.skip(str(refused))
