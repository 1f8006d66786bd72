"""Any other launcher that sets ``RANK``/``WORLD_SIZE``: Kubeflow's PyTorchJob, other operators, scripts."""

from __future__ import annotations

from autoddp.core.environment._arbitration import launcher_worlds, other_world_size
from autoddp.core.environment._base import as_number, show
from autoddp.core.environment.torchrun import RankVariables
from autoddp.core.errors import ConfigurationError


class RankEnv(RankVariables):
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
        shown = show(
            env, ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
        )
        text = f"{shown}: a launcher other than torchrun set RANK/WORLD_SIZE; runs in place, no new processes"
        if "LOCAL_RANK" not in env and "LOCAL_WORLD_SIZE" not in env:
            if "KUBERNETES_SERVICE_HOST" in env:
                text += ". In a Kubernetes pod without LOCAL_RANK: one process per pod (local rank 0)"
            else:
                text += ". LOCAL_RANK is not set: all processes assumed on this machine (local rank = RANK)"
        if "MASTER_ADDR" not in env and as_number(env.get("WORLD_SIZE")) != 1:
            text += ". MASTER_ADDR is not set: joining the process group will fail until it is"
        try:
            self.world()
        except ConfigurationError as error:
            return f"{text}. Broken: {error}"
        for label, rank_var, rank, size_var, size in launcher_worlds(env):
            if not other_world_size(env, size):
                continue
            text += (
                f". Also inside a {label} ({rank_var}={rank}, {size_var}={size}) that describes another "
                "world: a launcher inside it set RANK/WORLD_SIZE, and they win"
            )
        return text
