"""The DDP strategy: move to the device, wrap in DDP, and keep the user's module transparent.

The object the user gets back is their own module (see ``_routing``): ``isinstance`` holds,
attributes read and write the module itself, ``state_dict`` keys have no ``module.`` prefix,
``model.to(...)``/``.train()`` return the same object, and a user method that calls ``self(x)``
is synchronised too. Only a direct ``model.forward(x)`` bypasses DDP.

The DDP stays right when the model changes after wrapping. Its ``Replica`` remembers each
parameter with its dtype, device and ``requires_grad`` as the DDP was built; after any event that
can change parameters (a registration, ``.data =``, ``requires_grad``, ``.to()``/``.half()``, a
removal, a buffer registered or removed: counted in ``CURRENT.parameter_events``), the next
forward with gradients compares the model's parameters with them and builds a new DDP when they
differ (``model.double()``, ``.half()``, ``.to(device)``, a replaced or removed layer, frozen or
unfrozen parameters) or when the model gained its first buffer or lost its last (pruning). A step
without such an event costs two attribute reads, whatever the model's size. The first forward with
gradients also broadcasts rank 0's parameters and buffers, so weights re-initialised or loaded
between wrapping and training start identical on every rank.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from autoddp.core import _class_swap, _compat, _warn
from autoddp.core.environment import hardware
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import CURRENT, RunOptions, World
from autoddp.in_rank.models import _reduction, _routing, _split, _start, _window, statistics
from autoddp.in_rank.world import placement

#: The strategy's name (``strategy="ddp"``), kept on the class of each model it wraps.
NAME = "ddp"

#: autoddp's own DDP settings, chosen by measurement (``benchmarks/memory.py``, ``steady_state.py``)
#: and shown to leave the weights bitwise equal (``tests/in_rank/test_ddp_defaults.py``); ``ddp=`` wins.
#: Gradients that are views into DDP's communication buckets need no copy of their own.
DEFAULTS: dict[str, Any] = {"gradient_as_bucket_view": True}


def _count_parameter_event(*args: Any) -> None:
    CURRENT.parameter_events += 1


def _count_buffer_event(module: torch.nn.Module, name: str, buffer: torch.Tensor | None) -> None:
    """A buffer registered, or set to or from None, is an event; a tensor put in place of one is
    not (DDP reads its buffers anew at every broadcast; ``self.n = self.n + 1`` must cost nothing)."""
    if buffer is None or name not in dict(module.named_buffers(recurse=False)):
        CURRENT.parameter_events += 1


def _watch_parameter_changes() -> None:
    """Count, in ``CURRENT.parameter_events``, every event that can change a module's parameters.

    Registrations through torch's public global hooks; the rest (``.data =``, ``requires_grad``,
    ``.to()``/``.half()``, removals, swaps) through ``_compat.watch_parameter_changes``. Once per
    process: the hooks stay, and cost nothing but a counter where no model is wrapped.
    """
    if _compat.PARAMETER_WATCH in torch.nn.Parameter.__dict__:
        return
    from torch.nn.modules import module

    module.register_module_parameter_registration_hook(_count_parameter_event)
    module.register_module_module_registration_hook(_count_parameter_event)
    module.register_module_buffer_registration_hook(_count_buffer_event)
    _compat.watch_parameter_changes(_count_parameter_event)


class Replica:
    """The DDP behind one module, rebuilt when the module's parameters change (module docstring)."""

    def __init__(self, module: torch.nn.Module, ddp_kwargs: Mapping[str, Any], rank: int = 0) -> None:
        self.ddp_kwargs = {**DEFAULTS, **ddp_kwargs}
        self.updated_buffers = statistics.UpdatedBuffers(rank)  # statistics the forward updates
        self.signature: list[tuple[torch.nn.Parameter, torch.dtype, torch.device, bool]] = []
        #: Whether the module had buffers at the build: DDP decides it once, so a change rebuilds it.
        self.buffered = False
        #: ``CURRENT.parameter_events`` when the signature was last found current.
        self.events = -1
        #: Whether some parameter's changes escape the event count (a tensor subclass): look every time.
        self.look_always = True
        #: Forwards routed through the DDP so far (the optimizer's guard compares, see ``guard``).
        self.forwards = 0
        #: Backward passes through submodules called outside the DDP's forward (``_routing.watch``).
        self.bypasses = 0
        #: A call ran without the DDP: parameters swapped for the caller's (``torch.func.functional_call``).
        self.reparametrized = False
        #: Whether the submodules count those passes: only for an optimizer's guard (``_averaging``).
        self.watched = False
        self.reduction = _reduction.Ledger(lambda: (e[0] for e in self.signature))  # the guard's
        #: The gradient-accumulation window learned from an optimizer's steps (``_window``), set by
        #: the guard under capture (which also averages what a wrong guess left local); None: sync all.
        self.window: _window.Window | None = None
        #: Whether DDP's ``no_sync`` may defer a forward's synchronisation (not in DDP's modes that
        #: synchronise otherwise: a static graph, parameters whose all-reduce is delayed).
        self.deferrable = False
        #: A batch drawn by hand split at the call (``_at_call``): None (not tried yet), its
        #: ``Splitting``, or the reason it cannot be (the whole batch then runs on every rank).
        self.at_call: Any = None
        self.inside = False  # while the DDP's forward runs
        #: ``CURRENT.parameter_events`` when ``for_call`` last found nothing to do (the DDP built, the
        #: weights synchronised, every parameter's changes counted by the events): while it still
        #: holds, the routing takes the DDP without asking (``_routing._call``'s fast path).
        self.ready = -2
        #: While ``build`` makes the DDP: capture's hook of ``DistributedDataParallel.__init__``
        #: must not take autoddp's own (re)build, inside the user's forward, for a DDP of the user's.
        self.building = False
        self.lazy = _has_lazy_parameters(module)
        object.__setattr__(module, _routing.REPLICA_ATTR, self)  # (before the build: ``building``)
        if not self.lazy:
            try:
                self.build(module)
            except BaseException:
                module.__dict__.pop(_routing.REPLICA_ATTR, None)
                raise
        self.synced = False  # weights may still change before the first forward (module docstring)

    def build(self, module: torch.nn.Module) -> None:
        """(Re)build the DDP for the module's parameters as they are now (a collective)."""
        module.__dict__.pop(_routing.DDP_ATTR, None)  # the old DDP goes first: one reducer at a time
        self.ready = -2  # (``for_call`` looks again)
        self.events = CURRENT.parameter_events  # (read first: a change from here on is looked at)
        params = list(module.parameters())
        self.signature = [(p, p.dtype, p.device, p.requires_grad) for p in params]
        self.buffered = _has_buffers(module)
        self.look_always = not all(_compat.parameter_changes_watched(p) for p in params)
        if self.watched:
            _routing.watch(module, self)  # submodules called beside the DDP (``model.encoder(x)``)
        if not any(p.requires_grad for p in params):
            return  # nothing to synchronise (yet)
        device = next((p.device for p in params if p.requires_grad), torch.device("cpu"))
        device_ids = [device.index] if device.type == "cuda" else None
        self.building = True
        try:
            ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        finally:
            self.building = False
        object.__setattr__(module, _routing.DDP_ATTR, ddp)
        self.deferrable = not ddp.static_graph and not self.ddp_kwargs.get("delay_all_reduce_named_params")

    def defers(self, ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Whether the forward under way (already counted) leaves its gradients local (``_window``)."""
        window = self.window
        return (
            window is not None
            and self.deferrable
            and ddp.require_backward_grad_sync  # (the user's own no_sync stays as it is)
            and window.defers(self.forwards)
        )

    def for_call(
        self, module: torch.nn.Module, args: tuple = (), kwargs: dict | None = None
    ) -> torch.nn.parallel.DistributedDataParallel | None:
        """The DDP to run a forward with gradients through, up to date with the module.

        A module with lazy layers (``nn.LazyLinear``) gets its parameters first: one forward of
        these inputs in eval mode, without gradients, then rank 0's weights everywhere.
        """
        if self.lazy:
            _materialize(module, args, kwargs or {})
            self.lazy = False
            self.build(module)
            self.synced = True
            return module.__dict__.get(_routing.DDP_ATTR)
        if self._changed(module):
            if any(not isinstance(p, torch.nn.Parameter) for p in module.parameters()):
                self.reparametrized, self.events = True, -1  # functional_call's: no DDP (looked at again)
                return None
            self.build(module)
            self.synced = True  # DDP's constructor broadcast rank 0's parameters and buffers
        elif not self.synced:
            _broadcast_from_rank0(module)
            self.synced = True
        if not self.look_always:
            self.ready = self.events  # (``_changed`` read the events: nothing changed since)
        return module.__dict__.get(_routing.DDP_ATTR)

    def _changed(self, module: torch.nn.Module) -> bool:
        """Whether the module's parameters differ from the DDP's: looked at only after an event.

        Without an event since the last look (``_watch_parameter_changes``) nothing can have
        changed, so a normal step costs two attribute reads, whatever the number of parameters.
        """
        events = CURRENT.parameter_events
        if events == self.events and not self.look_always:
            return False
        self.events = events
        current = list(module.parameters())
        if len(current) != len(self.signature) or _has_buffers(module) is not self.buffered:
            return True
        for p, (q, dtype, device, requires_grad) in zip(current, self.signature, strict=True):
            if p is not q or p.dtype is not dtype or p.requires_grad is not requires_grad:
                return True
            if p.device != device:
                return True
        return False

    def watch_submodules(self, module: torch.nn.Module) -> None:
        """Count backward passes through submodules called beside the DDP, from now on (the guard's)."""
        self.watched = True
        _routing.watch(module, self)

    def count_bypass(self, grad: torch.Tensor) -> None:
        """A backward reached the output of a submodule called outside the DDP (a tensor hook)."""
        self.bypasses += 1

    def explain(self, error: RuntimeError, module: torch.nn.Module) -> BaseException:
        """DDP's error about parameters that got no gradient, as one naming them and the fix."""
        if "Expected to have finished reduction in the prior iteration" not in str(error):
            return error
        unused = _compat.ddp_errors.unused_parameters(error, module)  # (named from DDP's indices)
        listed = ", ".join(unused[:6]) + (" ..." if len(unused) > 6 else "") if unused else "some"
        return ConfigurationError(
            f"{type(module).__name__} has parameters that take no part in computing the loss ({listed}), "
            "and DDP waits for their gradients. Pass ddp={'find_unused_parameters': True} to "
            "@autoddp.distributed (the command: --find-unused-parameters), or freeze them "
            "(requires_grad_(False)) if they are not meant to train"
        )


def _has_buffers(module: torch.nn.Module) -> bool:
    return next(module.buffers(), None) is not None


def _has_lazy_parameters(module: torch.nn.Module) -> bool:
    return any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in module.parameters())


def _materialize(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Give lazy layers their parameters with one forward (eval mode, no gradients, nothing kept)."""
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            getattr(type(module), _class_swap.PLAIN_CLASS).__call__(module, *args, **kwargs)
    finally:
        module.train(training)


def _broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank's module, in place."""
    import torch.distributed as dist

    with torch.no_grad():
        tensors = [t for t in (*module.parameters(), *module.buffers()) if t.numel()]
        works = [dist.broadcast(t.data, src=0, async_op=True) for t in tensors if t.is_contiguous()]
        for work in works:
            work.wait()
        for t in tensors:
            if not t.is_contiguous():
                copy = t.data.contiguous()
                dist.broadcast(copy, src=0)
                t.data.copy_(copy)


def wrap(module: torch.nn.Module, world: World, options: RunOptions, *, move: bool = True) -> torch.nn.Module:
    """Return ``module`` on this process's device, its gradients synchronised across the world.

    With one process the module is moved and given the swapped class only (``no_sync`` is then
    a no-op). A model that is already wrapped (by autoddp or in a DistributedDataParallel) is
    returned unchanged. ``move=False`` (capture) leaves the module where the user put it, and
    refuses one that sits on another process's GPU. ``options.split_batches``: BatchNorm layers
    use the global batch's statistics (``_split``).
    """
    if isinstance(module, torch.nn.parallel.DistributedDataParallel) or distributed(module):
        return module
    module = _class_swap.unwrap_compiled(module)  # torch.compile(model): the real module, still compiled
    several, sync_batchnorm = world.world_size > 1, options.sync_batchnorm
    if several and options.split_batches:
        sync_batchnorm = _split.convert_batchnorms(module) > 0 or sync_batchnorm  # (no hint due)
    elif several and sync_batchnorm:
        if not world.device.startswith("cuda"):
            raise ConfigurationError(
                "sync_batchnorm=True needs CUDA devices: torch's SyncBatchNorm does not run on the CPU. "
                "Leave it off for CPU (gloo) runs."
            )
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if _start.is_meta(module):  # built on the meta device: rank 0 makes one process's weights
        module = _start.materialise(module, world.rank, world.device)
    elif move and not _on_device(module, world.device):
        module = module.to(world.device)
    elif not move:
        _check_own_gpu(module, world)
    _routing.swap(module, NAME)
    CURRENT.track(module, release)
    if not several:
        return module
    _own_data_parallels(module, world)
    if (
        not sync_batchnorm
        and world.rank == 0
        and any(isinstance(m, statistics.BATCHNORMS) for m in module.modules())
    ):
        # (said by rank 0 only: every rank would say the same)
        _warn.warn(statistics.batchnorm_hint(type(module).__name__, world.device))
    _watch_parameter_changes()
    if world.device == "cpu":
        hardware.keep_freed_memory()  # else every step may fault its activations in again
    Replica(module, options.ddp_kwargs or {}, world.rank)  # (it puts itself beside the module)
    return module


def _check_own_gpu(module: torch.nn.Module, world: World) -> None:
    """A module on a GPU other than this process's own cannot be trained here: say how to fix it."""
    own = placement.own_gpu(world, torch.cuda.device_count())  # (beside the GPUs on gloo too)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type == "cuda" and tensor.device.index != own:
            raise ConfigurationError(
                f"{type(module).__name__} sits on {tensor.device}, but this process (rank {world.rank}) "
                f"computes on {'cpu' if own is None else f'cuda:{own}'}: every process has its own GPU. "
                "Move the model with device='cuda', cuda:0 or autoddp.device() (which mean this "
                "process's GPU) instead of another index, or turn capture off "
                "(@distributed(capture=False), autoddp --no-capture)"
            )


def _own_data_parallels(module: torch.nn.Module, world: World) -> None:
    """Every ``nn.DataParallel`` in ``module`` runs on this process's own GPU only (one made before
    the call, in the caller say, lists every GPU of the machine and expects its weights on cuda:0)."""
    own = placement.own_gpu(world, torch.cuda.device_count())
    if own is None:
        return
    for inner in module.modules():
        if isinstance(inner, torch.nn.DataParallel) and inner.device_ids and inner.device_ids != [own]:
            inner.device_ids, inner.output_device = [own], own  # its public attributes, as its
            inner.src_device_obj = torch.device("cuda", own)  # __init__ sets them for one GPU
            if world.rank == 0:
                inside = "" if inner is module else f" inside {type(module).__name__}"
                _warn.warn(
                    f"nn.DataParallel{inside} now runs on each process's own GPU only (device_ids="
                    "[local rank]): every process has one GPU, and DDP averages the gradients across them"
                )


def _on_device(module: torch.nn.Module, device: str) -> bool:
    """True when every parameter and buffer already lives on ``device`` (``.to`` would be a no-op)."""
    target = torch.device(device)
    tensors = [*module.parameters(), *module.buffers()]
    return all(t.device == target or (target.index is None and t.device.type == target.type) for t in tensors)


def building(module: torch.nn.Module) -> bool:
    """True while autoddp makes the DDP behind ``module`` (the first, or a rebuild after a change)."""
    replica = getattr(module, "__dict__", {}).get(_routing.REPLICA_ATTR)
    return replica is not None and getattr(replica, "building", False)


def distributed(model: torch.nn.Module) -> bool:
    """True when autoddp's DDP already distributes ``model`` in the current world."""
    return _routing.REPLICA_ATTR in model.__dict__


def is_wrapped(model: Any) -> bool:
    """True for a module whose gradients autoddp synchronises with a DDP now."""
    return isinstance(model, torch.nn.Module) and _routing.DDP_ATTR in model.__dict__


def ddp_of(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel behind a wrapped module (None if it has none)."""
    return model.__dict__.get(_routing.DDP_ATTR)


def release(model: torch.nn.Module) -> None:
    """Detach the DDP from ``model`` (before its process group is destroyed); it is plain again.

    Freeing a DDP after ``destroy_process_group`` can deadlock gloo, so the group's lifecycle
    releases every wrapped model first.
    """
    _routing.unswap(model)
    _split.restore_batchnorms(model)


def check_keywords(ddp: Any) -> None:
    """``ddp=``: keyword arguments DistributedDataParallel takes, none that autoddp sets itself."""
    if ddp is None:
        return
    if not isinstance(ddp, Mapping) or not all(isinstance(k, str) for k in ddp):
        raise ConfigurationError(
            f"ddp={ddp!r} must be a dict of DistributedDataParallel keyword arguments, "
            'e.g. ddp={"find_unused_parameters": True}'
        )
    accepted = set(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters) - {
        "self"
    }
    unknown = sorted(set(ddp) - accepted)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(accepted), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"ddp= has {', '.join(map(repr, unknown))}, which DistributedDataParallel does not take{hint}"
        )
    reserved = sorted(set(ddp) & {"module", "device_ids", "output_device", "process_group"})
    if reserved:
        raise ConfigurationError(
            f"ddp= may not set {', '.join(reserved)}: autoddp sets them for each process; remove them"
        )
