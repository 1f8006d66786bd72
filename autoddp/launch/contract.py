"""The variables a one-node run's workers get: torchrun's contract, name by name, plus autoddp's own.

torch 2.13's torchrun gives every worker the names in ``TORCHRUN_VARIABLES`` (its elastic agent
sets them, ``TORCHELASTIC_ERROR_FILE`` comes with the worker's start); scripts read them
(``LOCAL_WORLD_SIZE`` is common), so a single-node autoddp run gives all of them, with torchrun's
values. Multi-node runs use elastic's agent itself, which sets them the same way.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from autoddp.core import _variables
from autoddp.core.environment import LOOPBACK, hardware
from autoddp.launch import diagnostics
from autoddp.launch.side_gloo import side_gloo_variables

#: What torchrun's workers find in their environment (torch 2.13), beside what they inherit.
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)

#: torchrun's ``--role`` default: the ``ROLE_NAME`` its workers see.
DEFAULT_ROLE = "default"

#: torch's own switch for a store-based barrier at the end of ``init_process_group`` and
#: ``new_group``: without it a rank whose side of gloo's mesh is connected returns at once, and a
#: script that makes its group and ends (each rank working on its own) can close its sockets while
#: another rank is still connecting, which fails there with gloo's "Connection closed by peer"
#: (rarely, and more on a loaded machine). A value the user set is kept.
GROUP_BARRIER = {"TORCH_DIST_INIT_BARRIER": "1"}

#: The signals the launcher stops every worker on (torchrun's default list, which autoddp's handles).
SIGNALS_HANDLED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


@dataclasses.dataclass(frozen=True)
class Contract:
    """What stays the same over a run's attempts: its size, role, store address and restart budget."""

    nproc: int
    role: str = DEFAULT_ROLE
    max_restarts: int = 0
    host: str = LOOPBACK  # MASTER_ADDR: where the launcher's store listens


def worker_envs(
    contract: Contract, port: int, run_id: str, attempt: int = 0, folder: str = ""
) -> dict[int, dict[str, str]]:
    """Each local rank's variables for one attempt (``port``: this attempt's store)."""
    nproc = contract.nproc
    common = {
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": contract.role,
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": contract.host,
        "MASTER_PORT": str(port),
        # The caller hosts the store: rank 0 connects to it instead of binding the port.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(attempt),  # 0 on the first attempt
        "TORCHELASTIC_MAX_RESTARTS": str(contract.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", SIGNALS_HANDLED),
        _variables.RUN_ID: run_id,
        _variables.PARENT_PID: str(os.getpid()),
        _variables.RUN_FOLDER: folder,  # where a worker reports its error
    }
    threads = hardware.omp_threads(nproc)
    if threads is not None:
        common["OMP_NUM_THREADS"] = threads
    # NCCL's error handling and flight recorder on GPUs, dumped into the run folder
    gpus = hardware.gpu_count()
    common.update(diagnostics.nccl_variables(os.environ, folder, gpus))
    handling = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # torchrun's 1 without GPUs, as elastic's agent gives it
    common.setdefault(handling, os.environ.get(handling, "1"))
    common.update(side_gloo_variables(os.environ, gpus))  # gloo beside NCCL connects when first used
    common.update(group_barrier(os.environ))
    return {r: {**common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(nproc)}


def group_barrier(environ: Mapping[str, str]) -> dict[str, str]:
    """``GROUP_BARRIER`` for the workers, less what the user set."""
    return {name: value for name, value in GROUP_BARRIER.items() if name not in environ}
