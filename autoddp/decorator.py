"""``@distributed``: run a plain train function once per device and return rank 0's result."""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

import wrapt
from torch.nn.parallel import DistributedDataParallel

from autoddp import _warn, environment, hardware, models, process_group, streams
from autoddp.errors import ConfigurationError
from autoddp.hang import record as hang_record
from autoddp.launch import output as launch_output
from autoddp.launch import plan as launch_plan
from autoddp.launch import start_method as launch_start
from autoddp.models import fsdp
from autoddp.preparation import prepare
from autoddp.running import Job, run_in_world
from autoddp.state import RunOptions

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class Options:
    """The decorator's options, checked when the function is decorated.

    The one list of them: ``distributed``'s signature is made from these fields.
    """

    nproc: int | None = None
    backend: str | None = None
    start_method: str = "auto"
    timeout: float | datetime.timedelta | None = None
    ddp: Mapping[str, Any] | None = None
    sync_batchnorm: bool = False
    max_restarts: int = 0
    nnodes: int | str | None = None
    node_rank: int | None = None
    master: str | None = None
    rdzv_backend: str | None = None
    ranks: str = "0"
    log_dir: str | None = None
    capture: bool = True
    strategy: str = "ddp"
    fsdp_blocks: tuple[type | str, ...] = ()
    mixed_precision: str | None = None
    cpu_offload: bool = False
    hang_report: float = hang_record.DEFAULT_SECONDS

    def __post_init__(self) -> None:
        self.nodes  # noqa: B018 - checks the multi-node options at decoration time
        if self.nproc is not None and (
            isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1
        ):
            raise ConfigurationError(
                f"nproc={self.nproc!r} is not a positive whole number of processes; pass e.g. "
                "nproc=2, or leave it unset for one process per visible GPU (1 without GPUs)"
            )
        process_group.resolve_backend(self.backend, gpus=1)  # the name only; GPUs are checked per call
        if self.start_method not in launch_start.START_METHODS:
            raise ConfigurationError(
                f"unknown start_method {self.start_method!r}: use 'auto' (default), 'fork' or 'spawn'"
            )
        process_group.as_timeout(self.timeout)
        if self.ddp is not None:
            if not isinstance(self.ddp, Mapping) or not all(isinstance(k, str) for k in self.ddp):
                raise ConfigurationError(
                    f"ddp={self.ddp!r} must be a dict of DistributedDataParallel keyword arguments, "
                    'e.g. ddp={"find_unused_parameters": True}'
                )
            accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self"}
            unknown = sorted(set(self.ddp) - accepted)
            if unknown:
                close = difflib.get_close_matches(unknown[0], sorted(accepted), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigurationError(
                    f"ddp= has {', '.join(map(repr, unknown))}, which DistributedDataParallel does not "
                    f"take{hint}"
                )
            reserved = sorted(set(self.ddp) & {"module", "device_ids", "output_device", "process_group"})
            if reserved:
                raise ConfigurationError(
                    f"ddp= may not set {', '.join(reserved)}: autoddp sets them for each process; remove them"
                )
        if (
            isinstance(self.max_restarts, bool)
            or not isinstance(self.max_restarts, int)
            or self.max_restarts < 0
        ):
            raise ConfigurationError(
                f"max_restarts={self.max_restarts!r} must be a whole number >= 0 (restarts after a failure)"
            )
        models.strategy_named(self.strategy)
        if self.strategy == "fsdp":
            fsdp.fsdp_api()
        elif self.fsdp_blocks or self.mixed_precision is not None or self.cpu_offload:
            raise ConfigurationError(
                "fsdp_blocks=, mixed_precision= and cpu_offload= are FSDP's options: add strategy='fsdp'"
            )
        fsdp.precision(self.mixed_precision)
        if isinstance(self.fsdp_blocks, (str, type)) or not all(
            isinstance(b, (str, type)) for b in self.fsdp_blocks
        ):
            raise ConfigurationError(
                f"fsdp_blocks={self.fsdp_blocks!r}: give a tuple of module classes or class names, "
                "e.g. fsdp_blocks=(TransformerBlock,) or fsdp_blocks=('TransformerBlock',)"
            )
        if (
            isinstance(self.hang_report, bool)
            or not isinstance(self.hang_report, (int, float))
            or not self.hang_report >= 0
        ):
            raise ConfigurationError(
                f"hang_report={self.hang_report!r} must be a number of seconds >= 0: how long ranks may "
                "wait for another before autoddp says which rank and where (e.g. hang_report=120; 0: off)"
            )
        for name in ("sync_batchnorm", "capture", "cpu_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name}={getattr(self, name)!r} must be True or False")
        self.output.shown(self.nproc or max(hardware.gpu_count(), 1))  # ranks=, log_dir= as well

    @classmethod
    def from_keywords(cls, options: Mapping[str, Any]) -> Options:
        """Options from ``@distributed(**options)``; an unknown name is a ConfigurationError."""
        names = [field.name for field in dataclasses.fields(cls)]
        for name in options:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]}=?" if close else ""
                raise ConfigurationError(
                    f"@distributed has no option {name!r}{hint} Its options are: {', '.join(names)}"
                )
        return cls(**options)

    @property
    def nodes(self) -> launch_plan.Nodes:
        return launch_plan.plan(self.nnodes, self.node_rank, self.master, rdzv_backend=self.rdzv_backend)

    @property
    def output(self) -> launch_output.Output:
        return launch_output.Output(self.ranks, self.log_dir)

    @property
    def run_options(self) -> RunOptions:
        return RunOptions(
            strategy=self.strategy,
            ddp_kwargs=dict(self.ddp or {}),
            sync_batchnorm=self.sync_batchnorm,
            capture=self.capture,
            fsdp_blocks=tuple(self.fsdp_blocks),
            mixed_precision=self.mixed_precision,
            cpu_offload=self.cpu_offload,
        )

    def process_count(self, backend: process_group.Backend, gpus: int) -> int:
        if self.nproc is None:
            return gpus if backend.use_cuda else 1
        if backend.use_cuda and self.nproc > gpus:
            raise ConfigurationError(
                f"nproc={self.nproc} but only {gpus} GPU(s) are visible; use nproc<={gpus}, "
                "or backend='gloo' to run CPU processes"
            )
        return self.nproc


class DistributedFunction(wrapt.FunctionWrapper):
    """The decorated function: keeps the signature and docstring, and pickles by value."""

    def __init__(self, wrapped: Callable[..., Any], options: Options) -> None:
        super().__init__(wrapped, functools.partial(_call, options))
        self._self_options = options

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (_decorate, (self.__wrapped__, self._self_options))


@overload
def distributed(fn: F, /) -> F: ...
@overload
def distributed(fn: None = None, /, **options: Any) -> Callable[[F], F]: ...
def distributed(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Make ``fn`` run once per device, each process in a ready process group.

    Use bare (``@distributed``) or with options (``@distributed(nproc=2)``). Calling the
    decorated function from an ordinary process starts ``nproc`` workers (default: one per
    visible GPU, 1 without GPUs), runs only ``fn`` in each, and returns rank 0's result
    (tensors on the CPU, models unwrapped). Inside an existing distributed run (torchrun, the
    ``autoddp`` command, another decorated call) it runs in place. An exception in any worker
    stops them all and is re-raised here as the same type, naming the rank.

    ``backend``: ``"auto"`` (NCCL on GPUs, gloo on CPU), ``"nccl"`` or ``"gloo"``.
    ``start_method``: ``"auto"`` (fork where CUDA is untouched, fresh interpreters otherwise),
    ``"fork"`` or ``"spawn"`` (fresh interpreters that receive the function by value; unlike
    multiprocessing's spawn, never re-import ``__main__``). ``timeout``: seconds a collective
    may wait before failing (torch's default when unset). ``max_restarts``: start the whole
    group again this many times after a worker fails (the workers see
    ``TORCHELASTIC_RESTART_COUNT``; resume with ``autoddp.load(path, default=None)``).
    ``nnodes``/``node_rank``/``master="host:port"``: run on several machines (call the function
    on each, with its own ``node_rank``; node 0 hosts the rendezvous at ``master``); the result
    is rank 0's on node 0 and None elsewhere. ``rdzv_backend="c10d"``: torchrun's dynamic
    rendezvous at ``master`` instead (no ``node_rank``; ``nnodes="MIN:MAX"`` for an elastic
    range); the machine whose worker became rank 0 gets the result. ``ranks``: whose output
    reaches the console: ``"0"`` (default), ``"all"`` (lines prefixed ``[rank N]``) or local
    ranks like ``"0,1"``; every rank's output is also written to files under ``log_dir``.

    Models and DataLoaders among the arguments are prepared (see ``autoddp.prepare``): models
    are moved to the process's device and wrapped in DDP (``ddp=`` passes keyword arguments
    to DistributedDataParallel; ``sync_batchnorm=True`` converts BatchNorm to SyncBatchNorm),
    loaders get a DistributedSampler whose epoch advances by itself. Those the function makes
    itself are found too (``capture``, on by default): a model when an optimizer is made over
    it, a shuffled loader when it is first iterated, ``torch.save`` to a path written once by
    rank 0. ``capture=False`` leaves them alone.

    ``strategy="fsdp"`` shards models with FSDP2 instead of replicating them with DDP (each
    rank holds a share of the parameters, gradients and optimizer state); ``fsdp_blocks``
    names the module classes that get their own shard unit (autoddp chooses otherwise),
    ``mixed_precision="bf16"`` computes in bf16 with float32 gradient reduction (``"fp16"``
    too, with ``torch.amp.GradScaler`` in the loop), and ``cpu_offload=True`` keeps the shards on
    the CPU. Every rank starts from rank 0's weights; a model built on the meta device
    (``with torch.device("meta"): model = Net()``) is sharded before it gets memory, and rank 0
    makes its weights (``reset_parameters()``), as one process with the same seed would.

    ``hang_report``: when some ranks have waited in a collective (or for rank 0's ``rank0()``
    block) this many seconds while others are elsewhere, the console says which ranks wait,
    where, and shows the Python stack of each rank that has not arrived; the run goes on
    (default 60; 0 turns it off).
    """
    checked = Options.from_keywords(options)
    if fn is None:
        return functools.partial(_decorate, options=checked)
    return _decorate(fn, checked)


distributed.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("fn", inspect.Parameter.POSITIONAL_ONLY, default=None)]
    + [
        inspect.Parameter(
            field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default, annotation=field.type
        )
        for field in dataclasses.fields(Options)
    ]
)


def _decorate(fn: Callable[..., Any], options: Options) -> DistributedFunction:
    if not callable(fn):
        raise ConfigurationError(
            f"@distributed decorates a function, not {type(fn).__name__}; "
            "to pass options write @distributed(nproc=2)"
        )
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn) or inspect.iscoroutinefunction(fn):
        kind = "an async function" if inspect.iscoroutinefunction(fn) else "a generator function"
        raise ConfigurationError(
            f"@distributed cannot run {kind} ({fn.__qualname__}): its body would run after the "
            "workers are gone. Decorate a plain function that returns its results instead."
        )
    return DistributedFunction(fn, options)


def _call(options: Options, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    env = environment.detect()
    gpus = hardware.gpu_count()
    backend = process_group.resolve_backend(options.backend, gpus)
    job = Job(wrapped, args, kwargs, backend, process_group.as_timeout(options.timeout), options.run_options)
    if env.launched:
        world = env.world()
        if options.nproc is not None and options.nproc != world.local_world_size:
            _warn.warn(
                f"{getattr(wrapped, '__qualname__', wrapped)}() asks for nproc={options.nproc} but runs "
                f"inside an existing world ({env.name}, {world.world_size} processes): it runs in place "
                "there, without starting new processes."
            )
        return run_in_world(job, world, finish=prepare)
    nproc = options.process_count(backend, gpus)
    plan = options.nodes
    if plan.multi or nproc > 1:
        job.streams = streams.of_caller()
    if plan.multi:
        from autoddp.launch import nodes  # (the launch machinery loads when it is first needed)

        return nodes.launch_nodes(
            job, plan=plan, nproc=nproc, max_restarts=options.max_restarts, hang_report=options.hang_report
        )
    if nproc == 1:
        return run_in_world(job, env.world(), finish=prepare)
    from autoddp.launch import local

    return local.launch_function(
        job,
        nproc=nproc,
        start_method=options.start_method,
        max_restarts=options.max_restarts,
        output=options.output,
        hang_report=options.hang_report,
    )
