"""Workers started by torchrun (torch.distributed.elastic) or by autoddp: torchrun's variables."""

from __future__ import annotations

from typing import ClassVar

from autoddp.core import _variables
from autoddp.core.environment import hardware
from autoddp.core.environment._arbitration import launcher_worlds
from autoddp.core.environment._base import Environment, read_int, read_port, show
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import World


class RankVariables(Environment):
    """Launchers that export torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*."""

    launched = True
    markers = ("RANK", "WORLD_SIZE")
    launcher: ClassVar[str] = "a launcher that sets RANK/WORLD_SIZE"

    def world(self) -> World:
        env = self.environ
        rank = read_int(env, "RANK")
        world_size = read_int(env, "WORLD_SIZE")
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
            node_rank=read_int(env, "GROUP_RANK", rank // max(local_world_size, 1)),
            master_addr=env.get("MASTER_ADDR"),
            master_port=read_port(env) if "MASTER_PORT" in env else None,
            device=hardware.default_device(local_rank),
        )

    def _local(self, rank: int, world_size: int) -> tuple[int, int]:
        env = self.environ
        local_rank = read_int(env, "LOCAL_RANK", rank if "LOCAL_WORLD_SIZE" not in env else None)
        return local_rank, read_int(env, "LOCAL_WORLD_SIZE", world_size)

    def explain(self) -> str:
        text = f"{show(self.environ, self.markers)}: started by {self.launcher}; runs in place"
        outer = [label for label, *_ in launcher_worlds(self.environ)]
        if outer:
            text += f" (inside a {' and '.join(outer)}: the closest launcher wins)"
        return text


class AutoDDPWorker(RankVariables):
    """A worker started by autoddp (the decorator or the ``autoddp`` command)."""

    name = "autoddp worker"
    launcher = "autoddp"
    markers = (_variables.RUN_ID, "RANK", "WORLD_SIZE")

    def port_policy(self) -> str:
        port = self.environ.get("MASTER_PORT", "?")
        return (
            f"{port}: a free port the operating system picked on 127.0.0.1 when autoddp started the workers"
        )


class TorchElastic(RankVariables):
    """A worker started by torchrun / torch.distributed.elastic."""

    name = "torchrun (torch.distributed.elastic)"
    launcher = "torchrun"
    markers = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")
