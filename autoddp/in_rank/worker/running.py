"""Running the user's function in a joined world: the one call path of every decorated call.

``run_in_world`` joins the world's process group, prepares the arguments, calls the function
and finishes its result while still inside the world (``prepare`` for a caller in the same
process, ``portable`` for a result that travels back to the caller); then the group is left.
The decorator's in-place path, its one-process path and every worker go through it; in a world
of several processes the call runs under ``autoddp.in_rank.capture`` (unless the run turned it off) and,
in a worker an autoddp launcher watches, with the hang report's marks (``autoddp.in_rank.hang.marks``)
and the step report's clock (``autoddp.in_rank.step_report``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing
from collections.abc import Callable
from typing import Any

import torch

from autoddp.core import _containers, _warn, backends
from autoddp.core.state import CURRENT, RunOptions, World
from autoddp.in_rank import models, step_report
from autoddp.in_rank._prepare import prepare, prepare_call
from autoddp.in_rank.hang import marks
from autoddp.in_rank.run_folder import finished
from autoddp.in_rank.world import process_group, streams
from autoddp.in_rank.world.kept_groups import KeptGroups


@dataclasses.dataclass
class Job:
    """A call of the user's function and how its world is set up."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    backend: backends.Backend
    timeout: datetime.timedelta | None
    options: RunOptions
    #: The caller's random states, when workers are started for the call (see ``streams``).
    streams: streams.Streams | None = None
    #: The caller's ``multiprocessing`` start method (None: not chosen yet), given to its workers.
    start_method: str | None = None
    #: The caller's warning filters, given to workers started as fresh interpreters (``_warn``).
    warning_filters: list | None = None

    @property
    def fn_name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def leaving(self) -> None:
        """Before workers are started for the call: the caller's random streams (its states too
        with ``split_batches``), ``multiprocessing`` start method and warning filters go with it."""
        self.streams = streams.of_caller(keep=self.options.split_batches)
        self.start_method = multiprocessing.get_start_method(allow_none=True)
        self.warning_filters = _warn.filters_to_carry()


def run_in_place(job: Job, world: World) -> Any:
    """Call ``job`` in this process, in ``world`` (a launcher's, or one process's): the result is
    the caller's own (``prepare``: models and loaders ready for this process)."""
    return run_in_world(job, world, finish=prepare)


def run_in_world(job: Job, world: World, finish: Callable[[Any], Any]) -> Any:
    """Call ``job`` in ``world``: join, prepare the arguments, call, ``finish`` the result, leave.

    ``finish`` runs on every rank while the group still exists, so it may use collectives (a
    sharded model is gathered there).
    """
    kept = KeptGroups()  # the groups of the function's own DDP models, dropped after the group ends
    with contextlib.ExitStack() as stack:
        stack.callback(kept.release)
        stack.enter_context(process_group.joined(world, job.backend, job.timeout, job.options))
        previous, CURRENT.function = CURRENT.function, _where(job.fn)
        outer_seeds = CURRENT.seeds  # a nested call in place keeps the outer call's seeds
        if job.streams is not None:
            CURRENT.seeds = (streams.seed_worker(job.streams, world.rank), job.streams.torch_initial_seed)
        try:
            if world.world_size <= 1:
                stack.enter_context(models.no_sync_at_one_process())  # (a no-op where nothing syncs)
            here = CURRENT.world or world
            with marks.marking(here), step_report.measuring(here):  # (in workers of autoddp's launcher)
                args, kwargs, made_before = prepare_call(job.fn, job.args, job.kwargs)
                with _capturing(job.options, CURRENT.world or world, made_before):
                    if world.world_size > 1:
                        kept.install()
                    try:
                        with models.recovering():
                            result = job.fn(*args, **kwargs)
                    finally:
                        kept.uninstall()
                del args, kwargs
            if world.world_size > 1:
                finished.mark_finished(world.rank)  # (peers still in a collective are told why)
            return finish(result)
        finally:
            CURRENT.function = previous
            CURRENT.seeds = outer_seeds


def _capturing(
    options: RunOptions, world: World, made_before: list[tuple[Any, Any]]
) -> contextlib.AbstractContextManager[None]:
    """Capture for the call in a world of several processes (loaded only there); its notice names
    the models that optimizers made before the call train (``made_before``, wrapped already)."""
    if world.world_size <= 1 or not options.capture:
        return contextlib.nullcontext()
    from autoddp.in_rank import capture

    return capture.capturing(options, world, made_before)


def _where(fn: Callable[..., Any]) -> tuple[str, int] | None:
    """(file, first line) of the user's function, for warnings raised where none of its lines is."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return (code.co_filename, code.co_firstlineno) if code is not None else None


def portable(value: Any) -> Any:
    """``value`` fit for another process: tensors detached on the CPU, models plain on the CPU.

    Only rank 0's result travels, so only rank 0 copies anything to host memory; every other
    rank takes part in the collectives that rank 0's copy needs (a sharded model or tensor is
    gathered whole, in the same order on every rank) and keeps nothing: its own value comes back
    unchanged. Every rank calls this.
    """
    world = CURRENT.world
    return _portable(value, keep=world is None or world.rank == 0)


def _portable(value: Any, keep: bool) -> Any:
    if isinstance(value, torch.Tensor):
        gathered = models.full_tensors(value.detach(), to_host=keep)
        return gathered.cpu() if keep else value
    if isinstance(value, torch.nn.Module):
        return models.portable(value, keep=keep)
    return _containers.map_items(value, lambda item: _portable(item, keep))
