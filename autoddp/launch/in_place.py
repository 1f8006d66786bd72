"""The ``autoddp`` command inside a launched world (srun, mpirun, torchrun): the script runs in place.

No second layer of workers: this process becomes the script (``python -m autoddp.in_rank.worker.script``),
with torchrun's variables set from the world the launcher describes, so a torchrun-style script
(``dist.init_process_group("gloo")``, which reads ``env://``) runs unchanged under ``srun`` and
``mpirun``, which set none of them. In a world that spans machines the network interface that
reaches rank 0 is named too (``autoddp.core.environment.network``), unless the user named one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import NoReturn

from autoddp.core._warn import say
from autoddp.core.environment import network
from autoddp.core.state import World


def script_environment(world: World, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with torchrun's variables for ``world`` (the launcher's world wins over stale copies)."""
    env = dict(environ)
    env.update(
        RANK=str(world.rank),
        LOCAL_RANK=str(world.local_rank),
        WORLD_SIZE=str(world.world_size),
        LOCAL_WORLD_SIZE=str(world.local_world_size),
        GROUP_RANK=str(world.node_rank),
    )
    if world.master_addr:
        env["MASTER_ADDR"] = world.master_addr
    if world.master_port:
        env["MASTER_PORT"] = str(world.master_port)
    if world.master_addr and world.local_world_size < world.world_size:
        choice = network.choose(world.master_addr, environ)
        env.update(choice.variables)
        if choice.variables and world.local_rank == 0:
            say(f"node {world.node_rank}: {choice.summary}")
    return env


def exec_script(argv: list[str], world: World) -> NoReturn:
    """Become ``python -m autoddp.in_rank.worker.script ARGV`` in ``world`` (never returns)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    command = [sys.executable, "-m", "autoddp.in_rank.worker.script", *argv]
    os.execve(sys.executable, command, script_environment(world, os.environ))
