"""Every use of a private torch (or elastic, dynamo, CPython) internal, in one place.

Each function here wraps one internal that has no public equivalent, checks that it is still
there and raises ``TorchCompatibilityError`` naming it when a torch release changed it: never a
silent fallback. ``tests/core/test_compat.py`` exercises each one against the installed torch, so an
upgrade that breaks one fails there, loudly, before it can fail a user's run.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch

from autoddp.core._compat import ddp_errors, losses, releases  # noqa: F401 (read as _compat.losses, ...)
from autoddp.core._compat.releases import torch_at_least
from autoddp.core.errors import TorchCompatibilityError

#: The private function DDP's forward uses to broadcast buffers from rank 0 (a collective).
DDP_BUFFER_BROADCAST = "_broadcast_coalesced"


def _need(owner: Any, name: str, what: str) -> Any:
    """``owner.name``, or a TorchCompatibilityError saying what autoddp needed it for."""
    try:
        return getattr(owner, name)
    except AttributeError:
        label = getattr(owner, "__name__", type(owner).__name__)
        raise TorchCompatibilityError(
            f"autoddp needs {label}.{name} ({what}), and torch {torch.__version__} does not have it: "
            "this torch release changed an internal autoddp relies on. Use a torch version autoddp "
            "supports, or report it to autoddp with this message"
        ) from None


#: Where DTensor lives (public from torch 2.5; before, in ``torch.distributed._tensor``).
DTENSOR_MODULE = "torch.distributed.tensor" if torch_at_least((2, 5)) else "torch.distributed._tensor"


def store_listening_on_socket() -> dict[str, Any]:
    """What a ``TCPStore`` given a bound socket needs: the classic backend before 2.8 (libuv refuses)."""
    return {} if torch_at_least(releases.LIBUV_LISTEN_FD) else {"use_libuv": False}


def store_address_in_use() -> type[Exception]:
    """What rank 0's store raises when its port is taken (its message says EADDRINUSE)."""
    import torch.distributed as dist

    typed = torch_at_least(releases.STORE_ERRORS_TYPED)
    return _need(dist, "DistNetworkError", "to tell a port in use") if typed else RuntimeError


def accelerator() -> Any:
    """``torch.accelerator`` (torch >= 2.6), or None on a torch that has none."""
    return (
        _need(torch, "accelerator", "to see a script pick a GPU")
        if torch_at_least(releases.ACCELERATOR)
        else None
    )


def fsdp2_release(device_type: str | None) -> tuple[int, int] | None:
    """The torch release FSDP2 needs on ``device_type`` (None: on GPUs), or None where this one has it."""
    if not torch_at_least(releases.FSDP2):
        return releases.FSDP2
    return (
        releases.FSDP2_ON_CPU if device_type == "cpu" and not torch_at_least(releases.FSDP2_ON_CPU) else None
    )


def backends_to_outlive(group: Any) -> list[Any]:
    """The backends of ``group`` that must outlive it (held while it goes, dropped after it): before
    2.8 a dropped ``ProcessGroup`` frees them with the GIL held while a gloo thread may wait for it
    (a deadlock); a backend's own Python object lets go of the GIL as it ends gloo's threads."""
    if torch_at_least(releases.GROUP_FREED_WITHOUT_GIL):
        return []
    return _backends(group, "to end gloo's threads without a deadlock")


#: torch.distributed's collectives by name: each hangs when one rank calls it alone (rank0()
#: refuses them in its body; the hang report marks them).
COLLECTIVES = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


def default_store() -> Any:
    """The key-value store of the default process group (rank 0 publishes rank0() outcomes there)."""
    import torch.distributed as dist

    getter = _need(dist.distributed_c10d, "_get_default_store", "to reach the process group's store")
    return getter()


def ddp_buffer_broadcast() -> Any:
    """``torch.distributed._broadcast_coalesced``, which rank0() refuses inside its body."""
    import torch.distributed as dist

    return _need(dist, DDP_BUFFER_BROADCAST, "DDP's buffer broadcast, refused inside rank0() bodies")


def forked_exit_codes(context: Any) -> dict[int, int | None]:
    """Exit status of each forked worker of an elastic ``MultiprocessContext``, by local rank.

    Elastic reports the status of failed workers only; the triage also needs those it stopped.
    """
    processes = _need(context, "_pc", "the forked workers' exit codes")
    if processes is None:  # the context never started
        return {}
    return {rank: process.exitcode for rank, process in enumerate(processes.processes)}


def loader_iterator(loader: torch.utils.data.DataLoader) -> Any:
    """The iterator a DataLoader keeps between epochs (persistent workers), or None."""
    return _need(loader, "_iterator", "to tell whether a DataLoader's persistent workers started")


def _version(tensor: torch.Tensor) -> int:
    return int(_need(tensor, "_version", "to tell whether a backward changed a gradient"))


#: ``version(tensor)``: a tensor's version counter, which moves with every in-place change (a
#: gradient accumulating). Read on a step's path: torch's C getter itself where torch has it.
version: Callable[[torch.Tensor], int] = (
    operator.attrgetter("_version") if hasattr(torch._C.TensorBase, "_version") else _version
)


def set_iterator_order(iterator: Any, index_sampler: Any) -> None:
    """Have a DataLoader's kept iterator (persistent workers) draw its next pass from ``index_sampler``."""
    _need(iterator, "_index_sampler", "to give a persistent-workers DataLoader the order of its next pass")
    iterator._index_sampler = index_sampler


def compiled_parts(model: Any) -> tuple[torch.nn.Module, Any] | None:
    """(module, compile context) inside a ``torch.compile`` result; None for anything else.

    Recognised by its class name, so that checking does not import dynamo (seconds).
    """
    if type(model).__name__ != "OptimizedModule":
        return None
    inner = _need(model, "_orig_mod", "the module inside a torch.compile result")
    context = _need(model, "dynamo_ctx", "the compile settings of a torch.compile result")
    return inner, context


def compiled_inner(model: Any) -> torch.nn.Module:
    """The module inside a ``torch.compile`` result (called on every forward of a swapped one)."""
    return model._orig_mod


def initialiser(module: torch.nn.Module) -> Any:
    """The module's own initialiser: ``reset_parameters`` (``_reset_parameters`` in torch's
    attention), or None."""
    return getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)


def owns_parameters(module: torch.nn.Module) -> bool:
    """Whether ``module`` registered parameters itself (a None one, ``bias=None``, counts)."""
    return bool(module._parameters)


def dynamo_imported() -> bool:
    """Whether torch.compile's engine is imported in this process already."""
    return "torch._dynamo" in sys.modules


def import_dynamo() -> None:
    """Import torch.compile's engine (about 800 modules, seconds): once, before workers fork."""
    importlib.import_module("torch._dynamo")


def compile_in_place(module: torch.nn.Module, context: Any) -> None:
    """Make ``module``'s own calls compiled with ``context``, as ``torch.compile(module)`` did.

    ``Module.compile()`` does the same through these internals; dynamo does not trace torch.nn's
    own ``_call_impl`` frame unless wrapped with ``wrap_inline``, as torch.compile wraps it. The
    call is the class's ``_call_impl`` given the module, not its bound method: torch 2.4's dynamo
    does not inline a built-in layer's bound call and recurses into it forever (one graph on
    every release this way).
    """
    from torch._dynamo import external_utils

    wrap_inline = _need(external_utils, "wrap_inline", "to keep a model's torch.compile compilation")
    call_impl = _need(type(module), "_call_impl", "to keep a model's torch.compile compilation")
    _need(module, "_compiled_call_impl", "to keep a model's torch.compile compilation")
    module._compiled_call_impl = context(wrap_inline(functools.partial(call_impl, module)))


def compile_result_calling(module: torch.nn.Module) -> torch.nn.Module | None:
    """The ``torch.compile`` result whose call is running now with ``module`` inside; None if none.

    Found among the callers' frames of dynamo's ``OptimizedModule.__call__`` (its ``self``): a result
    made over a module after autoddp wrapped it has no other way back to its compile settings.
    """
    from torch._dynamo import eval_frame

    optimized = _need(eval_frame, "OptimizedModule", "the class of a torch.compile result")
    code = _need(optimized, "__call__", "the call of a torch.compile result").__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            result = frame.f_locals.get("self")
            if result is not None and compiled_parts(result) is not None and result._orig_mod is module:
                return result
        frame = frame.f_back
    return None


def routed_call(module: torch.nn.Module) -> Any:
    """What ``module(...)`` runs instead of its own call (``route_calls``, ``Module.compile()``); or None."""
    _need(torch.nn.Module, "_compiled_call_impl", "to see calls of a submodule")
    return module.__dict__.get("_compiled_call_impl")


def own_call(module: torch.nn.Module) -> Any:
    """``module``'s own call (hooks and ``forward``), which ``module(...)`` runs unless routed."""
    return _need(module, "_call_impl", "to see calls of a submodule")


def route_calls(module: torch.nn.Module, handler: Any) -> None:
    """Have ``module(...)`` run ``handler`` (None: its own call again), pickled with nothing of it.

    ``Module.__call__`` runs ``_compiled_call_impl`` when one is set (``Module.compile()`` sets
    it), and ``Module.__getstate__`` leaves it out of pickles and copies: a submodule keeps its
    class, and ``torch.save(model)`` writes what one process writes.
    """
    _need(torch.nn.Module, "_compiled_call_impl", "to see calls of a submodule")
    if handler is None:
        module.__dict__.pop("_compiled_call_impl", None)
    else:
        module.__dict__["_compiled_call_impl"] = handler


def run_atexit_hooks() -> None:
    """Run the interpreter's atexit hooks now (a worker then leaves with ``os._exit``)."""
    _need(atexit, "_run_exitfuncs", "to run atexit hooks before a fast exit")()


def clear_atexit_hooks() -> None:
    """Forget the atexit hooks inherited from the process this one was forked from."""
    _need(atexit, "_clear", "to drop a forked worker's inherited atexit hooks")()


def collectives_issued() -> int:
    """How many collectives this rank has issued on the default group (the same on every rank at
    the same point of the program): the sum of its backends' sequence numbers (gloo and NCCL)."""
    import torch.distributed as dist

    what = "to count the group's collectives"
    backends = _backends(_need(dist.distributed_c10d, "_get_default_group", what)(), what)
    return sum(int(_need(b, "_get_sequence_number_for_group", what)()) for b in backends)


def _backends(group: Any, what: str) -> list[Any]:
    """The backends of ``group`` (gloo's, NCCL's), each once."""
    get_backend = _need(group, "_get_backend", what)
    backends: dict[int, Any] = {}
    for device in ("cpu", "cuda"):
        try:
            backend = get_backend(torch.device(device))
        except (RuntimeError, ValueError):  # no backend for that device type
            continue
        backends[id(backend)] = backend
    return list(backends.values())


def batches_drawn(iterator: Any) -> int:
    """How many batches a DataLoader's iterator has yielded in its current pass."""
    return int(_need(iterator, "_num_yielded", "to count the batches of a DataLoader's pass"))


#: The marker left on ``torch.nn.Parameter`` once ``watch_parameter_changes`` patched it.
PARAMETER_WATCH = "_autoddp_watched"


def watch_parameter_changes(changed: Any) -> None:
    """Call ``changed()`` after every change a module's parameters can undergo outside a registration.

    Parameter registrations are seen through torch's public global hooks; what they do not see is
    hooked here, once per process: ``Parameter.data = ...`` and ``requires_grad`` (setters of
    ``torch._C.TensorBase``'s descriptors), ``requires_grad_()`` and ``detach_()`` (which clears
    ``requires_grad``), ``Module._apply`` (``.to()``, ``.half()``, ``.cuda()``: it may put a new
    ``Parameter`` straight into ``_parameters``), ``register_parameter(name, None)`` and
    ``__delattr__`` (parameters or submodules removed), and ``torch.utils.swap_tensors``. A read
    from Python still gets torch's own C getter, through a property (about 80 ns more); torch's
    C++ code (autograd, DDP's reducer, foreach kernels) reads the fields directly.
    """
    parameter = torch.nn.Parameter
    if PARAMETER_WATCH in parameter.__dict__:
        return
    base = _need(torch._C, "TensorBase", "to see parameters change")
    descriptors = {name: base.__dict__.get(name) for name in ("data", "requires_grad")}
    for name, descriptor in descriptors.items():
        if type(descriptor).__name__ != "getset_descriptor" or name in parameter.__dict__:
            raise TorchCompatibilityError(
                f"autoddp needs torch._C.TensorBase.{name} to be the C attribute that nn.Parameter "
                f"inherits (to see parameters change), and torch {torch.__version__} changed it. Use a "
                "torch version autoddp supports, or report it to autoddp with this message"
            )

    def setter(descriptor: Any) -> Any:
        def set_and_say(self: torch.Tensor, value: Any) -> None:
            descriptor.__set__(self, value)
            changed()

        return set_and_say

    def after(method: Any) -> Any:
        @functools.wraps(method)  # (its __wrapped__: the original, for tests/core/test_patches.py)
        def call_and_say(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            finally:
                changed()

        return call_and_say

    for name, descriptor in descriptors.items():
        setattr(parameter, name, property(descriptor.__get__, setter(descriptor), doc=descriptor.__doc__))
    parameter.requires_grad_ = after(_need(base, "requires_grad_", "to see parameters frozen"))
    parameter.detach_ = after(_need(base, "detach_", "to see parameters frozen"))
    module = torch.nn.Module
    for name in ("_apply", "register_parameter", "__delattr__"):
        setattr(module, name, after(_need(module, name, "to see a module's parameters change")))
    torch.utils.swap_tensors = after(_need(torch.utils, "swap_tensors", "to see parameters swapped"))
    setattr(parameter, PARAMETER_WATCH, True)


def parameter_changes_watched(parameter: Any) -> bool:
    """Whether every change of ``parameter`` reaches ``watch_parameter_changes``'s callback.

    True for ``nn.Parameter`` and its subclasses that keep the hooked attributes; False for a
    tensor subclass made a parameter (``Parameter(subclass)`` returns the subclass) or a class
    overriding one of them: their changes must be looked for.
    """
    cls = type(parameter)
    watched = torch.nn.Parameter.__dict__
    hooked = ("data", "requires_grad", "requires_grad_", "detach_")
    return PARAMETER_WATCH in watched and all(getattr(cls, name, None) is watched[name] for name in hooked)


def device_context() -> Any:
    """torch's default-device mode (``torch.utils._device.DeviceContext``): what both
    ``torch.set_default_device(d)`` and ``with torch.device(d):`` make (the latter from C++), so
    that the device it holds can be read where autoddp maps device indices."""
    import torch.utils._device as device_module

    context = _need(device_module, "DeviceContext", "to read the default device a script sets")
    init = getattr(context, "__init__", None)
    if getattr(init, "__code__", None) is None or init.__code__.co_varnames[:2] != ("self", "device"):
        raise TorchCompatibilityError(
            f"autoddp needs torch.utils._device.DeviceContext(device) (to read the default device a "
            f"script sets), and torch {torch.__version__} changed it. Use a torch version autoddp "
            "supports, or report it to autoddp with this message"
        )
    return context


class _EmptyPrefix(str):
    """An empty string that counts as set (elastic's agent tests the template for truth)."""

    def __bool__(self) -> bool:
        return True


def no_line_prefix() -> str:
    """A ``log_line_prefix_template`` for elastic's agent under which teed lines keep no prefix.

    The agent renders the template per rank only when it is truthy; left unset, its tail writes
    ``[default0]:`` before every line. An empty string that counts as set renders to ``""``
    (exercised through the agent itself: ``tests/launch/test_nodes.py``, a node with ``--log-dir``).
    """
    return _EmptyPrefix()
