"""The one explicit record of "the current world": where this process stands and what it wrapped.

``World`` describes a process's place in a job (immutable). ``Run`` holds what changes while a
process takes part in one: the world it joined, the run's options, the timeout its process
group was given, the user's function being run, and the models wrapped for it (so that they can
let go of their process group before it ends). ``CURRENT`` is the only instance; the
process-group lifecycle (``autoddp.in_rank.world.process_group.joined``) is the only code that enters and
leaves a world. A leaf module: nothing here imports the rest of autoddp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import weakref
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process stands in a distributed job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    device: str = "cpu"


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How models are treated in the current run (set by ``@distributed``'s options)."""

    #: "auto" (DDP where the model's state fits ``device_memory``, else FSDP2), "ddp" or "fsdp".
    strategy: str = "auto"
    ddp_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sync_batchnorm: bool = False
    #: Find models, loaders and saves in the user's code by themselves (``autoddp.in_rank.capture``).
    capture: bool = True
    #: FSDP: module classes (or their names) that get their own ``fully_shard``; () lets autoddp choose.
    fsdp_blocks: tuple[Any, ...] = ()
    #: FSDP: compute in this dtype ("bf16", "fp16"), reduce gradients in float32; None: as the model is.
    mixed_precision: Any = None
    #: FSDP: keep the parameters' shards on the CPU between uses.
    cpu_offload: bool = False
    #: FSDP: recompute each block's forward in the backward pass instead of keeping its activations
    #: (a plan of strategy="auto" after running out of memory; no option of its own).
    checkpoint_blocks: bool = dataclasses.field(default=False, metadata={"planned": True})
    #: The script's batch is the global batch: each rank takes its part (``autoddp.in_rank.data.split``).
    split_batches: bool = False
    #: strategy="auto": the bytes one process may use for its models' state and steps (None: the
    #: device's free memory less a margin, or the machine's available memory over its processes).
    device_memory: int | None = None


@dataclasses.dataclass
class Planned:
    """What strategy="auto" decided in the current world (``models._plan``)."""

    #: The bytes each process may use, agreed by every rank at the first weighing (the least of
    #: theirs; None: no model weighed yet).
    budget: int | None = None
    #: The bytes the plans taken so far hold per process (the next model fits in what is left).
    placed: int = 0
    #: The plans this process can take, cheapest first (names of ``core.memory.budget.LADDER``).
    ladder: tuple[str, ...] = ("ddp",)
    #: The plans taken, one per model weighed, in order.
    taken: list[str] = dataclasses.field(default_factory=list)
    #: Whether a plan taken shards a model (checkpoints then load memory-mapped).
    sharded: bool = False
    #: The hook that weighs the first optimizer step's peak on a GPU (``models._plan``; None: none;
    #: removed when the world ends).
    watch: Any = None
    #: The optimizers whose first step was weighed (by id: each one's first step is weighed; once
    #: one was, the peak is not reset again).
    weighed: set[int] = dataclasses.field(default_factory=set)
    #: Whether a plan was taken that does not fit (none did): the first step is not weighed then.
    overcommitted: bool = False
    #: On the CPU: the resident bytes when the peak was last reset (the optimizer made), and the bytes
    #: of the wrapped models' state resident then (the first steps' peak is weighed from both).
    resident_from: int | None = None
    held: int = 0
    #: Why each model got its plan, for the notice (weakly: a model may go).
    notes: weakref.WeakKeyDictionary[Any, str] = dataclasses.field(default_factory=weakref.WeakKeyDictionary)


class Run:
    """The world this process has joined, if any, with the run's options and wrapped models."""

    def __init__(self) -> None:
        self.world: World | None = None
        self.options: RunOptions = RunOptions()
        #: The timeout autoddp gave the process group (None: torch's default, or a group the user made).
        self.timeout: datetime.timedelta | None = None
        #: (file, first line) of the user's function being run, for warnings raised outside it.
        self.function: tuple[str, int] | None = None
        #: (the torch seed autoddp gave this worker, the caller's torch seed), while it runs the call.
        self.seeds: tuple[int, int] | None = None
        #: The capture session while the user's code runs with capture on (``autoddp.in_rank.capture``).
        self.capture: Any = None
        #: Whether this process has capture's audit hook (``capture.shared_files``: added once).
        self.audit_hook = False
        #: Events that can have changed a wrapped model's parameters (``models.ddp``: checked per forward).
        self.parameter_events = 0
        #: Process groups autoddp initialised in this process: the n-th one's keys live under a store
        #: prefix of its own (``process_group``), the same on every rank since each init is collective.
        self.groups_made: int = 0
        #: ((url, rank, world size), store): the rendezvous store those groups share in this process.
        self.store: tuple[tuple[str, int, int], Any] | None = None
        #: split_batches: this rank's share of the batch last handed out (W * part / batch; 0: a rank
        #: with no sample of it; None: no split batch in use). Models weigh their gradients by it.
        self.split_weight: float | None = None
        #: Calls split at a model (``models._at_call``) whose rows came from a computation with
        #: gradients (another split model's output, say): a gathered output's gradient then differs
        #: between the ranks, and is summed across them.
        self.split_chains = 0
        #: A loader handed out data by rank in this run (capture's shards, the user's sampler): the
        #: batches reaching a model are this rank's, never split again at the model's call.
        self.sharded_data = False
        #: rank0() bodies running on this rank 0 alone (nested ones counted): no collective there.
        self.alone = 0
        #: (a weak reference to the iterator, its length) of the training pass of a DataLoader under
        #: way: the forward of its last batch ends a gradient-accumulation window (``models._window``).
        self.training_pass: tuple[Any, int] | None = None
        #: The gradient-accumulation window last learned longer than one backward (0: none yet).
        self.accumulating = 0
        #: (window, why) of the first sharded model found accumulating whose reduce-scatters cannot
        #: be deferred (``models._deferral``): every backward synchronises, and capture says why.
        self.undeferred: tuple[int, str] | None = None
        #: torch.autograd.backward and .grad calls begun (``models.count_passes``), and the kind running now
        #: ("backward": accumulating into .grad; "grad": returning gradients; None): the step's
        #: averaging guard tells one backward from the next and sees an optimizer step inside one.
        self.backwards = 0
        self.backward_kind: str | None = None
        #: The number of the pass running now (``backwards`` when it began; the outer pass's again
        #: once one nested in its hooks returns), and the ``inputs`` it was given (None: none).
        self.backward_number = 0
        self.backward_inputs: tuple | None = None
        #: What strategy="auto" decided in the current world (None: nothing yet).
        self.planned: Planned | None = None
        #: Models too large for one GPU waiting in host memory to be sharded (``models._placed_later``):
        #: each such root (weakly) with its pending move, each module in one with (a weak reference
        #: to) its root, and the global forward pre-hook that moves a root whole before a forward of
        #: any module in it (None: nothing waits).
        self.placed_later: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self.placed_within: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self.placed_later_hook: Any = None
        #: Models wrapped in each joined world, innermost last (weakly: a model may go).
        self._wrapped: list[weakref.WeakKeyDictionary[Any, Callable[[Any], None]]] = []

    def entered(
        self,
        world: World,
        options: RunOptions | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> contextlib.AbstractContextManager[World]:
        """Make ``world`` the current one for a ``with`` block (the previous one comes back after it)."""
        return _InWorld(self, world, options or RunOptions(), timeout)

    def track(self, model: Any, release: Callable[[Any], None]) -> None:
        """Remember that ``model`` was wrapped in the innermost joined world, and how its strategy
        lets go of the model's process group (``release(model)``)."""
        if self._wrapped:
            self._wrapped[-1][model] = release

    def wrapped_models(self) -> list[Any]:
        """The models wrapped in the joined worlds, innermost first."""
        return [model for wrapped in reversed(self._wrapped) for model in list(wrapped)]

    def release_wrapped(self) -> None:
        """Have every model wrapped in the innermost world let go of it (before its group is destroyed)."""
        if not self._wrapped:
            return
        wrapped = self._wrapped[-1]
        for model, release in list(wrapped.items()):
            release(model)
        wrapped.clear()


class _InWorld:
    """The context manager of ``Run.entered`` (a plain class: the one-process call path is hot)."""

    __slots__ = ("_entered", "_previous", "_run")

    def __init__(
        self, run: Run, world: World, options: RunOptions, timeout: datetime.timedelta | None
    ) -> None:
        self._run = run
        self._entered = (world, options, timeout)
        self._previous: tuple[Any, ...] | None = None  # (world, options, timeout, planned)

    def __enter__(self) -> World:
        run = self._run
        self._previous = run.world, run.options, run.timeout, run.planned
        run.world, run.options, run.timeout = self._entered
        run.planned = None
        run._wrapped.append(weakref.WeakKeyDictionary())
        return self._entered[0]

    def __exit__(self, *exc_info: object) -> None:
        run = self._run
        assert self._previous is not None
        if run.planned is not None and run.planned.watch is not None:  # (its optimizer-step hook)
            run.planned.watch.remove()
        run.world, run.options, run.timeout, run.planned = self._previous
        run._wrapped.pop()


CURRENT = Run()
