"""``strategy="auto"``: the strategy a model gets, from its state's bytes and the memory a process
may use (``device_memory``), the same on every rank.

When a model is wrapped (its optimizer is made, or ``autoddp.prepare``), the bytes of its state
(parameters, gradients in DDP's buckets, the optimizer's state for the optimizer being made) are
weighed under each plan of ``core.memory.budget.LADDER``: DDP, FSDP2 over its blocks, FSDP2 with
its blocks' activations recomputed in the backward pass (checkpointing: the state of FSDP's, the
plan after an out-of-memory error under it), FSDP2 with the shards on the CPU (GPUs only). The
cheapest that fits what is left of the budget is taken. A model that fits under DDP always gets
DDP. One all-reduce per decision makes every rank weigh the
least budget and the largest needs of any rank, so no rank can take another plan. Activations are
not known yet at that point (no batch has been seen): the plan fits the state, and the notice
says so.

The first steps' peak is weighed against the budget too (``_first_step``). Over it,
or out of memory under a plan taken here (torch's ``OutOfMemoryError`` or its CPU allocator's
refusal reaching the end of the user's code, ``recovering``), the rank raises ``MemoryPlanError``
naming the next plan; autoddp's launcher on one machine starts
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
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from autoddp.core import _compat, _variables, _warn
from autoddp.core._compat.memory_errors import cpu_out_of_memory
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
    planned = CURRENT.planned
    if planned is None:
        planned = CURRENT.planned = Planned()
    from autoddp.in_rank.models import fsdp

    fsdp_here = _fsdp_here(fsdp, world)
    forced = _forced(module, world, options, training, fsdp if fsdp_here else None)
    if forced is not None:
        strategy, why = forced
        planned.sharded = planned.sharded or strategy == "fsdp"
        if why:
            _keep_note(planned, module, f"auto: {strategy.upper()}, {why}")
        return dataclasses.replace(options, strategy=strategy)
    allowed = ["ddp"] + (["fsdp", "fsdp with activation checkpointing"] if fsdp_here else [])
    allowed += ["fsdp with CPU offload"] if fsdp_here and world.device != "cpu" else []
    units = fsdp.units(module) if fsdp_here else None
    needs, notes = _needs(module, allowed, world.world_size, units, training)
    left = planned.budget - planned.placed if planned.budget is not None else _budget(world, options)
    left, needs = _agreed(world, max(left, 0), needs)
    if planned.budget is None:
        planned.budget, planned.ladder = left, tuple(allowed)
    floor = os.environ.get(_variables.PLAN_FLOOR)  # (set by the launcher: a restart for memory)
    above = allowed[allowed.index(floor) :] if floor in allowed else allowed
    choice = budget_.choose(needs, left, above)
    planned.placed += needs[choice.name]
    planned.sharded = planned.sharded or choice.strategy == "fsdp"
    planned.taken.append(choice.name)
    restarted = f" (restarted at {floor}: the last run needed more memory)" if floor in allowed else ""
    _keep_note(planned, module, f"auto{restarted}: {choice.describe()}{notes}")
    if not choice.fits:
        planned.overcommitted = True  # (no first-step check: no plan would fit; the warning says so)
        _warn.warn(
            f"{_name(module)}'s state needs {format_bytes(needs[choice.name])} per process under the "
            f"plan that needs the fewest bytes ({choice.name}), more than the {format_bytes(left)} this "
            "process may use (device_memory): it may run out of memory. Start more processes, or pass "
            "a larger device_memory= (--device-memory) if the device has more to give"
        )
    return dataclasses.replace(
        options,
        strategy=choice.strategy,
        cpu_offload=choice.cpu_offload,
        checkpoint_blocks=choice.checkpoint_blocks,
    )


def room(world: World, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes a process has left beyond the state of the models placed so far, the same on
    every rank: what gradient accumulation under FSDP may keep unsharded (``_deferral``). Where
    "auto" weighed them, what its budget leaves; else the default budget less ``module``'s sharded
    state with ``optimizer``, agreed by one all-reduce (every rank calls this in the same order)."""
    planned = CURRENT.planned
    if planned is not None and planned.budget is not None:
        return max(planned.budget - planned.placed, 0)
    from autoddp.in_rank.models import fsdp

    units = [m for m in module.modules() if m is not module and isinstance(m, fsdp.fsdp_api().FSDPModule)]
    weighed = estimate.state_only(
        module, optimizer=optimizer, plan="fsdp", processes=world.world_size, units=units
    )
    left, _ = _agreed(world, max(_budget(world, CURRENT.options) - weighed.total, 0), {})
    return left


def _keep_note(planned: Planned, module: torch.nn.Module, said: str) -> None:
    """``said`` for the notice, under the model (and the module a ``torch.compile`` result holds)."""
    planned.notes[module] = said
    compiled = _compat.compiled_parts(module)
    if compiled is not None:
        planned.notes[compiled[0]] = said


def _name(module: torch.nn.Module) -> str:
    compiled = _compat.compiled_parts(module)
    return type(compiled[0] if compiled is not None else module).__name__


@contextlib.contextmanager
def recovering() -> Iterator[None]:
    """Around the user's code in a world: an out-of-memory error under a plan ``strategy="auto"``
    took becomes a ``MemoryPlanError`` naming the next plan, which the launcher restarts every
    rank with, once (none after a restart for memory, or past the last plan: the numbers only):
    torch's ``OutOfMemoryError`` on a GPU, its CPU allocator's refusal on the CPU
    (``_compat.memory_errors``)."""
    try:
        yield
    except RuntimeError as error:  # (torch.cuda.OutOfMemoryError is one)
        planned = CURRENT.planned
        memory = isinstance(error, torch.cuda.OutOfMemoryError) or cpu_out_of_memory(error)
        if not memory or planned is None or not planned.taken:
            raise
        raise out_of_memory(planned, _first_line(error)) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def out_of_memory(planned: Planned, what: str, happened: str = "ran out of memory") -> MemoryPlanError:
    """The ``MemoryPlanError`` of a process that ``happened`` (ran out of memory, or went over its
    budget: ``_first_step``) under the plans taken, naming the next plan or, past the last, the fix."""
    highest = max(planned.ladder.index(name) for name in planned.taken)
    restarted = os.environ.get(_variables.PLAN_FLOOR) in planned.ladder
    following = planned.ladder[highest + 1 :]
    next_plan = following[0] if following and not restarted else None
    plan = planned.ladder[highest]
    said = (
        f"{happened} under the plan strategy='auto' took ({plan}; "
        f"{format_bytes(planned.placed)} of state per process, {format_bytes(planned.budget)} "
        f"allowed): {what}"
    )
    if next_plan is not None:
        return MemoryPlanError(
            f"{said}; the next plan is {next_plan} ({_forcing(next_plan)} takes it)",
            plan=plan,
            next_plan=next_plan,
        )
    why = "after a restart for memory already" if restarted else "and no larger plan is left here"
    fix = "start more processes or train on smaller batches"
    if planned.ladder[-1] != plan:  # (restarted at a plan short of the last: force the last)
        fix += f", or force the plan that shards most here ({_forcing(planned.ladder[-1])})"
    return MemoryPlanError(
        f"{said}, {why}: {fix}",
        plan=plan,
        next_plan=None,
    )


def _forcing(name: str) -> str:
    """How the user forces the plan called ``name`` (checkpointing alone has no option)."""
    rung = budget_.rung(name)
    if rung.checkpoint_blocks and not rung.cpu_offload:
        return "strategy='fsdp' with torch.utils.checkpoint in the blocks' forward"
    return f"strategy={rung.strategy!r}" + (", cpu_offload=True" if rung.cpu_offload else "")


def note(module: torch.nn.Module) -> str:
    """Why ``module`` got its plan (``"; auto: state ..."``), or "" where it was not weighed."""
    planned = CURRENT.planned
    said = planned.notes.get(module) if planned is not None else None
    return f"; {said}" if said else ""


def _forced(
    module: torch.nn.Module, world: World, options: RunOptions, training: Training | None, fsdp: Any
) -> tuple[str, str | None] | None:
    """The strategy taken without weighing and why (None: nothing to say), or None to weigh
    (module docstring). ``fsdp``: the FSDP strategy, where this torch has FSDP2 for the device."""
    if options.fsdp_blocks or options.mixed_precision is not None or options.cpu_offload:
        return "fsdp", "as FSDP's options (fsdp_blocks, mixed_precision, cpu_offload) ask"
    if world.world_size == 1:
        return "ddp", None
    if options.split_batches:
        return "ddp", "as split_batches needs"
    params = list(module.parameters())
    if not any(p.requires_grad for p in params):
        return "ddp", None
    if any(torch.nn.parameter.is_lazy(p) for p in params):
        return "ddp", "not weighed: lazy parameters have their sizes only at the first forward"
    if fsdp is None:
        return None
    if _compat.compiled_parts(module) is not None:
        return "ddp", (
            "not weighed: a torch.compile result sharded before its first call trains to other "
            "weights than one process; make the optimizer before torch.compile (nanoGPT's order) "
            "to have autoddp weigh it"
        )
    if training is not None and issubclass(training[0], torch.optim.LBFGS):
        return "ddp", "not weighed: LBFGS's flat views of the parameters cannot be sharded"
    if _shared_across_units(module, fsdp.units(module)):
        return "ddp", "not weighed: a parameter shared by two of its blocks cannot be sharded by FSDP2"
    return None


def _shared_across_units(module: torch.nn.Module, units: Sequence[torch.nn.Module]) -> bool:
    """Whether a parameter belongs to two of the groups FSDP2 would make: each unit's own, the root's."""
    unit_ids = {id(unit) for unit in units}
    groups: dict[int, set[int]] = {}

    def walk(sub: torch.nn.Module, group: int) -> None:
        group = id(sub) if id(sub) in unit_ids else group
        for param in sub.parameters(recurse=False):
            groups.setdefault(id(param), set()).add(group)
        for child in sub.children():
            walk(child, group)

    walk(module, id(module))
    return any(len(owners) > 1 for owners in groups.values())


def left_on(world: World, options: RunOptions, device: torch.device, placed: int = 0) -> int | None:
    """The bytes this process may still use on its GPU ``device``, before any agreement: what the
    plans so far left of the budget, else ``device_memory`` (or the GPU's default budget where the
    run computes on GPUs) less what is there already (``placed``: moved there by the user's code;
    on a GPU, what torch's allocator holds, if more). None where the run computes on the CPU beside
    GPUs: no GPU budget."""
    planned = CURRENT.planned
    if planned is not None and planned.budget is not None:
        return max(planned.budget - planned.placed, 0)
    on_gpus = world.device.startswith("cuda")
    if options.device_memory is not None:
        budget = options.device_memory
    elif on_gpus:
        free, total = torch.cuda.mem_get_info(device)
        budget = budget_.gpu_default(free, torch.cuda.memory_reserved(device), total)
    else:
        return None
    held = torch.cuda.memory_allocated(device) if on_gpus else 0
    return max(budget - max(placed, held), 0)


def can_shard(world: World) -> bool:
    """True where this torch has FSDP2 for the world's device."""
    from autoddp.in_rank.models import fsdp

    return _fsdp_here(fsdp, world)


def _fsdp_here(fsdp: Any, world: World) -> bool:
    try:
        fsdp.fsdp_api(torch.device(world.device).type)
    except Exception:  # ConfigurationError: this torch has no FSDP2 for this device
        return False
    return True


def _needs(
    module: torch.nn.Module, plans: Sequence[str], processes: int, units: Any, training: Training | None
) -> tuple[dict[str, int], str]:
    """Bytes one process holds of ``module``'s state under each plan, and the estimate's notes
    ("; ..." for the notice: an optimizer whose state was taken by rule)."""
    from autoddp.in_rank.models import ddp

    bucket_view = bool(ddp.DEFAULTS.get("gradient_as_bucket_view", False))
    needs, notes = {}, set()
    for name in plans:
        weighed = estimate.state_only(
            module,
            optimizer=training,
            plan="ddp" if name == "ddp" else "fsdp",
            processes=processes,
            units=units,
            bucket_view=bucket_view,
            offload=name.endswith("offload"),
        )
        needs[name] = weighed.total
        notes.update(weighed.notes)
    return needs, "".join(f"; {note}" for note in sorted(notes))


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

    most = 2**62  # (the tensor's int64; no device holds more)
    values = torch.tensor(
        [min(left, most), *(-min(need, most) for need in needs.values())], dtype=torch.int64
    )
    if dist.is_available() and dist.is_initialized() and world.world_size > 1:
        device = world.device if world.device.startswith("cuda") else "cpu"
        values = values.to(device)
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
        values = values.cpu()
    agreed = values.tolist()
    return agreed[0], {name: -value for name, value in zip(needs, agreed[1:], strict=True)}
