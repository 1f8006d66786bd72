"""``strategy="auto"`` weighs the first training steps, activations included, against the budget.

The plan was chosen from the state's bytes before any batch was seen (``_plan``); each optimizer's
first ``step()`` then weighs the peak of the steps so far. Over the budget, the rank raises
``MemoryPlanError`` naming the next plan, which the launcher restarts every rank with, once.

- **On a GPU** torch's allocator counts it: ``torch.cuda.max_memory_allocated``, reset once the
  model is wrapped and again once its optimizer is made (the whole model the script moved there
  before it was sharded, and the parameters sharding replaced, are no step's).
- **On the CPU** nothing counts what torch allocates, so the process's resident peak stands in
  for it (``core.memory.resident``), reset at the same points, plus the state resident then (the
  parameters, buffers and DDP's gradient buckets). ``CPU_RUNTIME`` more is allowed: the runtime's
  own growth at a first step. (Not from the first forward: a hook of every module's forward, even
  for one step, makes a ``torch.compile`` made after the optimizer compile its forward twice.)

Past the last plan, or after a restart for memory already, a step over the budget is said, not
raised: the check foresees, and memory the script made after the optimizer (a dataset) counts
as the step's, which no plan would shrink; a real out-of-memory error still ends the run.
Not weighed where the plan taken did not fit the state (no plan would help: the warning said so).
The error says "went over", not "ran out of memory": nothing ran out, and a script that skips a
batch on "out of memory" must not swallow it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from autoddp.core import _warn
from autoddp.core.memory import budget as budget_
from autoddp.core.memory import resident
from autoddp.core.memory.sizes import format_bytes
from autoddp.core.state import CURRENT, Planned, World
from autoddp.in_rank.models import _plan

#: Where a CPU's first steps held their peak (``first_step_exceeds``).
_RESIDENT = "of the process's memory (its resident peak from the optimizer on, with the state)"
_DEVICE = "on the device (torch.cuda.max_memory_allocated)"


def measured_from_here(world: World) -> None:
    """After a model was wrapped under a plan "auto" took, and again once its optimizer is made
    (the parameters sharding replaced let go of): the first steps' peak counts from here (on the
    CPU, where the resident peak cannot be reset, no Linux: nothing is weighed)."""
    planned = CURRENT.planned
    if planned is None or not planned.taken or planned.weighed or planned.overcommitted:
        return
    if world.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(world.device)
    else:
        if not resident.reset_peak():
            return
        planned.resident_from = resident.resident()
        planned.held = sum(_held(model) for model in CURRENT.wrapped_models())
    if planned.watch is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        check = functools.partial(_after_step, planned, world.device)
        planned.watch = register_optimizer_step_post_hook(check)  # (removed with the world)


def _held(module: torch.nn.Module) -> int:
    """The bytes of ``module``'s state this process holds now: its parameters and buffers (its own
    shards, where sharded) and DDP's gradient buckets (made with the DDP, before any backward)."""
    from autoddp.in_rank.models import ddp

    def local(tensor: torch.Tensor) -> int:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # (a DTensor's shard)
        return tensor.numel() * tensor.element_size()

    held = sum(local(t) for t in (*module.parameters(), *module.buffers()))
    if ddp.ddp_of(module) is not None:
        held += sum(local(p) for p in module.parameters() if p.requires_grad)
    return held


def _after_step(planned: Planned, device: str, optimizer: Any, *_: Any) -> None:
    """An optimizer stepped: at its first step, the peak of the steps so far weighed (several
    optimizers, a GAN's: each one's first step, whichever steps first); over the budget, the next
    plan. (Hooks are not removed here: torch is iterating over them.)"""
    if id(optimizer) in planned.weighed or CURRENT.planned is not planned:
        return
    planned.weighed.add(id(optimizer))
    if device.startswith("cuda"):
        error = first_step_exceeds(planned, torch.cuda.max_memory_allocated(device))
    else:
        now, since = resident.peak(), planned.resident_from
        if now is None or since is None:
            return
        peak = now - since + planned.held
        error = first_step_exceeds(planned, peak, where=_RESIDENT, allowance=budget_.CPU_RUNTIME)
    if error is not None and error.next_plan is None:  # (said once: the next steps are not weighed)
        _warn.warn(f"{error}; going on: a real out-of-memory error would end the run")
    elif error is not None:
        raise error


def first_step_exceeds(planned: Planned, peak: int, where: str = _DEVICE, allowance: int = 0) -> Any:
    """The ``MemoryPlanError`` first steps whose peak (``peak`` bytes, activations included) is over
    the budget by more than ``allowance`` raise (it names the next plan), or None where they fit."""
    if peak <= planned.budget + allowance:
        return None
    return _plan.out_of_memory(
        planned, f"its first step held {format_bytes(peak)} {where}", happened="went over its memory budget"
    )
