"""autoddp: run a plain single-GPU PyTorch train function on every GPU with one decorator."""

from autoddp.core.errors import (
    AutoDDPError,
    AutoDDPWarning,
    CollectiveInRank0Error,
    ConfigurationError,
    MemoryPlanError,
    Rank0Error,
    RemoteError,
    SerializationError,
    UnevenBatchesError,
    WorkerError,
)
from autoddp.decorator import distributed
from autoddp.in_rank._prepare import prepare
from autoddp.in_rank.checkpoint.files import load, save
from autoddp.in_rank.console import print as print  # public, but kept out of __all__ (see below)
from autoddp.in_rank.console import progress
from autoddp.in_rank.data.gather import gather
from autoddp.in_rank.models import unwrap
from autoddp.in_rank.rank_zero.block import rank0
from autoddp.in_rank.world import barrier, device, is_main, local_rank, rank, world_size

__version__ = "0.1.0"  # a literal: setup.cfg reads it without importing the package

# autoddp.print is public but left out of __all__: `from autoddp import *` must not replace print.

__all__ = [
    "AutoDDPError",
    "AutoDDPWarning",
    "CollectiveInRank0Error",
    "ConfigurationError",
    "MemoryPlanError",
    "Rank0Error",
    "RemoteError",
    "SerializationError",
    "UnevenBatchesError",
    "WorkerError",
    "barrier",
    "device",
    "distributed",
    "gather",
    "is_main",
    "load",
    "local_rank",
    "prepare",
    "progress",
    "rank",
    "rank0",
    "save",
    "unwrap",
    "world_size",
]
