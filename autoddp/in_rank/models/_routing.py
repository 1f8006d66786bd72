"""The swapped class of a module autoddp distributes with DDP: calls routed through its DDP.

The user's module keeps its identity; its class becomes a cached subclass (same name and
qualified name) whose ``__call__`` asks the module's ``Replica`` (kept in the instance's
``__dict__``) for an up-to-date DDP while gradients are recorded, and runs the plain module
otherwise. ``no_sync`` is always there (a no-op without DDP). Under an optimizer's guard, a
forward that the gradient-accumulation window says is not the last before a step runs in DDP's
``no_sync`` (``_window``). Pickling, ``torch.save(model)`` and ``copy.deepcopy`` give what one
process gives: the plain class, the same globals, nothing of autoddp (``_class_swap.plain_reduce``).
User methods that compute with gradients without calling the model warn once (DDP cannot see
them). A ``torch.compile`` result made over the module after it was wrapped compiles the module's
own calls in place (``_adopt_compile``), as one made before.

The submodules owning parameters keep their own class (``type(m) is nn.Linear`` holds); once an
optimizer's guard (``_averaging``, capture's) reads the counts, each gets its calls routed
through a watcher (``watch``; ``_compat.route_calls``, which pickles leave out) that counts, on
the root's replica, backward passes through calls made outside the DDP's forward
(``model.encoder(x)`` beside ``model(x)``), which the optimizer's guard averages (``_averaging``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from autoddp.core import _class_swap, _compat, _containers, _patches, _warn
from autoddp.core._compat.calls import bare_forward
from autoddp.core._compat.tensor_hooks import hook_output
from autoddp.core.state import CURRENT
from autoddp.in_rank.models import _at_call, _split

#: Where the DDP and its replica live in the module's ``__dict__``.
DDP_ATTR = "_autoddp_ddp"
REPLICA_ATTR = "_autoddp_replica"
_PRIVATE = (DDP_ATTR, REPLICA_ATTR)


class Replica(Protocol):
    """What the swapped class needs from the state kept beside the module."""

    forwards: int
    #: Backward passes through submodules called outside the DDP's forward (DDP cannot see them).
    bypasses: int
    #: True while the DDP's forward runs (what the submodules' watchers read: no thread-local).
    inside: bool
    #: Whether an optimizer's guard reads the counts, and which backward passes DDP averaged.
    watched: bool
    reduction: Any
    #: Buffers the forward updates (running statistics), looked for in the first forwards.
    updated_buffers: Any
    #: ``CURRENT.parameter_events`` up to which ``for_call`` has nothing to do (the DDP is current).
    ready: int
    #: Gradient accumulation's window (``_window.Window``; None: not guarded by capture), and whether
    #: the DDP may defer a synchronisation at all (``defers``, inline on a step's path).
    window: Any
    deferrable: bool

    def for_call(
        self, module: torch.nn.Module, args: tuple = (), kwargs: dict | None = None
    ) -> torch.nn.parallel.DistributedDataParallel | None: ...

    def explain(self, error: RuntimeError, module: torch.nn.Module) -> BaseException: ...

    def count_bypass(self, grad: torch.Tensor) -> None: ...

    def defers(self, ddp: torch.nn.parallel.DistributedDataParallel) -> bool: ...

    def watch_submodules(self, module: torch.nn.Module) -> None: ...


class _Thread:
    """One thread's state of the call routing: inside DDP's forward, and how many DDP calls ran."""

    __slots__ = ("calls", "inside")

    def __init__(self) -> None:
        self.inside = False
        self.calls = 0


class _Routing(threading.local):
    """Each thread's ``_Thread`` (one thread-local read per call: its attributes are plain slots)."""

    def __init__(self) -> None:
        self.here = _Thread()


_ROUTING = _Routing()


def _call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    replica = self.__dict__.get(REPLICA_ATTR)
    if replica is not None and replica.inside:  # DDP's forward calling the module: its own call
        plain = getattr(type(self), _class_swap.PLAIN_CLASS)
        if replica.updated_buffers.looking:
            # After DDP's buffer broadcast, which bumps every buffer's version on some torch
            # releases (2.4), so only the forward's updates count.
            return replica.updated_buffers.around(self, plain.__call__, args, kwargs)
        forward = bare_forward(self, plain)  # (no hook: ``forward`` without Module.__call__'s frames)
        return plain.__call__(self, *args, **kwargs) if forward is None else forward(*args, **kwargs)
    if torch.compiler.is_compiling():  # traced: a torch.compile result made after the wrapping
        return torch.compiler.disable(_adopt_compile)(self, args, kwargs)
    routing = _ROUTING.here
    if replica is None or routing.inside or not torch.is_grad_enabled():
        return getattr(type(self), _class_swap.PLAIN_CLASS).__call__(self, *args, **kwargs)
    current = CURRENT
    if replica.ready == current.parameter_events:  # nothing changed since the DDP was found current
        ddp = self.__dict__.get(DDP_ATTR)
    else:
        ddp = replica.for_call(self, args, kwargs)
    if ddp is None:
        return getattr(type(self), _class_swap.PLAIN_CLASS).__call__(self, *args, **kwargs)
    parts = None if current.sharded_data else _at_call.parts(replica, self, args, kwargs)
    if parts is not None:  # a batch drawn by hand: this rank's rows (``_at_call``)
        args, kwargs = _at_call.local_arguments(args, kwargs, parts)
    routing.inside = replica.inside = True
    routing.calls += 1
    replica.forwards += 1
    try:
        if parts is not None:  # its own random numbers for its rows (dropout), the caller's alike
            with _at_call.own_noise(parts, replica.forwards):
                result, synced = _forward(replica, ddp, args, kwargs)
        elif (  # (``_forward`` and ``replica.defers``, inline: every step's path)
            replica.watched
            and replica.window is not None
            and replica.deferrable
            and ddp.require_backward_grad_sync  # (the user's own no_sync stays as it is)
            and replica.window.defers(replica.forwards)
        ):
            result, synced = _deferred(ddp, args, kwargs), False
        else:
            forward = bare_forward(ddp, type(ddp))  # (no hook: DDP's forward without its frames)
            result = ddp(*args, **kwargs) if forward is None else forward(*args, **kwargs)
            synced = ddp.require_backward_grad_sync
        if replica.watched:  # an optimizer's guard reads which backward passes DDP averaged
            ledger = replica.reduction
            if synced and type(result) is Tensor and result.requires_grad:
                ledger.pending = True  # (``ledger.forwarded``'s usual step, inline)
                hook_output(result, ledger.reached)
            else:
                ledger.forwarded(result, synced)
        if current.split_weight is not None:  # split_batches: this rank's part weighs its share
            _split.weigh(result, current.split_weight)
        if parts is not None:
            result = _at_call.whole(result, parts)
        return result
    except RuntimeError as error:
        explained = replica.explain(error, self)
        if explained is error:
            raise
        raise explained from error
    finally:
        routing.inside = replica.inside = False


def _forward(replica: Replica, ddp: Any, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """The DDP's forward, and whether its backward synchronises (gradient accumulation: ``_window``)."""
    if replica.watched and replica.defers(ddp):
        return _deferred(ddp, args, kwargs), False
    return ddp(*args, **kwargs), ddp.require_backward_grad_sync


def _deferred(ddp: torch.nn.parallel.DistributedDataParallel, args: tuple, kwargs: dict) -> Any:
    """A forward through ``ddp`` whose backward leaves the gradients local (DDP's ``no_sync``).

    DDP still broadcasts its buffers before the next forward, as after a synchronised one: the
    forwards see what they see when every backward synchronises.
    """
    ddp.require_backward_grad_sync = False
    try:
        return ddp(*args, **kwargs)
    finally:
        ddp.require_backward_grad_sync = True
        ddp.require_forward_param_sync = True


def _adopt_compile(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """A call that torch.compile was tracing: autoddp's routing and DDP run untraced, as always.

    ``torch.compile(model)`` after autoddp wrapped ``model`` (after the optimizer) gets what
    compiling it before gives: the module's own calls compiled in place with the result's
    settings, the result calling through the module. A module traced inside another compiled
    module runs uncompiled, and says so.
    """
    result = _compat.compile_result_calling(module)
    parts = None if result is None else _compat.compiled_parts(result)
    if parts is not None:
        _compat.compile_in_place(module, parts[1])
        _class_swap.redirect_compiled(result)
    else:
        _warn.warn(
            f"{type(module).__name__} runs uncompiled: torch.compile traced it inside another module "
            f"after autoddp had wrapped it, and its DDP cannot run inside a compiled graph: compile "
            f"the {type(module).__name__} itself (model = torch.compile(model)), not a module around it"
        )
    return _call(module, *args, **kwargs)


def _no_sync(self: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Skip gradient synchronisation inside the block (gradient accumulation); DDP's ``no_sync``.

    A no-op where there is nothing to synchronise (one process, nothing to train).
    """
    replica = self.__dict__.get(REPLICA_ATTR)
    ddp = replica.for_call(self) if replica is not None else None
    return ddp.no_sync() if ddp is not None else contextlib.nullcontext()


class NoSyncAnywhere:
    """``no_sync`` for every module (on ``torch.nn.Module``, while one process runs the user's
    code): a no-op context, nothing being synchronised, so gradient-accumulation code written for
    several processes runs unchanged. A submodule, parameter or buffer named ``no_sync`` wins."""

    def __get__(self, module: Any, owner: type | None = None) -> Any:
        if module is None:
            return self
        for table in ("_modules", "_parameters", "_buffers"):
            held = module.__dict__.get(table)
            if held and "no_sync" in held:
                return held["no_sync"]
        return contextlib.nullcontext


def no_sync_at_one_process() -> _patches.Patches:
    """``model.no_sync()`` on every module while the user's code runs in one process (a no-op
    context; ``with`` this unit), where no model is wrapped: accumulation code runs unchanged."""
    return _patches.Patches([(torch.nn.Module, "no_sync", NoSyncAnywhere())])


def _watched(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a user method so that computing with gradients while bypassing DDP warns once."""

    @functools.wraps(method)
    def watched(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        routing = _ROUTING.here
        if routing.inside or not torch.is_grad_enabled() or DDP_ATTR not in self.__dict__:
            return method(self, *args, **kwargs)
        calls = routing.calls
        result = method(self, *args, **kwargs)
        if routing.calls == calls and _carries_grad(result):
            _warn.warn(
                f"{type(self).__name__}.{name}() computed a result with gradients without calling the "
                f"model itself, so DDP did not see it: those gradients are averaged across processes "
                f"only before the step of an optimizer autoddp found (capture), not otherwise. Call "
                f"self(...) inside {name}(), or compute through the model's forward."
            )
        return result

    return watched


def _carries_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.grad_fn is not None
    if isinstance(value, (list, tuple)):
        return any(_carries_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_carries_grad(v) for v in value.values())
    return False


def _user_methods(cls: type) -> Iterator[tuple[str, Callable[..., Any]]]:
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass is torch.nn.Module or not issubclass(klass, torch.nn.Module):
            break
        for name, attr in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if isinstance(attr, types.FunctionType) and not name.startswith("_") and name != "forward":
                yield name, attr


@functools.cache
def swapped_class(cls: type, strategy: str) -> type:
    """A subclass of ``cls`` with the same name whose calls go through the instance's DDP."""
    namespace: dict[str, Any] = {
        "__call__": _call,
        "__reduce_ex__": _class_swap.plain_reduce,
        "no_sync": _no_sync,
        _class_swap.PLAIN_CLASS: cls,
        "_autoddp_strategy": strategy,
    }
    for name, method in _user_methods(cls):
        namespace[name] = _watched(name, method)
    return _class_swap.cached_subclass(cls, namespace)


def swap(module: torch.nn.Module, strategy: str) -> None:
    """Give ``module`` its swapped class (idempotent; a watched submodule becomes a root)."""
    _unwatch(module)
    if _class_swap.PLAIN_CLASS not in type(module).__dict__:
        module.__class__ = swapped_class(type(module), strategy)


def unswap(module: torch.nn.Module) -> None:
    """Give ``module`` its own class back and drop autoddp's attributes (its submodules' too)."""
    for sub in module.modules():
        _unwatch(sub)
    for name in _PRIVATE:
        module.__dict__.pop(name, None)
    plain = type(module).__dict__.get(_class_swap.PLAIN_CLASS)
    if plain is not None:
        module.__class__ = plain


class _Watch:
    """A watched submodule's call: counts backward passes through its calls outside DDP.

    A call with gradients outside the DDP's forward hooks its output; the count moves when a
    backward reaches it (an auxiliary loss), not for a forward nobody trains with (a metric, a
    log line on one rank), so every rank agrees on it; not in a backward pass (the reentrant
    checkpoint's recomputation, which DDP averages). ``module(...)`` runs the bound ``__call__``
    (``_compat.route_calls``), which runs what the call ran before (``before``: a
    ``Module.compile()`` of the user's, else its own call).
    Pickles and copies of the submodule leave it out: they hold what one process's hold.
    """

    __slots__ = ("before", "calls", "replica")

    def __init__(self, module: torch.nn.Module, replica: Replica | None) -> None:
        self.replica = replica
        self.before = _compat.routed_call(module)
        self.calls = self.before if self.before is not None else _compat.own_call(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replica = self.replica
        if (
            replica is None
            or replica.inside
            or not torch.is_grad_enabled()
            or CURRENT.backward_kind is not None  # recomputed in a backward pass (reentrant checkpoint)
        ):
            return self.calls(*args, **kwargs)
        result = self.calls(*args, **kwargs)
        on_backward(result, replica.count_bypass)
        return result


def on_backward(value: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """Hook every tensor in ``value`` (nested lists, tuples, dicts, dataclasses, and the attributes of
    an object that is none of them: a ``torch.distributions`` one, a namespace) a backward may reach."""
    for item in _containers.leaves(value):
        opaque = hasattr(item, "__dict__") and not isinstance(item, (torch.Tensor, type, torch.nn.Module))
        for inner in _containers.leaves(list(vars(item).values())) if opaque else (item,):
            if isinstance(inner, torch.Tensor) and inner.requires_grad:
                hook_output(inner, hook)


def _watcher(module: torch.nn.Module) -> _Watch | None:
    found = getattr(_compat.routed_call(module), "__self__", None)
    return found if isinstance(found, _Watch) else None


def watch(root: torch.nn.Module, replica: Replica) -> None:
    """Have every submodule of ``root`` that owns parameters count its calls DDP cannot see.

    Those that own none need no watcher: calling one (``model.encoder``) calls the ones that do.
    """
    for sub in root.modules():
        if sub is root or _class_swap.PLAIN_CLASS in type(sub).__dict__:
            continue  # a root of its own
        watcher = _watcher(sub)
        if watcher is not None:
            watcher.replica = replica
        elif _compat.owns_parameters(sub) and _pickles_without_routing(sub):
            _compat.route_calls(sub, _Watch(sub, replica).__call__)


def _pickles_without_routing(module: torch.nn.Module) -> bool:
    """Whether ``module``'s pickle leaves a routed call out: ``Module.__getstate__`` does, a class
    pickling its whole ``__dict__`` (torch's RNN layers) does not, and is left unwatched
    (docs/guide/capture.md)."""
    return type(module).__getstate__ is torch.nn.Module.__getstate__


def _unwatch(module: torch.nn.Module) -> None:
    watcher = _watcher(module)
    if watcher is not None:
        _compat.route_calls(module, watcher.before)


def split_decisions() -> list[tuple[torch.nn.Module, bool | str]]:
    """Each wrapped model whose call met a batch the same on every rank: True where it is split at
    its call (``_at_call``), else why not."""
    found = []
    for model in CURRENT.wrapped_models():
        replica = model.__dict__.get(REPLICA_ATTR)
        state = getattr(replica, "at_call", None)
        if state is not None:
            found.append((model, state if isinstance(state, str) else True))
    return found
