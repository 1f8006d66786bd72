"""Checks on the CUDA path before the first NCCL call: a GPU per rank, /dev/shm, compute modes.

NCCL fails late and opaquely where the launch does not fit the GPUs: two ranks on one GPU
("Duplicate GPU detected"), a local rank without a GPU of that number ("invalid device
ordinal"), a /dev/shm too small for its buffers ("unhandled system error", bus errors), a GPU in
exclusive-process mode that the caller already holds ("busy or unavailable"). The decision
functions here are fed the facts (GPU counts, the launcher's variables, /dev/shm's size, compute
modes) and say which GPU a rank takes, what to tell the user, or raise a ``ConfigurationError``
naming the numbers and the fix. ``check`` gathers the facts in a rank, ``before_workers`` in a
caller about to start workers; both only on the CUDA path, so a CPU/gloo run never comes here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping

from autoddp.core.environment import Environment, hardware
from autoddp.core.environment._base import parse_int
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import World

#: NCCL's advice for containers (its troubleshooting guide: ``--shm-size=1g --ulimit memlock=-1``).
SHM_ADVISED = 1 << 30
SHM_PATH = "/dev/shm"

#: How each launcher starts N ranks per node ({n}); the one-rank-per-GPU fix names it.
FIXES = {
    "AutoDDPWorker": "autoddp -n {n} / @distributed(nproc={n})",
    "TorchElastic": "torchrun --nproc-per-node={n}",
    "SlurmStep": "srun --ntasks-per-node={n}",
    "OpenMPI": "mpirun --map-by ppr:{n}:node",
    "MPICH": "mpiexec -ppn {n}",
    "RankEnv": "start at most {n} processes per machine, each with LOCAL_RANK and LOCAL_WORLD_SIZE",
}
#: Launchers that start every worker with one environment: a GPU per worker is never bound to it.
_ONE_ENVIRONMENT = ("AutoDDPWorker", "TorchElastic")

#: CUDA's compute modes (``CUcomputemode``).
COMPUTE_DEFAULT, COMPUTE_PROHIBITED, COMPUTE_EXCLUSIVE_PROCESS = 0, 2, 3


@dataclasses.dataclass(frozen=True)
class Placement:
    """What a rank knows about its node's ranks and GPUs, without asking the other ranks."""

    launcher: str  # the environment's class name (``TorchElastic``, ``SlurmStep``...)
    local_rank: int
    local_world_size: int
    node_rank: int
    gpus: int  # GPUs this process sees
    visible: str | None  # CUDA_VISIBLE_DEVICES
    node_gpus: int | None = None  # GPUs the scheduler gave this step on this node, when it says
    per_task: bool = False  # the launcher (or a wrapper) gave each task its own GPUs
    shared: bool = False  # the launcher was told to put several tasks on one GPU

    def fix(self, n: int) -> str:
        return FIXES.get(self.launcher, FIXES["RankEnv"]).format(n=n)


def gpu_index(p: Placement) -> int:
    """The GPU (``cuda:<index>``) this rank computes on; ConfigurationError where NCCL would refuse.

    Every GPU of the node visible and one per rank: ``cuda:<local rank>``. Each task bound to its
    own GPUs (``--gpus-per-task``, a per-rank ``CUDA_VISIBLE_DEVICES``): the first of its own,
    ``cuda:<local rank % visible>`` (``cuda:0`` with one each): the environment's device is the
    truth. Fewer GPUs than ranks otherwise: ranks would share a GPU or name one that is not there.
    """
    if p.gpus >= p.local_world_size and not p.shared:
        return p.local_rank
    sharing = p.shared or (p.node_gpus is not None and p.node_gpus < p.local_world_size)
    if p.gpus and p.per_task and not sharing:
        return p.local_rank % p.gpus
    have = p.node_gpus if p.node_gpus is not None and not p.per_task else p.gpus
    where = f"CUDA_VISIBLE_DEVICES={p.visible}" if p.visible is not None else "CUDA_VISIBLE_DEVICES unset"
    step = f", {p.node_gpus} given to this step on this node" if p.node_gpus is not None else ""
    raise ConfigurationError(
        f"{p.local_world_size} ranks run on node {p.node_rank} but local rank {p.local_rank} sees {p.gpus} "
        f"GPU(s) ({where}{step}): NCCL needs a GPU of its own for every rank (ranks on one GPU fail "
        f'with "Duplicate GPU detected", a local rank past the last GPU with "invalid device ordinal"). '
        f"Start at most {max(have, 1)} rank(s) per node ({p.fix(max(have, 1))}), or run on the CPU "
        "(backend='gloo' for @distributed, CUDA_VISIBLE_DEVICES= for a script)"
    )


def idle_notice(p: Placement) -> str | None:
    """One line when GPUs this node's ranks could use sit idle (local rank 0 says it), else None."""
    if p.local_rank != 0 or p.launcher == "AutoDDPWorker":
        return None
    ranks = 1 if p.per_task else p.local_world_size
    if p.gpus <= ranks:
        return None
    whose = "this task" if p.per_task else f"the {ranks} rank(s) of node {p.node_rank}"
    node_gpus = (p.node_gpus or p.gpus) if p.per_task else p.gpus
    return (
        f"autoddp: node {p.node_rank}: {p.gpus} GPU(s) visible to {whose}, {ranks} used: "
        f"{p.gpus - ranks} stay idle. Start one rank per GPU: {p.fix(node_gpus)}"
    )


def shm_notice(total: int, free: int, local_world_size: int, environ: Mapping[str, str]) -> str | None:
    """A line when /dev/shm is below NCCL's advice for the ranks of this node, else None.

    NCCL keeps the buffers between the GPUs of one machine in /dev/shm (where peer access is
    missing, and for its proxy); Docker and Kubernetes give containers 64 MiB, where NCCL fails
    at its first collective. A notice, not an error: with NVLink, or NCCL's cuMem host memory,
    less may do. Nothing to say for one rank per node, or with ``NCCL_SHM_DISABLE=1``.
    """
    if local_world_size < 2 or environ.get("NCCL_SHM_DISABLE", "0").strip() not in ("", "0"):
        return None
    if free >= SHM_ADVISED:
        return None
    mib = 1 << 20
    return (
        f"autoddp: {SHM_PATH} has {free // mib} MiB free of {total // mib} MiB, below the 1 GiB NCCL "
        f'advises for the {local_world_size} ranks of this machine: NCCL may fail with "unhandled system '
        'error" ("Error while creating shared memory segment") or a bus error. Run the container '
        "with --shm-size=1g (or --ipc=host), or set NCCL_SHM_DISABLE=1 (slower: NCCL then goes "
        "through the network)"
    )


def compute_mode_problem(states: Mapping[int, tuple[int, bool]], nproc: int) -> str | None:
    """Why workers 0..nproc-1 cannot use their GPUs, given ``{gpu: (compute mode, caller holds it)}``.

    A GPU in exclusive-process mode takes one process's context: the caller's, once it made one
    there, and the worker for that GPU then fails with "CUDA-capable device(s) is/are busy or
    unavailable". A GPU in prohibited mode takes none.
    """
    held = [
        gpu
        for gpu, (mode, active) in sorted(states.items())
        if gpu < nproc and active and mode == COMPUTE_EXCLUSIVE_PROCESS
    ]
    barred = [gpu for gpu, (mode, _) in sorted(states.items()) if gpu < nproc and mode == COMPUTE_PROHIBITED]
    if barred:
        return (
            f"GPU(s) {', '.join(map(str, barred))} are in the 'Prohibited' compute mode: no process may use "
            "them. Set the default mode (nvidia-smi -i N -c DEFAULT, as root) or hide them with "
            "CUDA_VISIBLE_DEVICES"
        )
    if held:
        gpus = ", ".join(f"cuda:{gpu}" for gpu in held)
        return (
            f"this process already holds a CUDA context on {gpus}, in the 'Exclusive_Process' compute mode: "
            f'the worker for it would fail with "CUDA-capable device(s) is/are busy or unavailable". Do the '
            "caller's CUDA work inside the function or after the call (torch.cuda.is_available() alone "
            "makes no context), or set the default mode (nvidia-smi -i N -c DEFAULT, as root)"
        )
    return None


def placement(world: World, env: Environment, environ: Mapping[str, str], gpus: int) -> Placement:
    """The facts of ``gpu_index`` for this rank, from its launcher's variables."""
    kind = type(env).__name__
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    node_gpus, per_task, shared = None, False, False
    if kind == "SlurmStep":
        node_gpus = _slurm_node_gpus(environ)
        per_task = "SLURM_GPUS_PER_TASK" in environ or (node_gpus is not None and gpus < node_gpus)
        shared = (parse_int(environ.get("SLURM_NTASKS_PER_GPU", "")) or 1) > 1
    elif kind not in _ONE_ENVIRONMENT:
        # mpirun and operators: a wrapper may bind each rank (CUDA_VISIBLE_DEVICES=$LOCAL_RANK)
        per_task = bool(visible) and gpus < world.local_world_size
    return Placement(
        kind,
        world.local_rank,
        world.local_world_size,
        world.node_rank,
        gpus,
        visible,
        node_gpus,
        per_task,
        shared,
    )


def _slurm_node_gpus(environ: Mapping[str, str]) -> int | None:
    """GPUs SLURM gave this step on this node: ``SLURM_GPUS_ON_NODE``, else the ids it lists."""
    count = parse_int(environ.get("SLURM_GPUS_ON_NODE", ""))
    if count is not None:
        return count
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        ids = [part for part in environ.get(name, "").split(",") if part.strip()]
        if ids:
            return len(ids)
    return None


def shm_space(path: str = SHM_PATH) -> tuple[int, int] | None:
    """(total, free) bytes of the filesystem at ``path``; None where there is none."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize


def check(world: World, environ: Mapping[str, str] | None = None, announce: bool = True) -> int:
    """Check this rank's launch against its GPUs before the first NCCL call; the GPU index it takes.

    Raises ConfigurationError where NCCL would refuse; local rank 0 prints (``announce``) what
    would slow or break the run later (idle GPUs, a small /dev/shm).
    """
    from autoddp.core import environment  # (the CUDA path only)

    environ = os.environ if environ is None else environ
    facts = placement(world, environment.detect(environ), environ, hardware.gpu_count())
    index = gpu_index(facts)
    if announce and world.local_rank == 0:
        space = shm_space()
        notes = [idle_notice(facts), shm_notice(*space, world.local_world_size, environ) if space else None]
        for note in filter(None, notes):
            print(note, file=sys.stderr, flush=True)
    return index


def before_workers(nproc: int) -> None:
    """In a caller about to start ``nproc`` GPU workers: refuse GPUs they could not open.

    Reads the compute modes only where CUDA is already initialised in this process (the driver
    is loaded; nothing new is set up before the workers start); otherwise costs one flag read.
    """
    states = hardware.cuda_contexts()
    problem = compute_mode_problem(states, nproc) if states else None
    if problem:
        raise ConfigurationError(problem)
