"""The one door of every launch: where a function call or a script runs, decided once for both.

``run(request, target)`` is what the decorator and the command call. ``way`` says where the
target runs: in place (this process is already one of a launched world's, or a function's call
asks for one process), this node's share of a run on several machines (elastic's agent,
``launch.nodes``), or workers started on this machine (``launch.local``). The launch machinery
loads only when a launch needs it.
"""

from __future__ import annotations

from typing import Any

from autoddp.core import _warn, environment
from autoddp.core.environment import hardware
from autoddp.in_rank.worker.running import Job, run_in_place
from autoddp.launch.request import Request, Script, Target

IN_PLACE = "in place"
NODE_SHARE = "this node's share"
WORKERS = "workers"


def way(request: Request, target: Target) -> str:
    """Where ``target`` runs for ``request``: ``IN_PLACE``, ``NODE_SHARE`` or ``WORKERS``."""
    return _way(request, target)[0]


def _way(request: Request, target: Target) -> tuple[str, environment.Environment | None]:
    """Where ``target`` runs, and the environment detected for it (None where not needed)."""
    if request.nodes.multi and isinstance(target, Script):
        # one command per machine is this node's share even inside a launched world (under srun,
        # as torchrun is there); a function called inside a world runs in place in it
        return NODE_SHARE, None
    env = environment.detect()
    if env.launched:
        return IN_PLACE, env
    if request.nodes.multi:
        return NODE_SHARE, env
    if isinstance(target, Job) and _processes(request, target) == 1:
        return IN_PLACE, env  # one process: no worker to start
    return WORKERS, env


def run(request: Request, target: Target) -> Any:
    """Run ``target`` as ``request`` asks: a function's result (rank 0's; None on another node);
    a script returns None when all its processes succeeded (in place, this process becomes it).
    A failure is raised as the original exception of the rank that failed first."""
    chosen, env = _way(request, target)
    if chosen == IN_PLACE:
        assert env is not None
        return _in_place(request, target, env)
    nproc = _processes(request, target)
    if isinstance(target, Job):
        target.leaving()
    if chosen == NODE_SHARE:
        from autoddp.launch import nodes  # (the launch machinery loads when it is first needed)

        launcher = nodes.run_function if isinstance(target, Job) else nodes.run_script
    else:
        from autoddp.launch import local

        launcher = local.run_function if isinstance(target, Job) else local.run_script
    return launcher(target, nproc, request)  # type: ignore[arg-type]


def _processes(request: Request, target: Target) -> int:
    """The processes started on this machine (a function's: one per GPU by default)."""
    if isinstance(target, Job):
        return request.processes(target.backend, hardware.gpu_count())
    return request.nproc or 1


def _in_place(request: Request, target: Target, env: environment.Environment) -> Any:
    """``target`` in this process: a function's call in the launched world (or one process's), a
    script exec'd with torchrun's variables for the world (never returns)."""
    world = env.world()
    if isinstance(target, Script):
        from autoddp.launch import in_place

        in_place.exec_script(list(target.argv), world)
    if env.launched and request.nproc is not None and request.nproc != world.local_world_size:
        _warn.warn(
            f"{getattr(target.fn, '__qualname__', target.fn)}() asks for nproc={request.nproc} but runs "
            f"inside an existing world ({env.name}, {world.world_size} processes): it runs in place "
            "there, without starting new processes."
        )
    return run_in_place(target, world)
