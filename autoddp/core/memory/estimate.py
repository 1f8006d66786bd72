"""The bytes one process holds for a model's training step under each plan: ``ddp`` and ``fsdp``.

The total (``Estimate.peak``) is the peak of the live bytes of a training step run on fake tensors
(``tracker``: two steps of forward, a usual loss, backward and ``optimizer.step()``, every storage
counted while it lives), which holds the parameters, gradients, optimizer state, activations and
every temporary of the forward, the backward and the step at the moment they peak together. The
parts, for a notice (``Estimate.describe``):

- ``params``: the parameters, each once (tied weights are one parameter); frozen ones too.
- ``grads``: the gradients of the trainable ones. Under DDP with ``gradient_as_bucket_view=True``
  (autoddp's default) the gradients ARE views into DDP's communication buckets: one copy; without
  it DDP's buckets are a second copy (added to the tracked peak). They stay allocated between
  steps (DDP keeps its buckets).
- ``optimizer``: the state of the optimizer actually made (``optimizers``).
- ``gathered`` (FSDP only): the parameters gathered whole while a block computes: the root's own
  parameters (those in no block, gathered for the whole step), and the largest block twice (the
  one computing and the next, prefetched).
- ``activations``: what the forward and the loss keep until the backward, the output included.

Under FSDP over N processes, parameters, gradients and optimizer state are sharded (each /N,
rounded up: FSDP pads each parameter to a multiple of N along its first dimension); its peak is
the sharded state, the gathered blocks, and what the tracked step held beyond the whole state
(activations and temporaries, taken as under DDP: an optimizer's temporaries over a shard are
smaller, so this errs high).

Where the step cannot run on fake tensors (an operation without a fake kernel, a forward that reads
a value back), the peak is taken by rule (``_rule_peak``) and the result says so in ``notes``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoddp.core.memory import activations as activations_
from autoddp.core.memory import optimizers, tracker
from autoddp.core.memory.sizes import format_bytes

PLANS = ("ddp", "fsdp")


@dataclass(frozen=True)
class Estimate:
    """The bytes one process holds at the peak of a training step (``peak``), and its parts
    (module docstring)."""

    plan: str
    processes: int
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    peak: int
    #: How parts were taken where they were not tracked or counted (the fallback rules), else empty.
    notes: tuple[str, ...] = ()

    @property
    def state(self) -> int:
        """The model's state: parameters, gradients, optimizer state (held between steps)."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """The peak of one step (``peak``): the bytes to compare with a device's memory."""
        return self.peak

    def describe(self) -> str:
        """One line for a notice: ``"ddp: 1.6 GiB at the peak per process (parameters ...)"``."""
        parts = [("parameters", self.params), ("gradients", self.grads), ("optimizer", self.optimizer)]
        if self.plan == "fsdp":
            parts.append(("gathered", self.gathered))
        parts.append(("activations", self.activations))
        where = f" over {self.processes}" if self.plan == "fsdp" else ""
        inner = ", ".join(f"{name} {format_bytes(value)}" for name, value in parts)
        return f"{self.plan}{where}: {format_bytes(self.total)} at the peak per process ({inner})"


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
    tracked: tracker.Tracked | None = None,
) -> Estimate:
    """The bytes one process holds for one training step of ``module`` on the batch ``args``/``kwargs``
    (this process's batch), with ``optimizer`` (an instance, or a class with ``optimizer_kwargs``).

    ``plan``: "ddp", or "fsdp" over ``processes`` with ``units`` the blocks that get their own
    ``fully_shard`` (the caller's choice, as ``in_rank.models.fsdp.units`` makes it; None: the
    root's children that hold parameters). ``device_type``: where the parameters will live (it
    decides the rule's optimizer temporaries, where the step is not tracked). ``bucket_view``:
    DDP's ``gradient_as_bucket_view``. ``tracked``: a step tracked already (``track``: one serves
    every plan).
    """
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r}: one of {', '.join(PLANS)}")
    if processes < 1:
        raise ValueError(f"processes={processes}: 1 or more")
    params = list(module.parameters())  # each Parameter once: tied weights count once
    cls, groups = optimizers.groups_of(optimizer, params, optimizer_kwargs)
    state, state_note = optimizers.state_bytes(cls, groups)
    notes = [state_note] if state_note else []
    if tracked is None:
        tracked, note = track(module, args, kwargs, optimizer=(cls, groups))
        notes += [note] if note else []
    trainable = _nbytes(p for p in params if p.requires_grad)
    if tracked is None:  # the rule
        peak, activations = _rule_peak(
            module, (tuple(args), dict(kwargs or {})), (cls, groups), device_type, notes
        )
        peak += state + (trainable if bucket_view else 2 * trainable) + _nbytes(params)
    else:
        notes += _tracked_notes(tracked, cls)
        peak, activations = tracked.peak, tracked.activations
        if not tracked.stepped:  # the optimizer's state and temporaries by rule, beside the step's peak
            peak += state + optimizers.step_temporaries(cls, groups, device_type)
        peak += 0 if bucket_view else trainable
    common = {"processes": processes, "activations": activations, "notes": tuple(notes)}
    if plan == "ddp":
        grads = trainable * (1 if bucket_view else 2)
        return Estimate(
            "ddp", params=_nbytes(params), grads=grads, optimizer=state, gathered=0, peak=peak, **common
        )
    rest, block = _gathered(module, units)
    sharded = _sharded(params, processes), _sharded([p for p in params if p.requires_grad], processes)
    shard_state = math.ceil(state / processes)
    beyond = max(peak - (0 if bucket_view else trainable) - _nbytes(params) - trainable - state, 0)
    gathered = rest + 2 * block
    total = sum(sharded) + shard_state + gathered + beyond
    return Estimate(
        "fsdp",
        params=sharded[0],
        grads=sharded[1],
        optimizer=shard_state,
        gathered=gathered,
        peak=total,
        **common,
    )


def state_only(
    module: torch.nn.Module,
    *,
    optimizer: torch.optim.Optimizer | type | tuple[type, Sequence[optimizers.Group]] | None = None,
    optimizer_kwargs: Mapping[str, Any] | None = None,
    plan: str = "ddp",
    processes: int = 1,
    units: Sequence[torch.nn.Module] | None = None,
    bucket_view: bool = True,
    offload: bool = False,
) -> Estimate:
    """The bytes one process holds of ``module``'s state under ``plan`` before any batch is seen
    (no activations, no step's temporaries): what a plan must fit before a step can. ``offload``
    (``fsdp`` only): parameter, gradient and optimizer shards live on the CPU, so the device holds
    only the gathered blocks."""
    if plan not in PLANS:
        raise ValueError(f"plan={plan!r}: one of {', '.join(PLANS)}")
    params = list(module.parameters())
    if isinstance(optimizer, tuple):  # (class, groups) of an optimizer being made: this module's share
        ours = {id(p) for p in params}
        cls, groups = (
            optimizer[0],
            [optimizers.Group(tuple(p for p in g.params if id(p) in ours), g.settings) for g in optimizer[1]],
        )
    else:
        cls, groups = optimizers.groups_of(optimizer, params, optimizer_kwargs)
    state, note = optimizers.state_bytes(cls, [g for g in groups if g.params])
    trainable = [p for p in params if p.requires_grad]
    common = {"processes": processes, "activations": 0, "notes": (note,) if note else ()}
    if plan == "ddp":
        grads = _nbytes(trainable) * (1 if bucket_view else 2)
        total = _nbytes(params) + grads + state
        return Estimate(
            "ddp", params=_nbytes(params), grads=grads, optimizer=state, gathered=0, peak=total, **common
        )
    rest, block = _gathered(module, units)
    parts = (_sharded(params, processes), _sharded(trainable, processes), math.ceil(state / processes))
    parts = (0, 0, 0) if offload else parts
    gathered = rest + 2 * block
    return Estimate(
        "fsdp",
        params=parts[0],
        grads=parts[1],
        optimizer=parts[2],
        gathered=gathered,
        peak=sum(parts) + gathered,
        **common,
    )


def track(
    module: torch.nn.Module,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    optimizer: tuple[type | None, Sequence[optimizers.Group]] = (None, []),
) -> tuple[tracker.Tracked | None, str | None]:
    """One step of ``module`` tracked on fake tensors (``tracker``), or None and why it could not run."""
    try:
        return tracker.track(module, (tuple(args), dict(kwargs or {})), optimizer, grads_held=True), None
    except Exception as error:  # no fake kernel, a value read back, a module that cannot be copied
        return (
            None,
            f"the step could not be tracked on fake tensors ({activations_._reason(error)}): taken by rule",
        )


def _tracked_notes(tracked: tracker.Tracked, cls: type | None) -> list[str]:
    notes = [
        f"{what} is not seen on fake tensors: the estimate is low by its size (with an LSTM on CPU, "
        "about 64 bytes per time step, sample and hidden unit, per layer and direction, measured with "
        "torch 2.13)"
        for what in tracked.unsized
    ]
    if cls is not None and not tracked.stepped:
        notes.append(
            f"{cls.__name__} could not step on fake tensors: its state and temporaries are added to "
            "the step's peak by rule"
        )
    return notes


def _rule_peak(
    module: torch.nn.Module,
    batch: tuple[tuple, dict],
    optimizer: tuple[type | None, Sequence[optimizers.Group]],
    device_type: str,
    notes: list[str],
) -> tuple[int, int]:
    """Where the step cannot be tracked: the activations one forward saves (``activations.measure``,
    or its own rule) and the larger of the backward's transient (the gradient of the largest
    activation in and out, the largest parameter's fresh gradient) and the optimizer's temporaries
    less the activations (freed by then); the peak beyond the state, and the activations."""
    acts = activations_.measure(module, *batch)
    notes += [acts.note] if acts.note else []
    cls, groups = optimizer
    largest = max((_nbytes([p]) for p in module.parameters() if p.requires_grad), default=0)
    temporaries = optimizers.step_temporaries(cls, groups, device_type)
    transient = max(2 * acts.largest + largest, temporaries - acts.saved, 0)
    return acts.saved + transient, acts.saved


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
