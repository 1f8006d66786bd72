"""Where-am-I detection: which launcher (if any) started this process, and what world it gives.

Each environment is a small class that recognises itself from environment variables
(``matches``), describes the world it implies (``world``: rank, local rank, world size, node
rank, rank 0's address and port) and says which variables made the decision (``explain``).
``launched`` is True where the launcher already started every process, so ``@distributed``
runs in place. Reading only: nothing here changes the environment. One module per launcher
family (``torchrun``, ``slurm``, ``mpi``, ``operators``); ``ENVIRONMENTS`` below is the order.

``detect()`` refuses ``RANK`` without ``WORLD_SIZE`` (or the reverse), then tries the classes
in order; the first that matches wins. The rule behind the order: the launcher closest to the
process wins, because it started it.

1. ``AutoDDPWorker``: ``AUTODDP_RUN_ID`` with ``RANK``/``WORLD_SIZE``, a worker autoddp started.
2. ``TorchElastic``: ``TORCHELASTIC_RUN_ID`` with ``RANK``/``WORLD_SIZE``. torchrun started in an
   srun step, under mpirun or in a Kubernetes pod is torchrun: it started this process.
3. ``SlurmStep``: one task of an srun step of several tasks (``SLURM_PROCID``, ``SLURM_STEP_ID``,
   ``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS`` > 1). It gives way to a launcher started inside
   the step: MPI variables with another rank or size (mpirun's daemons ran in this step), or a
   ``WORLD_SIZE`` other than the step's task count (a per-node launcher). MPI variables that
   describe the same world do not displace it: SLURM's node list gives rank 0's address, which
   MPI does not.
4. ``OpenMPI``: ``OMPI_COMM_WORLD_SIZE`` > 1.
5. ``MPICH``: ``PMI_RANK``/``PMI_SIZE`` > 1 (MPICH, Intel MPI and other Hydra launchers).
   Both MPI classes give way to a ``WORLD_SIZE`` other than theirs.
6. ``RankEnv``: ``RANK`` and ``WORLD_SIZE`` from anything else (Kubeflow PyTorchJob, other
   operators, scripts).

   Tie-break for 3-6: ``RANK``/``WORLD_SIZE`` of the *same* size as a SLURM step or MPI job are
   read as copies of it, and the scheduler's rank is used even where ``RANK`` differs: the
   usual cause is ``export RANK=$SLURM_PROCID`` in the batch script before srun, which gives
   every task the same value (``explain`` names the disagreement).
7. ``SlurmAllocation``: inside a SLURM job but not a task of a multi-task step (an ``salloc``
   shell, the batch script, ``srun --pty bash``, a one-task step): not launched, autoddp
   starts its own workers, and ``explain`` says why.
8. ``Plain``: anything else (including an MPI "world" of one process); autoddp starts the
   workers.

Ports: ``MASTER_ADDR``/``MASTER_PORT`` always win where set; otherwise each family derives them
(see ``slurm`` and ``mpi``). autoddp's own launches use a free port the operating system picks,
on loopback (``autoddp.launch.store``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from autoddp.core.environment._base import LOOPBACK as LOOPBACK
from autoddp.core.environment._base import PORT_BASE as PORT_BASE
from autoddp.core.environment._base import PORT_SPAN as PORT_SPAN
from autoddp.core.environment._base import Environment as Environment
from autoddp.core.environment._base import Plain as Plain
from autoddp.core.environment._base import shared_port as shared_port
from autoddp.core.environment._hostlist import first_host as first_host
from autoddp.core.environment.mpi import MPICH as MPICH
from autoddp.core.environment.mpi import OpenMPI as OpenMPI
from autoddp.core.environment.operators import RankEnv as RankEnv
from autoddp.core.environment.slurm import SlurmAllocation as SlurmAllocation
from autoddp.core.environment.slurm import SlurmStep as SlurmStep
from autoddp.core.environment.slurm import slurm_port as slurm_port
from autoddp.core.environment.torchrun import AutoDDPWorker as AutoDDPWorker
from autoddp.core.environment.torchrun import TorchElastic as TorchElastic
from autoddp.core.errors import ConfigurationError

#: Detection order: the launcher closest to the process first; ``Plain`` always matches.
ENVIRONMENTS: tuple[type[Environment], ...] = (
    AutoDDPWorker,
    TorchElastic,
    SlurmStep,
    OpenMPI,
    MPICH,
    RankEnv,
    SlurmAllocation,
    Plain,
)


def _check_consistent(environ: Mapping[str, str]) -> None:
    has_rank, has_size = "RANK" in environ, "WORLD_SIZE" in environ
    if has_rank != has_size:
        present, missing = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
        raise ConfigurationError(
            f"{present} is set but {missing} is not: this looks like a half-configured launcher "
            f"environment. Unset {present} to let autoddp start the processes, or set {missing} too."
        )


def detect(environ: Mapping[str, str] | None = None) -> Environment:
    """The environment this process runs in (the first class of ``ENVIRONMENTS`` that matches)."""
    environ = os.environ if environ is None else environ
    _check_consistent(environ)
    for cls in ENVIRONMENTS:
        if cls.matches(environ):
            return cls(environ)
    raise AssertionError("Plain always matches")  # pragma: no cover
