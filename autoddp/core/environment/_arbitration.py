"""Which launchers' worlds a process sits in, and whether they describe the same world.

A process can carry the variables of several launchers at once (torchrun inside an srun step,
mpirun's daemons started by srun, ``export RANK=$SLURM_PROCID`` in a batch script). These
helpers let each environment class decide whether it is the closest launcher.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from autoddp.core.environment._base import as_number

#: SLURM step ids from here up name special steps (batch script, interactive, extern), not srun.
_SLURM_SPECIAL_STEP = 0xFFFFFFF0


def slurm_step_id(environ: Mapping[str, str]) -> int | None:
    """The id of the srun step this process belongs to; None in the batch script or an salloc shell."""
    value = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    match = re.match(r"\s*(\d+)", value or "", re.ASCII)
    if match is None or int(match[1]) >= _SLURM_SPECIAL_STEP:
        return None
    return int(match[1])


def slurm_tasks_variable(environ: Mapping[str, str]) -> str | None:
    """Which variable holds the number of tasks of this step (the step's own count first)."""
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
        if name in environ:
            return name
    return None


def slurm_in_multitask_step(environ: Mapping[str, str]) -> bool:
    """True for one task of an srun step of several tasks."""
    if "SLURM_PROCID" not in environ:  # first: the one lookup outside SLURM
        return False
    tasks = slurm_tasks_variable(environ)
    return slurm_step_id(environ) is not None and tasks is not None and as_number(environ[tasks]) != 1


def launcher_worlds(environ: Mapping[str, str]) -> Iterator[tuple[str, str, str, str, str]]:
    """(label, rank variable, rank, size variable, size) of each scheduler or MPI world present."""
    if slurm_in_multitask_step(environ):
        tasks = slurm_tasks_variable(environ)
        assert tasks is not None
        yield "SLURM step", "SLURM_PROCID", environ["SLURM_PROCID"], tasks, environ[tasks]
    for label, rank, size in (
        ("Open MPI job", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("MPI (PMI) job", "PMI_RANK", "PMI_SIZE"),
    ):
        if rank in environ and size in environ:
            yield label, rank, environ[rank], size, environ[size]


def describes_other_world(
    environ: Mapping[str, str], rank_var: str, size_var: str, rank: str, size: str
) -> bool:
    """True when ``rank_var``/``size_var`` are set and do not say (``rank``, ``size``)."""
    if rank_var not in environ and size_var not in environ:
        return False
    return (as_number(environ.get(rank_var)), as_number(environ.get(size_var))) != (
        as_number(rank),
        as_number(size),
    )


def other_world_size(environ: Mapping[str, str], size: str) -> bool:
    """True when WORLD_SIZE is set to another size than the scheduler's: a launcher inside set it."""
    return "WORLD_SIZE" in environ and as_number(environ["WORLD_SIZE"]) != as_number(size)


def stale_rank_note(environ: Mapping[str, str], rank_var: str) -> str:
    """A note when RANK disagrees with the scheduler's rank in a world of the same size."""
    if "RANK" not in environ or as_number(environ["RANK"]) == as_number(environ.get(rank_var)):
        return ""
    return (
        f". RANK={environ['RANK']} disagrees with {rank_var}={environ.get(rank_var)} in a world of the same "
        f"size (RANK exported once for every task, e.g. before srun or with mpirun -x): {rank_var} is used"
    )
