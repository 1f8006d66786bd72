"""SLURM: one task of a multi-task srun step (launched), or a process inside an allocation (not).

A SLURM step without ``MASTER_ADDR``/``MASTER_PORT`` finds rank 0 at the first host of the step's
node list, on port ``20000 + (SLURM_JOB_ID + 1009 * SLURM_STEP_ID) % 10000``: every task computes
the same number without talking, consecutive jobs sharing a node get different ports, so do
steps of one job running at the same time (``srun ... &`` twice in one allocation; step 0 has
``20000 + SLURM_JOB_ID % 10000``), and the range stays unprivileged and below Linux's ephemeral
ports (32768-60999).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from autoddp.core.environment import hardware
from autoddp.core.environment._arbitration import (
    describes_other_world,
    launcher_worlds,
    other_world_size,
    slurm_in_multitask_step,
    slurm_step_id,
    slurm_tasks_variable,
    stale_rank_note,
)
from autoddp.core.environment._base import (
    PORT_BASE,
    PORT_SPAN,
    Environment,
    as_number,
    own_port_policy,
    parse_int,
    read_int,
    read_port,
    show,
)
from autoddp.core.environment._hostlist import first_host
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import World

#: Steps of one job are this far apart in the port range (a prime: every step a different port).
STEP_STRIDE = 1009


def slurm_port(job_id: str, step_id: int = 0) -> int:
    """The port every task of a SLURM step derives alike: ``20000 + (job + 1009 * step) % 10000``."""
    number = parse_int(job_id)
    if number is None or number < 0:
        raise ConfigurationError(
            f"SLURM_JOB_ID={job_id!r} is not a number, so no port can be derived from it; set MASTER_PORT"
        )
    return PORT_BASE + (number + STEP_STRIDE * step_id) % PORT_SPAN


def _tasks_on_node(tasks_per_node: str, node: int) -> int | None:
    """Tasks on node ``node`` from SLURM's compact form, e.g. ``2(x3),1``; None if unreadable."""
    first = 0
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        repeat = int(match[2] or 1)
        if node < first + repeat:
            return int(match[1])
        first += repeat
    return None


class SlurmStep(Environment):
    """One task of an srun step of several tasks: SLURM started every process, autoddp joins them."""

    name = "SLURM step (srun)"
    launched = True
    markers = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_ID", "SLURM_JOB_ID")

    @classmethod
    def matches(cls, environ: Mapping[str, str]) -> bool:
        if not slurm_in_multitask_step(environ):
            return False
        tasks = environ[slurm_tasks_variable(environ) or "SLURM_NTASKS"]
        rank = environ["SLURM_PROCID"]
        mpi = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))
        if any(describes_other_world(environ, r, s, rank, tasks) for r, s in mpi):
            return False  # mpirun inside the allocation: its daemons ran in this step
        return not other_world_size(environ, tasks)

    def _tasks_variable(self) -> str:
        return slurm_tasks_variable(self.environ) or "SLURM_NTASKS"

    def _nodelist_variable(self) -> str | None:
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if name in self.environ:
                return name
        return None

    def _local_world_size(self, world_size: int, node_rank: int) -> int:
        """Tasks on this node: srun's per-node counts, else an even split over the step's nodes."""
        env = self.environ
        for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            count = _tasks_on_node(env.get(name, ""), node_rank)
            if count is not None:
                return count
        if "SLURM_NTASKS_PER_NODE" in env:
            return read_int(env, "SLURM_NTASKS_PER_NODE")
        for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
            if name in env:
                return -(-world_size // max(read_int(env, name), 1))
        return world_size

    def world(self) -> World:
        env = self.environ
        tasks = self._tasks_variable()
        rank = read_int(env, "SLURM_PROCID")
        world_size = read_int(env, tasks)
        local_rank = read_int(env, "SLURM_LOCALID")
        node_rank = read_int(env, "SLURM_NODEID", 0)
        local_world_size = self._local_world_size(world_size, node_rank)
        if not 0 <= rank < world_size or not 0 <= local_rank < local_world_size:
            raise ConfigurationError(
                f"SLURM_PROCID={rank}, SLURM_LOCALID={local_rank} do not fit a step of {world_size} tasks "
                f"({local_world_size} on this node); these variables come from srun and should not be set "
                "by hand: unset them, or start the job with srun"
            )
        addr, _ = self._master_addr()
        port, _ = self._master_port()
        return World(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=node_rank,
            master_addr=addr,
            master_port=port,
            device=hardware.task_device(local_rank),
        )

    def _master_addr(self) -> tuple[str, str]:
        if "MASTER_ADDR" in self.environ:
            return self.environ["MASTER_ADDR"], "MASTER_ADDR"
        name = self._nodelist_variable()
        if name is None:
            raise ConfigurationError(
                "this SLURM step names no node list (SLURM_STEP_NODELIST / SLURM_JOB_NODELIST), so rank "
                "0's host is unknown: set MASTER_ADDR to it for every task"
            )
        return first_host(self.environ[name]), f"first host of {name}"

    def _master_port(self) -> tuple[int, str]:
        if "MASTER_PORT" in self.environ:
            return read_port(self.environ), "MASTER_PORT"
        job = self.environ.get("SLURM_JOB_ID", self.environ.get("SLURM_JOBID"))
        if job is None:
            raise ConfigurationError(
                "this SLURM step has no SLURM_JOB_ID to derive rank 0's port from: set MASTER_PORT "
                "(a free port on rank 0's host) for every task"
            )
        step = slurm_step_id(self.environ) or 0
        if step == 0:
            return slurm_port(job), f"{PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}"
        source = f"{PORT_BASE} + (SLURM_JOB_ID + {STEP_STRIDE} * SLURM_STEP_ID) % {PORT_SPAN}"
        return slurm_port(job, step), source

    def explain(self) -> str:
        env = self.environ
        names = [*self.markers[:4], self._tasks_variable(), "SLURM_STEP_TASKS_PER_NODE"]
        names += [
            self._nodelist_variable() or "SLURM_JOB_NODELIST",
            "SLURM_JOB_ID",
            "MASTER_ADDR",
            "MASTER_PORT",
        ]
        text = f"{show(env, names)}: task {env['SLURM_PROCID']} of an srun step of "
        text += f"{env[self._tasks_variable()]} tasks; runs in place, no new processes"
        try:
            world = self.world()
            _, addr_from = self._master_addr()
            _, port_from = self._master_port()
            text += f". Rank 0 at {world.master_addr} ({addr_from}), port {world.master_port} ({port_from})"
            text += self._gpu_note(world)
        except ConfigurationError as error:
            text += f". Broken: {error}"
        others = [label for label, *_ in launcher_worlds(env) if label != "SLURM step"]
        if others:
            text += f". The {' and '.join(others)} variables describe the same world; SLURM's node list wins"
        return text + stale_rank_note(env, "SLURM_PROCID")

    def _gpu_note(self, world: World) -> str:
        gpus = hardware.gpu_count()
        if not gpus:
            return ""
        here = world.local_world_size
        note = f". {here} task(s) on this node, {gpus} GPU(s) visible to this task: uses {world.device}"
        if here < gpus:
            note += (
                f"; {gpus - here} GPU(s) stay idle (start one task per GPU: srun --ntasks-per-node={gpus})"
            )
        elif here % gpus:
            note += "; tasks share GPUs, which NCCL refuses: give each task its own (--gpus-per-task=1)"
        return note

    def port_policy(self) -> str:
        try:
            port, source = self._master_port()
        except ConfigurationError as error:
            return str(error)
        return f"{port} ({source}); MASTER_PORT overrides"


class SlurmAllocation(Environment):
    """Inside a SLURM job but not a task of a multi-task step: autoddp starts its own workers."""

    name = "SLURM allocation, single process (not a multi-task srun step)"
    launched = False

    @classmethod
    def matches(cls, environ: Mapping[str, str]) -> bool:
        return any(name in environ for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_PROCID"))

    def explain(self) -> str:
        env = self.environ
        tasks = slurm_tasks_variable(env)
        shown = show(
            env, ["SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_PROCID", "SLURM_STEP_ID", tasks or "SLURM_NTASKS"]
        )
        if slurm_step_id(env) is None:
            step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
            where = (
                "no srun step (SLURM_STEP_ID unset): an salloc shell or the batch script"
                if step is None
                else f"SLURM_STEP_ID={step} is the batch script or an interactive step, not an srun step"
            )
            if tasks is not None and as_number(env[tasks]) != 1:
                where += (
                    f"; the allocation has {env[tasks]} tasks, but only srun starts them (srun python "
                    "script.py runs one process per task, and autoddp joins them)"
                )
        else:
            where = f"a single-task srun step ({tasks}={env[tasks]})" if tasks else "an srun step of one task"
        return (
            f"{shown}: {where}. Not a multi-task step: this is one process, and @distributed starts "
            "its own workers here (one per visible GPU)"
        )

    def port_policy(self) -> str:
        return own_port_policy(self.environ)
