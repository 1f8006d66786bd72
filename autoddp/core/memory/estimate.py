"""The bytes one process holds for a model's training step under each plan: ``ddp`` and ``fsdp``.

The parts (``Estimate``):

- ``params``: the parameters, each once (tied weights are one parameter); frozen ones too.
- ``grads``: the gradients of the trainable ones. Under DDP with ``gradient_as_bucket_view=True``
  (autoddp's default) the gradients ARE views into DDP's communication buckets: one copy; without
  it DDP's buckets are a second copy. They stay allocated between steps (DDP keeps its buckets).
- ``optimizer``: the state of the optimizer actually made (``optimizers``).
- ``gathered`` (FSDP only): the parameters gathered whole while a block computes: the root's own
  parameters (those in no block, gathered for the whole step), and the largest block twice (the
  one computing and the next, prefetched).
- ``activations``: what one forward of the batch keeps for its backward, and the output, measured
  on a meta-device copy (``activations``).
- ``transient``: what the step allocates for a moment beyond all of the above, at its peak: in
  the backward, the gradient of the largest activation flowing in and out (2 x the largest saved
  tensor) and one parameter's fresh gradient before it is added to its bucket (the largest
  parameter, under FSDP a block's unsharded gradients); in ``optimizer.step()``, its temporaries
  (``optimizers.step_temporaries``), at a moment when the activations are gone.

Under FSDP over N processes, parameters, gradients and optimizer state are sharded (each /N,
rounded up: FSDP pads each parameter to a multiple of N along its first dimension).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoddp.core.memory import activations as activations_
from autoddp.core.memory import optimizers
from autoddp.core.memory.sizes import format_bytes

PLANS = ("ddp", "fsdp")


@dataclass(frozen=True)
class Estimate:
    """The bytes one process holds at the peak of a training step, by part (module docstring)."""

    plan: str
    processes: int
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    transient: int
    #: How parts were taken where they were not measured or counted (the fallback rules), else empty.
    notes: tuple[str, ...] = ()

    @property
    def state(self) -> int:
        """The model's state: parameters, gradients, optimizer state (held between steps)."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """The peak of one step: the state, the gathered blocks, the activations and the transient."""
        return self.state + self.gathered + self.activations + self.transient

    def describe(self) -> str:
        """One line for a notice: ``"ddp: 1.6 GiB (state 1.2 GiB, activations 300.0 MiB, ...)"``."""
        parts = [("parameters", self.params), ("gradients", self.grads), ("optimizer", self.optimizer)]
        if self.plan == "fsdp":
            parts.append(("gathered", self.gathered))
        parts += [("activations", self.activations), ("transient", self.transient)]
        where = f" over {self.processes}" if self.plan == "fsdp" else ""
        inner = ", ".join(f"{name} {format_bytes(value)}" for name, value in parts)
        return f"{self.plan}{where}: {format_bytes(self.total)} per process ({inner})"


def estimate(
    module: torch.nn.Module,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    optimizer: torch.optim.Optimizer | type | None = None,
    optimizer_kwargs: Mapping[str, Any] | None = None,
    plan: str = "ddp",
    processes: int = 1,
    units: Sequence[torch.nn.Module] | None = None,
    device_type: str = "cpu",
    bucket_view: bool = True,
    measured: activations_.Activations | None = None,
) -> Estimate:
    """The bytes one process holds for one training step of ``module`` on the batch ``args``/``kwargs``
    (this process's batch), with ``optimizer`` (an instance, or a class with ``optimizer_kwargs``).

    ``plan``: "ddp", or "fsdp" over ``processes`` with ``units`` the blocks that get their own
    ``fully_shard`` (the caller's choice, as ``in_rank.models.fsdp.units`` makes it; None: the
    root's children that hold parameters). ``device_type``: where the parameters will live
    (it decides torch's optimizer implementation). ``bucket_view``: DDP's
    ``gradient_as_bucket_view``. ``measured``: activations measured already (one meta forward
    serves every plan).
    """
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r}: one of {', '.join(PLANS)}")
    if processes < 1:
        raise ValueError(f"processes={processes}: 1 or more")
    params = list(module.parameters())  # each Parameter once: tied weights count once
    cls, groups = optimizers.groups_of(optimizer, params, optimizer_kwargs)
    state, state_note = optimizers.state_bytes(cls, groups)
    acts = measured if measured is not None else activations_.measure(module, tuple(args), dict(kwargs or {}))
    params_bytes = _nbytes(params)
    trainable = _nbytes(p for p in params if p.requires_grad)
    largest = max((_nbytes([p]) for p in params if p.requires_grad), default=0)
    temporaries = optimizers.step_temporaries(cls, groups, device_type)
    notes = tuple(note for note in (state_note, acts.note) if note)
    if plan == "ddp":
        backward = 2 * acts.largest + largest
        return Estimate(
            plan="ddp",
            processes=processes,
            params=params_bytes,
            grads=trainable * (1 if bucket_view else 2),
            optimizer=state,
            gathered=0,
            activations=acts.saved,
            transient=max(backward, temporaries - acts.saved, 0),
            notes=notes,
        )
    rest, block = _gathered(module, units)
    backward = 2 * acts.largest + block
    return Estimate(
        plan="fsdp",
        processes=processes,
        params=_sharded(params, processes),
        grads=_sharded([p for p in params if p.requires_grad], processes),
        optimizer=math.ceil(state / processes),
        gathered=rest + 2 * block,
        activations=acts.saved,
        transient=max(backward, math.ceil(temporaries / processes) - acts.saved, 0),
        notes=notes,
    )


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sharded(params: Sequence[torch.Tensor], processes: int) -> int:
    """One process's share: each parameter padded to a multiple of ``processes`` along dim 0."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // rows if rows else 0
        total += math.ceil(rows / processes) * per_row * p.element_size()
    return total


def _gathered(module: torch.nn.Module, units: Sequence[torch.nn.Module] | None) -> tuple[int, int]:
    """The root's own parameters' bytes (in no unit) and the largest unit's, each parameter once."""
    if units is None:
        units = [child for child in module.children() if any(True for _ in child.parameters())]
    in_units: set[int] = set()
    largest = 0
    for unit in units:
        own = [p for p in unit.parameters() if id(p) not in in_units]
        in_units.update(id(p) for p in own)
        largest = max(largest, _nbytes(own))
    rest = _nbytes(p for p in module.parameters() if id(p) not in in_units)
    return rest, largest
