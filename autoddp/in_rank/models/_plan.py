"""``strategy="auto"``: the strategy a model gets, from its state's bytes and the memory a process
may use (``device_memory``), the same on every rank.

When a model is wrapped (its optimizer is made, or ``autoddp.prepare``), the bytes of its state
(parameters, gradients in DDP's buckets, the optimizer's state for the optimizer being made) are
weighed under each plan of ``core.memory.budget.LADDER``: DDP, FSDP2 over its blocks, FSDP2 with
the shards on the CPU (GPUs only). The cheapest that fits what is left of the budget is taken. A
model that fits under DDP always gets DDP. One all-reduce per decision makes every rank weigh the
least budget and the largest needs of any rank, so no rank can take another plan. Activations are
not known yet at that point (no batch has been seen): the plan fits the state, and the notice
says so.

On a GPU the first optimizer step's peak, counted from the wrap (``measured_from_here``), is
weighed against the budget too (``first_step_exceeds``). Over it, or out of memory under a plan
taken here (torch's ``OutOfMemoryError`` reaching the end of the user's code, ``recovering``),
the rank raises ``MemoryPlanError`` naming the next plan; autoddp's launcher on one machine starts
every rank again once, with ``AUTODDP_PLAN_FLOOR`` set to it, and this module then starts the
ladder there.

Forced without weighing: one process (nothing to shard), FSDP's own options given (``fsdp_blocks``,
``mixed_precision``, ``cpu_offload``: FSDP), ``split_batches`` (DDP only), a model without
trainable parameters or with lazy ones (sizes unknown until the first forward), a torch without
FSDP2 for this device (DDP; a warning where it does not fit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from autoddp.core import _variables, _warn
from autoddp.core.errors import MemoryPlanError
from autoddp.core.memory import budget as budget_
from autoddp.core.memory import estimate
from autoddp.core.memory.optimizers import Group
from autoddp.core.memory.sizes import format_bytes
from autoddp.core.state import CURRENT, Planned, RunOptions, World

AUTO = "auto"

#: (class, groups) of the optimizer a model's state is weighed with (``core.memory.optimizers``).
Training = tuple[type, Sequence[Group]]


def resolve(
    module: torch.nn.Module, world: World, options: RunOptions, training: Training | None
) -> RunOptions:
    """``options`` with the strategy ``module`` is wrapped with: the run's own where it names one,
    else the plan ``strategy="auto"`` takes (every rank calls this, in the same order: it may
    all-reduce). The reason is kept for the notice (``note``)."""
    if options.strategy != AUTO:
        return options
    forced = _forced(module, world, options)
    if forced is not None:
        return dataclasses.replace(options, strategy=forced)
    from autoddp.in_rank.models import fsdp

    allowed = ["ddp"]
    if _fsdp_here(fsdp, world):
        allowed += ["fsdp"] + ([] if world.device == "cpu" else ["fsdp with CPU offload"])
    units = fsdp.units(module) if len(allowed) > 1 else None
    needs = {name: _need(module, name, world.world_size, units, training) for name in allowed}
    planned = CURRENT.planned
    left = (planned.budget - planned.placed) if planned is not None else _budget(world, options)
    left, needs = _agreed(world, left, needs)
    if planned is None:
        planned = CURRENT.planned = Planned(budget=left, ladder=tuple(allowed))
    floor = os.environ.get(_variables.PLAN_FLOOR)  # (set by the launcher: a restart for memory)
    above = allowed[allowed.index(floor) :] if floor in allowed else allowed
    choice = budget_.choose(needs, left, above)
    planned.placed += needs[choice.name]
    planned.sharded = planned.sharded or choice.strategy == "fsdp"
    planned.taken.append(choice.name)
    restarted = f" (restarted at {floor}: the last run ran out of memory)" if floor in allowed else ""
    later = (
        "the first step's peak is weighed too"
        if world.device.startswith("cuda")
        else "activations not counted"
    )
    planned.notes[module] = f"auto{restarted}: {choice.describe()}; {later}"
    if not choice.fits:
        _warn.warn(
            f"{type(module).__name__}'s state needs {format_bytes(needs[choice.name])} per process under "
            f"its smallest plan ({choice.name}), more than the {format_bytes(left)} this process may use "
            "(device_memory): it may run out of memory. Start more processes, or pass a larger "
            "device_memory= (--device-memory) if the device has more to give"
        )
    return dataclasses.replace(options, strategy=choice.strategy, cpu_offload=choice.cpu_offload)


@contextlib.contextmanager
def recovering() -> Iterator[None]:
    """Around the user's code in a world: an out-of-memory error under a plan ``strategy="auto"``
    took becomes a ``MemoryPlanError`` naming the next plan, which the launcher restarts every
    rank with, once (none after a restart for memory, or past the last plan: the numbers only)."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        planned = CURRENT.planned
        if planned is None or not planned.taken:
            raise
        raise _out_of_memory(planned, _first_line(error)) from error


def measured_from_here(world: World) -> None:
    """After a model was wrapped under a plan "auto" took on a GPU: the device's peak counts from
    here (the whole model the script moved there before it was sharded is no step's), and the
    first optimizer step's peak is weighed against the budget (``first_step_exceeds``)."""
    planned = CURRENT.planned
    if planned is None or not planned.taken or not world.device.startswith("cuda"):
        return
    torch.cuda.reset_peak_memory_stats(world.device)
    if planned.watch is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        check = functools.partial(_after_first_step, planned, world.device)
        planned.watch = register_optimizer_step_post_hook(check)


def _after_first_step(planned: Planned, device: str, *_: Any) -> None:
    """The first optimizer step's peak on the GPU, weighed once: over the budget, the next plan."""
    if planned.watch is None:
        return
    planned.watch.remove()
    if CURRENT.planned is planned:
        error = first_step_exceeds(planned, torch.cuda.max_memory_allocated(device))
        if error is not None:
            raise error


def first_step_exceeds(planned: Planned, peak: int) -> MemoryPlanError | None:
    """The error a first step whose device peak (``peak`` bytes, activations included) is over the
    budget raises (it names the next plan), or None where the step fitted."""
    if peak <= planned.budget:
        return None
    return _out_of_memory(
        planned, f"its first step held {format_bytes(peak)} on the device (torch.cuda.max_memory_allocated)"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _out_of_memory(planned: Planned, what: str) -> MemoryPlanError:
    rank = CURRENT.world.rank if CURRENT.world is not None else 0
    highest = max(planned.ladder.index(name) for name in planned.taken)
    restarted = os.environ.get(_variables.PLAN_FLOOR) in planned.ladder
    following = planned.ladder[highest + 1 :]
    next_plan = following[0] if following and not restarted else None
    plan = planned.ladder[highest]
    said = (
        f"rank {rank} ran out of memory under the plan strategy='auto' took ({plan}; "
        f"{format_bytes(planned.placed)} of state per process, {format_bytes(planned.budget)} "
        f"allowed): {what}"
    )
    if next_plan is not None:
        _, strategy, offload = next(rung for rung in budget_.LADDER if rung[0] == next_plan)
        forced = f"strategy={strategy!r}" + (", cpu_offload=True" if offload else "")
        return MemoryPlanError(
            f"{said}; the next plan is {next_plan} ({forced} takes it)", plan=plan, next_plan=next_plan
        )
    why = "after a restart for memory already" if restarted else "and no larger plan is left"
    return MemoryPlanError(
        f"{said}, {why}: start more processes, train on smaller batches, or pass a smaller "
        "device_memory= (--device-memory) so that autoddp shards sooner",
        plan=plan,
        next_plan=None,
    )


def note(module: torch.nn.Module) -> str:
    """Why ``module`` got its plan (``"; auto: state ..."``), or "" where it was not weighed."""
    planned = CURRENT.planned
    said = planned.notes.get(module) if planned is not None else None
    return f"; {said}" if said else ""


def _forced(module: torch.nn.Module, world: World, options: RunOptions) -> str | None:
    """The strategy taken without weighing (module docstring), or None."""
    if options.fsdp_blocks or options.mixed_precision is not None or options.cpu_offload:
        return "fsdp"
    if world.world_size == 1 or options.split_batches:
        return "ddp"
    params = list(module.parameters())
    if not any(p.requires_grad for p in params):
        return "ddp"
    if any(torch.nn.parameter.is_lazy(p) for p in params):  # sizes known at the first forward
        return "ddp"
    return None


def _fsdp_here(fsdp: Any, world: World) -> bool:
    try:
        fsdp.fsdp_api(torch.device(world.device).type)
    except Exception:  # ConfigurationError: this torch has no FSDP2 for this device
        return False
    return True


def _need(module: torch.nn.Module, name: str, processes: int, units: Any, training: Training | None) -> int:
    """Bytes one process holds of ``module``'s state under the plan ``name``."""
    plan = "ddp" if name == "ddp" else "fsdp"
    from autoddp.in_rank.models import ddp

    bucket_view = bool(ddp.DEFAULTS.get("gradient_as_bucket_view", False))
    return estimate.state_only(
        module,
        optimizer=training,
        plan=plan,
        processes=processes,
        units=units,
        bucket_view=bucket_view,
        offload=name.endswith("offload"),
    ).total


def _budget(world: World, options: RunOptions) -> int:
    """This process's budget: ``device_memory``, else the default of ``core.memory.budget``."""
    if options.device_memory is not None:
        return options.device_memory
    if world.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(world.device)
        return budget_.gpu_default(free, torch.cuda.memory_reserved(world.device), total)
    available = budget_.available_memory()
    if available is None:  # not Linux: nothing to weigh against; DDP, as before "auto"
        return 2**62
    return budget_.cpu_default(available, world.local_world_size)


def _agreed(world: World, left: int, needs: dict[str, int]) -> tuple[int, dict[str, int]]:
    """The least budget and the largest needs over every rank (one all-reduce of a few integers)."""
    import torch.distributed as dist

    values = torch.tensor([left, *(-need for need in needs.values())], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and world.world_size > 1:
        device = world.device if world.device.startswith("cuda") else "cpu"
        values = values.to(device)
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
        values = values.cpu()
    agreed = values.tolist()
    return agreed[0], {name: -value for name, value in zip(needs, agreed[1:], strict=True)}
