"""``@distributed``: run a plain train function once per device and return rank 0's result."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

import wrapt

from autoddp import launch
from autoddp import options as options_list
from autoddp.core import backends
from autoddp.core.environment import hardware
from autoddp.core.errors import ConfigurationError
from autoddp.in_rank.worker.running import Job
from autoddp.options import Options

F = TypeVar("F", bound=Callable[..., Any])


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
    ``start_method``: ``"auto"`` (fork where CUDA and autograd's threads are untouched, fresh
    interpreters otherwise),
    ``"fork"`` or ``"spawn"`` (fresh interpreters that receive the function by value; unlike
    multiprocessing's spawn, never re-import ``__main__``). ``timeout``: seconds a collective
    may wait before failing (torch's default when unset; ``float("inf")``: no timeout).
    ``max_restarts``: start the whole group again this many times after a worker fails (the workers see
    ``TORCHELASTIC_RESTART_COUNT``; resume with ``autoddp.load(path, default=None)``).
    ``nnodes``/``node_rank``/``master="host:port"``: run on several machines (call the function
    on each, with its own ``node_rank``; node 0 hosts the rendezvous at ``master``; on one machine
    ``master`` is where its store listens, as torchrun's ``--master-addr``); the result
    is rank 0's on node 0 and None elsewhere. ``rdzv_backend="c10d"``: torchrun's dynamic
    rendezvous at ``master`` instead (no ``node_rank``; ``nnodes="MIN:MAX"`` for an elastic
    range); the machine whose worker became rank 0 gets the result. Standard input goes to rank 0
    (as under torchrun; the others read an empty one), from where the caller stopped reading a
    file; from a pipe, what the caller's ``sys.stdin`` already read ahead stays the caller's.
    ``ranks``: whose output reaches the console: ``"0"`` (default), ``"all"`` (lines prefixed
    ``[rank N]``) or local ranks like ``"0,1"``; every rank's output is also written to files
    under ``log_dir``.

    Models and DataLoaders among the arguments are prepared (see ``autoddp.prepare``): models
    are moved to the process's device and wrapped in DDP (``ddp=`` passes keyword arguments
    to DistributedDataParallel; ``sync_batchnorm=True`` converts BatchNorm to SyncBatchNorm),
    loaders get a DistributedSampler whose epoch advances by itself; so are defaults, and the
    models that optimizers made before the call train, found in the arguments, ``self`` and the
    defaults (``self.model`` beside ``self.opt``). Those the function makes
    itself are found too (``capture``, on by default): a model when an optimizer is made over
    it, a shuffled loader when it is first iterated, ``torch.save`` to a path written once by
    rank 0. ``capture=False`` leaves them alone.

    ``strategy="auto"`` (the default) replicates a model with DDP where its state (parameters,
    gradients, the optimizer's state) fits the memory one process may use (``device_memory``:
    bytes or ``"24GiB"``; default: the GPU's free memory less 10% of its size, on CPU the
    machine's available memory over its processes), else shards it with FSDP2 (with the shards
    on the CPU where even that does not fit a GPU); every rank takes the same plan, and the
    notice says which and why. ``"ddp"`` and ``"fsdp"`` force one.
    ``strategy="fsdp"`` shards models with FSDP2 instead of replicating them with DDP (each
    rank holds a share of the parameters, gradients and optimizer state); ``fsdp_blocks``
    names the module classes that get their own shard unit (autoddp chooses otherwise),
    ``mixed_precision="bf16"`` computes in bf16 with float32 gradient reduction (``"fp16"``
    too, with ``torch.amp.GradScaler`` in the loop), and ``cpu_offload=True`` keeps the shards on
    the CPU. Every rank starts from rank 0's weights; a model built on the meta device
    (``with torch.device("meta"): model = Net()``) is sharded before it gets memory, and rank 0
    makes its weights (``reset_parameters()``), as one process with the same seed would.

    ``split_batches=True``: the batch of each shuffled loader is the global batch, each process
    taking its part of every one (the steps, samples, ``len(loader)`` and, for a loss that is a
    mean over the batch, the gradients of one process; BatchNorm with the global statistics);
    rank 0 continues the caller's random streams, so the sampler draws what one process would.

    ``hang_report``: when some ranks have waited in a collective (or for rank 0's ``rank0()``
    block) this many seconds while others are elsewhere, the console says which ranks wait,
    where, and shows the Python stack of each rank that has not arrived; the run goes on
    (default 60; 0 or ``float("inf")`` turns it off).
    """
    checked = Options.from_keywords(options)
    if fn is None:
        return functools.partial(_decorate, options=checked)
    return _decorate(fn, checked)


distributed.__signature__ = options_list.signature()  # type: ignore[attr-defined]


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
    request = options.request()  # the options go down the wings: a request, then a job for the ranks
    backend = backends.resolve_backend(options.backend, hardware.gpu_count())
    job = Job(wrapped, args, kwargs, backend, backends.as_timeout(options.timeout), options.run_options)
    return launch.run(request, job)
