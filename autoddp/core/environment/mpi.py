"""MPI launchers: Open MPI's ``mpirun`` and MPICH/Intel MPI's ``mpiexec`` (Hydra).

MPI gives rank and size but not rank 0's address. On one node autoddp uses loopback and port
``20000 + crc32(job key) % 10000`` from a variable all ranks share (``PMIX_NAMESPACE``...), or
with MPICH, which sets none, from the Hydra proxy process that started them; MPI across nodes
needs ``MASTER_ADDR``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import ClassVar

from autoddp.core.environment import hardware
from autoddp.core.environment._arbitration import other_world_size, stale_rank_note
from autoddp.core.environment._base import (
    LOOPBACK,
    PORT_BASE,
    PORT_SPAN,
    Environment,
    as_number,
    read_int,
    read_port,
    shared_port,
    show,
)
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import World

#: Variables every rank of one MPI job shares, in the order they are tried for a derived port.
#: ``PMI_PORT`` (Hydra's per-node PMI server) is shared only by the ranks of one node.
MPI_JOB_KEYS = (
    "PMIX_NAMESPACE",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_MCA_ess_base_jobid",
    "OMPI_MCA_orte_ess_jobid",
)
MPI_NODE_KEYS = ("PMI_PORT",)

#: Hydra's per-node process that starts the ranks: MPICH 4 on one node sets only ``PMI_FD``.
HYDRA_PROXY = "hydra_pmi_proxy"


def hydra_proxy(pid: int | None = None, proc: str = "/proc") -> str | None:
    """``"PID:START"`` of the nearest ``hydra_pmi_proxy`` above this process, or None.

    MPICH's mpiexec on one machine gives its ranks no variable they share (only ``PMI_FD``, a
    file descriptor), but the ranks of one node are all started by one proxy process: its pid
    and start time (which tell a reused pid apart) are what they share. Read from ``/proc``.
    """
    pid = os.getppid() if pid is None else pid
    for _ in range(32):  # a few launcher layers at most (a shell, srun's step daemon)
        try:
            with open(f"{proc}/{pid}/stat") as handle:
                stat = handle.read()
        except OSError:
            return None
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        if name == HYDRA_PROXY:
            return f"{pid}:{fields[19]}"
        pid = int(fields[1])
        if pid <= 1:
            return None
    return None


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
        if cls.size_var not in environ or as_number(environ[cls.size_var]) == 1:
            return False
        return not other_world_size(environ, environ[cls.size_var])

    def _local(self, rank: int, size: int) -> tuple[int, int]:
        env = self.environ
        if self.local_rank_var not in env or self.local_size_var not in env:
            raise ConfigurationError(
                f"{self.rank_var}/{self.size_var} are set but {self.local_rank_var}/{self.local_size_var} "
                "are not, so autoddp cannot tell which ranks share a machine or which GPU is this rank's: "
                "start the job with mpiexec from MPICH >= 3 or Intel MPI (Hydra sets them), srun, or torchrun"
            )
        return read_int(env, self.local_rank_var), read_int(env, self.local_size_var)

    def world(self) -> World:
        env = self.environ
        rank, size = read_int(env, self.rank_var), read_int(env, self.size_var)
        local_rank, local_size = self._local(rank, size)
        if not 0 <= rank < size or not 0 <= local_rank < local_size <= size:
            raise ConfigurationError(
                f"{show(env, self.markers)} do not describe a valid MPI world; these come from the MPI "
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
            device=hardware.task_device(local_rank),
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
            return read_port(env), "MASTER_PORT"
        keys = MPI_JOB_KEYS + (MPI_NODE_KEYS if local_size == size else ())
        for key in keys:
            if env.get(key):
                return shared_port(env[key]), f"{PORT_BASE} + crc32({key}) % {PORT_SPAN}"
        proxy = hydra_proxy() if local_size == size and "PMI_FD" in env else None
        if proxy is not None:
            owner = f"pid and start time of {HYDRA_PROXY} {proxy.split(':')[0]}"
            source = f"{PORT_BASE} + crc32({owner}) % {PORT_SPAN}"
            return shared_port(f"hydra:{proxy}"), source
        raise ConfigurationError(
            f"this MPI launcher sets no variable all ranks share ({', '.join(keys)}), so the ranks cannot "
            "agree on a port by themselves: export MASTER_PORT (a free port) to every rank, "
            f"e.g. {self.example}"
        )

    def explain(self) -> str:
        env = self.environ
        shown = show(env, [*self.markers, "MASTER_ADDR", "MASTER_PORT"])
        text = f"{shown}: rank {env.get(self.rank_var, '?')} of {env[self.size_var]} started by {self.name}"
        text += "; runs in place, no new processes"
        try:
            rank, size = read_int(env, self.rank_var), read_int(env, self.size_var)
            _, local_size = self._local(rank, size)
            addr, addr_from = self._master_addr(size, local_size)
            port, port_from = self._master_port(size, local_size)
            text += f". Rank 0 at {addr} ({addr_from}), port {port} ({port_from})"
        except ConfigurationError as error:
            text += f". Broken: {error}"
        if "SLURM_PROCID" in env:
            text += ". The SLURM variables describe the step that started the MPI daemons, not the ranks"
        return text + stale_rank_note(env, self.rank_var)

    def port_policy(self) -> str:
        env = self.environ
        try:
            rank, size = read_int(env, self.rank_var), read_int(env, self.size_var)
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
