"""Where-am-I detection: which launcher (if any) started this process, and what world it gives.

Each environment is a small class that recognises itself from environment variables
(``matches``), describes the world it implies (``world``: rank, local rank, world size, node
rank, rank 0's address and port) and says which variables made the decision (``explain``).
``launched`` is True where the launcher already started every process, so ``@distributed``
runs in place. Reading only: nothing here changes the environment.

``detect()`` refuses ``RANK`` without ``WORLD_SIZE`` (or the reverse), then tries the classes
in this order; the first that matches wins. The rule behind the order: the launcher closest to
the process wins, because it started it.

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

Ports: ``MASTER_ADDR``/``MASTER_PORT`` always win where set. A SLURM step without them uses
the first host of the step's node list and port ``20000 + SLURM_JOB_ID % 10000``: every task
computes the same number without talking, consecutive jobs sharing a node get different ports,
and the range stays unprivileged and below Linux's ephemeral ports (32768-60999). MPI on one
node uses loopback and ``20000 + crc32(job key) % 10000`` from a variable all ranks share
(``PMIX_NAMESPACE``...); MPI across nodes needs ``MASTER_ADDR``. autoddp's own launches use a
free port the operating system picks, on loopback (``launch.loopback_store``).
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Iterator, Mapping
from typing import ClassVar

import torch

from autoddp.errors import ConfigurationError
from autoddp.world import World

LOOPBACK = "127.0.0.1"

#: Derived ports lie in [PORT_BASE, PORT_BASE + PORT_SPAN): unprivileged, below the ephemeral range.
PORT_BASE = 20000
PORT_SPAN = 10000

#: SLURM step ids from here up name special steps (batch script, interactive, extern), not srun.
_SLURM_SPECIAL_STEP = 0xFFFFFFF0

#: Variables every rank of one MPI job shares, in the order they are tried for a derived port.
#: ``PMI_PORT`` (Hydra's per-node PMI server) is shared only by the ranks of one node.
MPI_JOB_KEYS = (
    "PMIX_NAMESPACE",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_MCA_ess_base_jobid",
    "OMPI_MCA_orte_ess_jobid",
)
MPI_NODE_KEYS = ("PMI_PORT",)


def gpu_count() -> int:
    """Visible CUDA GPUs, counted without initialising CUDA (so fork stays usable)."""
    if not torch.backends.cuda.is_built():
        return 0
    return torch.cuda.device_count()


def cpu_count() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_device(local_rank: int) -> str:
    """``cuda:<local_rank>`` when that GPU is visible, else the CPU."""
    gpus = gpu_count()
    return f"cuda:{local_rank}" if gpus > local_rank else "cpu"


def task_device(local_rank: int) -> str:
    """The GPU of a task a scheduler started: ``cuda:<local_rank % visible GPUs>``, else the CPU.

    With every GPU of the node visible this is ``cuda:<local_rank>``; with per-task binding
    (``--gpus-per-task``, ``--gpu-bind``) each task sees only its share, counted from 0.
    """
    gpus = gpu_count()
    return f"cuda:{local_rank % gpus}" if gpus else "cpu"


def _parse_int(value: str) -> int | None:
    """A whole number written plainly (``"03"``, ``" 3"``), else None (no ``1_0``, no ``٣``)."""
    return int(value) if re.fullmatch(r"\s*[-+]?\d+\s*", value, re.ASCII) else None


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise ConfigurationError(f"environment variable {name} is not set")
        return default
    number = _parse_int(value)
    if number is None:
        raise ConfigurationError(f"environment variable {name}={value!r} is not an integer; fix or unset it")
    return number


def _port(environ: Mapping[str, str], name: str = "MASTER_PORT") -> int:
    port = _int(environ, name)
    if not 0 < port < 65536:
        raise ConfigurationError(f"{name}={port} is not a port number (1-65535); fix or unset it")
    return port


def _number(value: str | None) -> int | str | None:
    """A launcher value as a number when it is one (``"03"`` and ``"3"`` agree), else as given."""
    if value is None:
        return None
    number = _parse_int(value)
    return value.strip() if number is None else number


def _show(environ: Mapping[str, str], names: tuple[str, ...] | list[str]) -> str:
    return ", ".join(f"{name}={environ[name]}" for name in names if name in environ)


# -- SLURM helpers ---------------------------------------------------------------------------


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-03,7],gpu5`` into host names, in order.

    Zero padding is kept (``n[08-10]`` gives ``n08 n09 n10``) and several bracket groups in one
    name multiply (``r[1-2]n[1-2]`` gives ``r1n1 r1n2 r2n1 r2n2``).
    """
    return list(_iter_hostlist(text))


def first_host(text: str) -> str:
    """The first host of a SLURM host list, without expanding the rest."""
    for host in _iter_hostlist(text):
        return host
    raise ConfigurationError(f"the SLURM host list {text!r} names no host; set MASTER_ADDR instead")


def _iter_hostlist(text: str) -> Iterator[str]:
    depth, start = 0, 0
    for i, char in enumerate(text + ","):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _bad_hostlist(text, "']' without '['")
        elif char == "," and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if item:
                yield from _expand_host(item, text)
    if depth:
        raise _bad_hostlist(text, "'[' without ']'")


def _expand_host(item: str, text: str) -> Iterator[str]:
    opening = item.find("[")
    if opening < 0:
        if "]" in item:
            raise _bad_hostlist(text, "']' without '['")
        yield item
        return
    closing = item.find("]", opening)
    if closing < 0:
        raise _bad_hostlist(text, "'[' without ']'")
    prefix, ranges, rest = item[:opening], item[opening + 1 : closing], item[closing + 1 :]
    for part in ranges.split(","):
        low, dash, high = part.strip().partition("-")
        high = high if dash else low
        if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
            raise _bad_hostlist(text, f"[{ranges}] is not a list of numbers and ranges such as 01-03,7")
        for number in range(int(low), int(high) + 1):
            for tail in _expand_host(rest, text) if rest else ("",):
                yield f"{prefix}{number:0{len(low)}d}{tail}"


def _bad_hostlist(text: str, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"cannot read the SLURM host list {text!r}: {why}; set MASTER_ADDR to rank 0's host instead"
    )


def slurm_port(job_id: str) -> int:
    """The port every task of a SLURM job derives alike: ``20000 + SLURM_JOB_ID % 10000``."""
    number = _parse_int(job_id)
    if number is None or number < 0:
        raise ConfigurationError(
            f"SLURM_JOB_ID={job_id!r} is not a number, so no port can be derived from it; set MASTER_PORT"
        )
    return PORT_BASE + number % PORT_SPAN


def shared_port(key: str) -> int:
    """A port derived from a value all ranks share: ``20000 + crc32(key) % 10000``."""
    return PORT_BASE + zlib.crc32(key.encode()) % PORT_SPAN


def _slurm_step_id(environ: Mapping[str, str]) -> int | None:
    """The id of the srun step this process belongs to; None in the batch script or an salloc shell."""
    value = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    match = re.match(r"\s*(\d+)", value or "", re.ASCII)
    if match is None or int(match[1]) >= _SLURM_SPECIAL_STEP:
        return None
    return int(match[1])


def _slurm_tasks_variable(environ: Mapping[str, str]) -> str | None:
    """Which variable holds the number of tasks of this step (the step's own count first)."""
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
        if name in environ:
            return name
    return None


def _slurm_in_multitask_step(environ: Mapping[str, str]) -> bool:
    tasks = _slurm_tasks_variable(environ)
    return (
        "SLURM_PROCID" in environ
        and _slurm_step_id(environ) is not None
        and tasks is not None
        and _number(environ[tasks]) != 1
    )


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


def _launcher_worlds(environ: Mapping[str, str]) -> Iterator[tuple[str, str, str, str, str]]:
    """(label, rank variable, rank, size variable, size) of each scheduler or MPI world present."""
    if _slurm_in_multitask_step(environ):
        tasks = _slurm_tasks_variable(environ)
        assert tasks is not None
        yield "SLURM step", "SLURM_PROCID", environ["SLURM_PROCID"], tasks, environ[tasks]
    for label, rank, size in (
        ("Open MPI job", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("MPI (PMI) job", "PMI_RANK", "PMI_SIZE"),
    ):
        if rank in environ and size in environ:
            yield label, rank, environ[rank], size, environ[size]


def _describes_other_world(
    environ: Mapping[str, str], rank_var: str, size_var: str, rank: str, size: str
) -> bool:
    """True when ``rank_var``/``size_var`` are set and do not say (``rank``, ``size``)."""
    if rank_var not in environ and size_var not in environ:
        return False
    return (_number(environ.get(rank_var)), _number(environ.get(size_var))) != (_number(rank), _number(size))


def _other_world_size(environ: Mapping[str, str], size: str) -> bool:
    """True when WORLD_SIZE is set to another size than the scheduler's: a launcher inside set it."""
    return "WORLD_SIZE" in environ and _number(environ["WORLD_SIZE"]) != _number(size)


def _stale_rank_note(environ: Mapping[str, str], rank_var: str) -> str:
    """A note when RANK disagrees with the scheduler's rank in a world of the same size."""
    if "RANK" not in environ or _number(environ["RANK"]) == _number(environ.get(rank_var)):
        return ""
    return (
        f". RANK={environ['RANK']} disagrees with {rank_var}={environ.get(rank_var)} in a world of the same "
        f"size (RANK exported once for every task, e.g. before srun or with mpirun -x): {rank_var} is used"
    )


# -- the environments ------------------------------------------------------------------------


class Environment:
    """One way a process can have been started. Subclasses recognise themselves in ``matches``."""

    name: ClassVar[str] = "plain process"
    #: True when the launcher already started every process: autoddp runs in place.
    launched: ClassVar[bool] = False
    #: The variables that identify this environment (shown by ``explain``).
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    @classmethod
    def matches(cls, environ: Mapping[str, str]) -> bool:
        """True when ``environ`` is this environment's."""
        return all(name in environ for name in cls.markers)

    def world(self) -> World:
        """The world this process belongs to (raises ``ConfigurationError`` if the variables are broken)."""
        return World(device=default_device(0))

    def explain(self) -> str:
        """The variables that made the decision, and what it means for ``@distributed``."""
        if not self.markers:
            return "no launcher variables set"
        return _show(self.environ, self.markers)

    def port_policy(self) -> str:
        """Where rank 0's port comes from in this environment."""
        if "MASTER_PORT" in self.environ:
            return f"MASTER_PORT={self.environ['MASTER_PORT']}, set by the launcher"
        return "MASTER_PORT is not set"


class _RankVariables(Environment):
    """Launchers that export torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*."""

    launched = True
    markers = ("RANK", "WORLD_SIZE")
    launcher: ClassVar[str] = "a launcher that sets RANK/WORLD_SIZE"

    def world(self) -> World:
        env = self.environ
        rank = _int(env, "RANK")
        world_size = _int(env, "WORLD_SIZE")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigurationError(
                f"RANK={rank} and WORLD_SIZE={world_size} do not describe a valid world "
                "(need 0 <= RANK < WORLD_SIZE); fix or unset them"
            )
        local_rank, local_world_size = self._local(rank, world_size)
        return World(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=_int(env, "GROUP_RANK", rank // max(local_world_size, 1)),
            master_addr=env.get("MASTER_ADDR"),
            master_port=_port(env) if "MASTER_PORT" in env else None,
            device=default_device(local_rank),
        )

    def _local(self, rank: int, world_size: int) -> tuple[int, int]:
        env = self.environ
        local_rank = _int(env, "LOCAL_RANK", rank if "LOCAL_WORLD_SIZE" not in env else None)
        return local_rank, _int(env, "LOCAL_WORLD_SIZE", world_size)

    def explain(self) -> str:
        text = f"{_show(self.environ, self.markers)}: started by {self.launcher}; runs in place"
        outer = [label for label, *_ in _launcher_worlds(self.environ)]
        if outer:
            text += f" (inside a {' and '.join(outer)}: the closest launcher wins)"
        return text


class AutoDDPWorker(_RankVariables):
    """A worker started by autoddp (the decorator or the ``autoddp`` command)."""

    name = "autoddp worker"
    launcher = "autoddp"
    markers = ("AUTODDP_RUN_ID", "RANK", "WORLD_SIZE")

    def port_policy(self) -> str:
        port = self.environ.get("MASTER_PORT", "?")
        return (
            f"{port}: a free port the operating system picked on 127.0.0.1 when autoddp started the workers"
        )


class TorchElastic(_RankVariables):
    """A worker started by torchrun / torch.distributed.elastic."""

    name = "torchrun (torch.distributed.elastic)"
    launcher = "torchrun"
    markers = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")


class SlurmStep(Environment):
    """One task of an srun step of several tasks: SLURM started every process, autoddp joins them."""

    name = "SLURM step (srun)"
    launched = True
    markers = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_ID", "SLURM_JOB_ID")

    @classmethod
    def matches(cls, environ: Mapping[str, str]) -> bool:
        if not _slurm_in_multitask_step(environ):
            return False
        tasks = environ[_slurm_tasks_variable(environ) or "SLURM_NTASKS"]
        rank = environ["SLURM_PROCID"]
        mpi = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))
        if any(_describes_other_world(environ, r, s, rank, tasks) for r, s in mpi):
            return False  # mpirun inside the allocation: its daemons ran in this step
        return not _other_world_size(environ, tasks)

    def _tasks_variable(self) -> str:
        return _slurm_tasks_variable(self.environ) or "SLURM_NTASKS"

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
            return _int(env, "SLURM_NTASKS_PER_NODE")
        for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
            if name in env:
                return -(-world_size // max(_int(env, name), 1))
        return world_size

    def world(self) -> World:
        env = self.environ
        tasks = self._tasks_variable()
        rank = _int(env, "SLURM_PROCID")
        world_size = _int(env, tasks)
        local_rank = _int(env, "SLURM_LOCALID")
        node_rank = _int(env, "SLURM_NODEID", 0)
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
            device=task_device(local_rank),
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
            return _port(self.environ), "MASTER_PORT"
        job = self.environ.get("SLURM_JOB_ID", self.environ.get("SLURM_JOBID"))
        if job is None:
            raise ConfigurationError(
                "this SLURM step has no SLURM_JOB_ID to derive rank 0's port from: set MASTER_PORT "
                "(a free port on rank 0's host) for every task"
            )
        return slurm_port(job), f"{PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}"

    def explain(self) -> str:
        env = self.environ
        names = [*self.markers[:4], self._tasks_variable(), "SLURM_STEP_TASKS_PER_NODE"]
        names += [
            self._nodelist_variable() or "SLURM_JOB_NODELIST",
            "SLURM_JOB_ID",
            "MASTER_ADDR",
            "MASTER_PORT",
        ]
        text = f"{_show(env, names)}: task {env['SLURM_PROCID']} of an srun step of "
        text += f"{env[self._tasks_variable()]} tasks; runs in place, no new processes"
        try:
            world = self.world()
            _, addr_from = self._master_addr()
            _, port_from = self._master_port()
            text += f". Rank 0 at {world.master_addr} ({addr_from}), port {world.master_port} ({port_from})"
            text += self._gpu_note(world)
        except ConfigurationError as error:
            text += f". Broken: {error}"
        others = [label for label, *_ in _launcher_worlds(env) if label != "SLURM step"]
        if others:
            text += f". The {' and '.join(others)} variables describe the same world; SLURM's node list wins"
        return text + _stale_rank_note(env, "SLURM_PROCID")

    def _gpu_note(self, world: World) -> str:
        gpus = gpu_count()
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


class _MPI(Environment):
    """A rank started by an MPI launcher: MPI gives rank and size but not rank 0's address."""

    launched = True
    rank_var: ClassVar[str]
    size_var: ClassVar[str]
    local_rank_var: ClassVar[str]
    local_size_var: ClassVar[str]
    example: ClassVar[str]  # how to pass a variable to every rank with this launcher

    @classmethod
    def matches(cls, environ: Mapping[str, str]) -> bool:
        if cls.size_var not in environ or _number(environ[cls.size_var]) == 1:
            return False
        return not _other_world_size(environ, environ[cls.size_var])

    def _local(self, rank: int, size: int) -> tuple[int, int]:
        env = self.environ
        if self.local_rank_var not in env or self.local_size_var not in env:
            raise ConfigurationError(
                f"{self.rank_var}/{self.size_var} are set but {self.local_rank_var}/{self.local_size_var} "
                "are not, so autoddp cannot tell which ranks share a machine or which GPU is this rank's: "
                "start the job with mpiexec from MPICH >= 3 or Intel MPI (Hydra sets them), srun, or torchrun"
            )
        return _int(env, self.local_rank_var), _int(env, self.local_size_var)

    def world(self) -> World:
        env = self.environ
        rank, size = _int(env, self.rank_var), _int(env, self.size_var)
        local_rank, local_size = self._local(rank, size)
        if not 0 <= rank < size or not 0 <= local_rank < local_size <= size:
            raise ConfigurationError(
                f"{_show(env, self.markers)} do not describe a valid MPI world; these come from the MPI "
                "launcher and should not be set by hand: unset them, or start the job with mpirun"
            )
        addr, _ = self._master_addr(size, local_size)
        port, _ = self._master_port(size, local_size)
        return World(
            rank=rank,
            local_rank=local_rank,
            world_size=size,
            local_world_size=local_size,
            node_rank=rank // local_size if size % local_size == 0 else 0,
            master_addr=addr,
            master_port=port,
            device=task_device(local_rank),
        )

    def _master_addr(self, size: int, local_size: int) -> tuple[str, str]:
        if "MASTER_ADDR" in self.environ:
            return self.environ["MASTER_ADDR"], "MASTER_ADDR"
        if local_size == size:
            return LOOPBACK, f"loopback: all {size} ranks on this node ({self.local_size_var}={local_size})"
        raise ConfigurationError(
            f"this MPI job spans several machines ({self.size_var}={size}, "
            f"{self.local_size_var}={local_size}) and MPI does not say where rank 0 is: export "
            "MASTER_ADDR (rank 0's host) and MASTER_PORT (a free port there) to every rank, "
            f"e.g. {self.example}"
            " (under SLURM: MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1))"
        )

    def _master_port(self, size: int, local_size: int) -> tuple[int, str]:
        env = self.environ
        if "MASTER_PORT" in env:
            return _port(env), "MASTER_PORT"
        keys = MPI_JOB_KEYS + (MPI_NODE_KEYS if local_size == size else ())
        for key in keys:
            if env.get(key):
                return shared_port(env[key]), f"{PORT_BASE} + crc32({key}) % {PORT_SPAN}"
        raise ConfigurationError(
            f"this MPI launcher sets no variable all ranks share ({', '.join(keys)}), so the ranks cannot "
            "agree on a port by themselves: export MASTER_PORT (a free port) to every rank, "
            f"e.g. {self.example}"
        )

    def explain(self) -> str:
        env = self.environ
        shown = _show(env, [*self.markers, "MASTER_ADDR", "MASTER_PORT"])
        text = f"{shown}: rank {env.get(self.rank_var, '?')} of {env[self.size_var]} started by {self.name}"
        text += "; runs in place, no new processes"
        try:
            rank, size = _int(env, self.rank_var), _int(env, self.size_var)
            _, local_size = self._local(rank, size)
            addr, addr_from = self._master_addr(size, local_size)
            port, port_from = self._master_port(size, local_size)
            text += f". Rank 0 at {addr} ({addr_from}), port {port} ({port_from})"
        except ConfigurationError as error:
            text += f". Broken: {error}"
        if "SLURM_PROCID" in env:
            text += ". The SLURM variables describe the step that started the MPI daemons, not the ranks"
        return text + _stale_rank_note(env, self.rank_var)

    def port_policy(self) -> str:
        env = self.environ
        try:
            rank, size = _int(env, self.rank_var), _int(env, self.size_var)
            _, local_size = self._local(rank, size)
            port, source = self._master_port(size, local_size)
        except ConfigurationError as error:
            return str(error)
        return f"{port} ({source}); MASTER_PORT overrides"


class OpenMPI(_MPI):
    """A rank started by Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_*``)."""

    name = "Open MPI (mpirun)"
    rank_var = "OMPI_COMM_WORLD_RANK"
    size_var = "OMPI_COMM_WORLD_SIZE"
    local_rank_var = "OMPI_COMM_WORLD_LOCAL_RANK"
    local_size_var = "OMPI_COMM_WORLD_LOCAL_SIZE"
    markers = (rank_var, size_var, local_rank_var, local_size_var)
    example = "mpirun -x MASTER_ADDR=node01 -x MASTER_PORT=29500 ..."


class MPICH(_MPI):
    """A rank started by MPICH's or Intel MPI's ``mpiexec`` (Hydra: ``PMI_RANK``, ``MPI_LOCALRANKID``)."""

    name = "MPICH / Intel MPI (mpiexec)"
    rank_var = "PMI_RANK"
    size_var = "PMI_SIZE"
    local_rank_var = "MPI_LOCALRANKID"
    local_size_var = "MPI_LOCALNRANKS"
    markers = (rank_var, size_var, local_rank_var, local_size_var)
    example = "mpiexec -genv MASTER_ADDR node01 -genv MASTER_PORT 29500 ..."


class RankEnv(_RankVariables):
    """Any other launcher that sets RANK and WORLD_SIZE (Kubeflow PyTorchJob, other operators, scripts)."""

    name = "RANK/WORLD_SIZE launcher (Kubeflow PyTorchJob, other operators, scripts)"
    markers = ("RANK", "WORLD_SIZE")

    def _local(self, rank: int, world_size: int) -> tuple[int, int]:
        env = self.environ
        if "KUBERNETES_SERVICE_HOST" in env and "LOCAL_RANK" not in env and "LOCAL_WORLD_SIZE" not in env:
            return 0, 1  # a PyTorchJob replica: one process per pod
        return super()._local(rank, world_size)

    def explain(self) -> str:
        env = self.environ
        shown = _show(
            env, ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
        )
        text = f"{shown}: a launcher other than torchrun set RANK/WORLD_SIZE; runs in place, no new processes"
        if "LOCAL_RANK" not in env and "LOCAL_WORLD_SIZE" not in env:
            if "KUBERNETES_SERVICE_HOST" in env:
                text += ". In a Kubernetes pod without LOCAL_RANK: one process per pod (local rank 0)"
            else:
                text += ". LOCAL_RANK is not set: all processes assumed on this machine (local rank = RANK)"
        if "MASTER_ADDR" not in env and _number(env.get("WORLD_SIZE")) != 1:
            text += ". MASTER_ADDR is not set: joining the process group will fail until it is"
        try:
            self.world()
        except ConfigurationError as error:
            return f"{text}. Broken: {error}"
        for label, rank_var, rank, size_var, size in _launcher_worlds(env):
            if not _other_world_size(env, size):
                continue
            text += (
                f". Also inside a {label} ({rank_var}={rank}, {size_var}={size}) that describes another "
                "world: a launcher inside it set RANK/WORLD_SIZE, and they win"
            )
        return text


class SlurmAllocation(Environment):
    """Inside a SLURM job but not a task of a multi-task step: autoddp starts its own workers."""

    name = "SLURM allocation, single process (not a multi-task srun step)"
    launched = False

    @classmethod
    def matches(cls, environ: Mapping[str, str]) -> bool:
        return any(name in environ for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_PROCID"))

    def explain(self) -> str:
        env = self.environ
        tasks = _slurm_tasks_variable(env)
        shown = _show(
            env, ["SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_PROCID", "SLURM_STEP_ID", tasks or "SLURM_NTASKS"]
        )
        if _slurm_step_id(env) is None:
            step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
            where = (
                "no srun step (SLURM_STEP_ID unset): an salloc shell or the batch script"
                if step is None
                else f"SLURM_STEP_ID={step} is the batch script or an interactive step, not an srun step"
            )
            if tasks is not None and _number(env[tasks]) != 1:
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
        return _own_port_policy(self.environ)


class Plain(Environment):
    """An ordinary process: autoddp starts the workers itself."""

    def explain(self) -> str:
        single = _show(self.environ, ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
        if single:
            return (
                f"{single}: an MPI world of one process; @distributed starts its own workers here "
                "(one per visible GPU)"
            )
        return "no launcher variables set: @distributed starts its own workers (one per visible GPU)"

    def port_policy(self) -> str:
        return _own_port_policy(self.environ)


def _own_port_policy(environ: Mapping[str, str]) -> str:
    if "MASTER_PORT" in environ:
        return f"autoddp's own launches: rank 0's store on 127.0.0.1:{environ['MASTER_PORT']} (MASTER_PORT)"
    return "autoddp's own launches: rank 0's store on 127.0.0.1, a free port the operating system picks"


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
