"""autoddp: run a plain single-GPU PyTorch train function on every GPU with one decorator."""

from autoddp.decorator import distributed
from autoddp.errors import (
    AutoDDPError,
    ConfigurationError,
    RemoteError,
    SerializationError,
    WorkerError,
)
from autoddp.model import unwrap
from autoddp.prepare import prepare
from autoddp.world import barrier, device, is_main, local_rank, rank, world_size

__version__ = "0.1.0"

__all__ = [
    "AutoDDPError",
    "ConfigurationError",
    "RemoteError",
    "SerializationError",
    "WorkerError",
    "barrier",
    "device",
    "distributed",
    "is_main",
    "local_rank",
    "prepare",
    "rank",
    "unwrap",
    "world_size",
]
