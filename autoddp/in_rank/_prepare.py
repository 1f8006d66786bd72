"""``prepare``: make one object ready for the current world (models, loaders, containers).

A single-dispatch function, so other libraries can teach it their own types with
``@autoddp.prepare.register(TheirType)``. ``prepare_call`` readies a decorated call's arguments:
each one, the defaults it leaves out, and the models that optimizers made before the call train,
wherever the call reaches them (``self.model`` with ``self.opt``, an object passed in, a default;
under capture also a global or closure variable the function names).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from autoddp.core import _containers, _warn
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import CURRENT
from autoddp.in_rank.world import current


def prepare(obj: Any, *, split_batches: bool | None = None) -> Any:
    """Return ``obj`` ready for this process: models moved to its device and wrapped in DDP,
    DataLoaders sharded with a DistributedSampler, tuples, lists, dicts and dataclasses walked
    recursively.

    Anything else comes back unchanged. Outside a distributed run (one process) models are only
    moved to the device and loaders are left as they are. Register handlers for other types
    with ``@autoddp.prepare.register(TheirType)``. ``split_batches=True`` (default: the run's
    option): a shuffled loader's batches stay one process's, each process taking its part, and
    models use the global batch's BatchNorm statistics; pass the model and the loader together,
    ``autoddp.prepare((model, loader), split_batches=True)``.
    """
    if split_batches is None:
        return _prepare(obj)
    if not isinstance(split_batches, bool):
        raise ConfigurationError(f"split_batches={split_batches!r} must be True or False")
    previous = CURRENT.options
    if split_batches and previous.strategy == "fsdp":
        raise ConfigurationError(
            f"split_batches=True works with strategy='ddp' only (not {previous.strategy!r}) so far: "
            "use strategy='ddp', or leave split_batches off"
        )
    CURRENT.options = dataclasses.replace(previous, split_batches=split_batches)
    try:
        return _prepare(obj)
    finally:
        CURRENT.options = previous


@functools.singledispatch
def _prepare(obj: Any) -> Any:
    return _containers.map_items(obj, _prepare)


prepare.register = _prepare.register  # type: ignore[attr-defined]
prepare.registry = _prepare.registry  # type: ignore[attr-defined]
prepare.dispatch = _prepare.dispatch  # type: ignore[attr-defined]


@_prepare.register
def _prepare_module(obj: torch.nn.Module) -> torch.nn.Module:
    from autoddp.in_rank import models

    return models.wrap(obj, _joined_world(), CURRENT.options)


def _joined_world() -> Any:
    """The world a model is wrapped in, joined: under the command a script's group is made when
    first needed (capture joins it now); with none and no way to make it, an error that says how."""
    world = current()
    if world.world_size <= 1 or torch.distributed.is_initialized():
        return world
    session = CURRENT.capture
    if session is not None:
        with session.own_work():
            return session.world()
    raise ConfigurationError(
        f"autoddp.prepare(model) in a world of {world.world_size} processes whose process group is not "
        "made yet: call torch.distributed.init_process_group() before it (under "
        "`autoddp --no-capture` or torchrun the script makes its own group), or run the script under "
        "`autoddp` without --no-capture, where autoddp makes the group when first needed"
    )


@_prepare.register
def _prepare_optimizer(obj: torch.optim.Optimizer) -> torch.optim.Optimizer:
    from autoddp.in_rank import models

    return models.bind_optimizer(obj)  # over sharded parameters: loads full state into the shards


@_prepare.register
def _prepare_loader(obj: DataLoader) -> DataLoader:
    from autoddp.in_rank.data.loaders import shard_loader

    return shard_loader(obj, current())


def prepare_call(
    fn: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[tuple, dict, list[tuple[torch.nn.Module, torch.optim.Optimizer]]]:
    """``args`` and ``kwargs`` of a call of ``fn`` ready for this process: each prepared, the
    defaults the call leaves out too (passed explicitly where preparing gave a new object), and,
    in a world of several processes, the models that optimizers made before the call train
    (``_wrap_trained``); with those models, each beside its optimizer, for the notice."""
    args, kwargs = _with_prepared_defaults(fn, args, kwargs)
    args, kwargs = prepare(args), prepare(kwargs)
    wrapped: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = []
    if current().world_size > 1:
        reach = _reach(fn, args, kwargs, beyond_arguments=CURRENT.options.capture)
        wrapped = _wrap_trained(list(_containers.reachable(reach, _FOUND, skip=_LEAVES)))
    return args, kwargs, wrapped


#: What the walk of a call's reach looks for, and what it never goes into.
_FOUND = (torch.nn.Module, torch.optim.Optimizer)
_LEAVES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, torch.Tensor, DataLoader)
#: Containers that cannot be called: the models they hold are the models.
_UNCALLABLE = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)


def _with_prepared_defaults(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with ``fn``'s defaults prepared as arguments are (a model as a default is wrapped in
    place; a loader comes back as a new one, then passed explicitly)."""
    try:
        signature = inspect.signature(fn)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):  # no signature, or a wrong call: the call itself says what is wrong
        return args, kwargs
    changed: dict[str, Any] = {}
    for name, parameter in signature.parameters.items():
        if name in bound.arguments or parameter.default is inspect.Parameter.empty:
            continue
        prepared = prepare(parameter.default)
        if prepared is not parameter.default:
            changed[name] = prepared
    if not changed:
        return args, kwargs
    bound.apply_defaults()
    bound.arguments.update(changed)
    return bound.args, bound.kwargs


def _reach(fn: Callable[..., Any], args: tuple, kwargs: dict, beyond_arguments: bool) -> Iterator[Any]:
    """What a call of ``fn`` reaches: its arguments, ``self`` of a method (a module's own attributes
    too: ``self.opt`` beside its layers), its defaults and, ``beyond_arguments`` (under capture),
    the variables of its closure and the globals its code names."""
    yield args
    yield kwargs
    owner = getattr(fn, "__self__", None)
    yield owner
    if isinstance(owner, torch.nn.Module):
        yield [value for name, value in vars(owner).items() if not name.startswith("_")]
    func = inspect.unwrap(getattr(fn, "__func__", fn))
    yield getattr(func, "__defaults__", None)
    yield getattr(func, "__kwdefaults__", None)
    if not beyond_arguments:
        return
    for cell in getattr(func, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    code, namespace = getattr(func, "__code__", None), getattr(func, "__globals__", None)
    if isinstance(code, types.CodeType) and isinstance(namespace, dict):
        yield [namespace[name] for name in _names(code) if name in namespace]


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the functions defined inside it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _wrap_trained(found: list[Any]) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """Wrap, where they are, the models whose parameters the optimizers in ``found`` train (their
    outermost modules in ``found``), so that an optimizer made before the call is an optimizer;
    say which parameters belong to no model the call reaches. Returns each model wrapped here
    with the (first) optimizer that trains it."""
    from autoddp.in_rank import models

    optimizers = [item for item in found if isinstance(item, torch.optim.Optimizer)]
    if not optimizers:
        return []
    modules = [item for item in found if isinstance(item, torch.nn.Module)]
    models.rebind_optimizers(optimizers, modules)  # (over models among the arguments, sharded)
    owner = _outermost(list(modules))
    roots: dict[int, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        orphans = [p for p in params if id(p) not in owner]
        for p in params:
            if id(p) in owner:
                roots.setdefault(id(owner[id(p)]), (owner[id(p)], optimizer))
        if orphans:
            _say_orphans(optimizer, orphans)
    world = current()
    wrapped = []
    for root, optimizer in roots.values():
        if not models.distributed(root):
            models.wrap(root, world, CURRENT.options, move=False, optimizers=optimizers)
            wrapped.append((root, optimizer))
    for optimizer in optimizers:
        models.bind_optimizer(optimizer)
        models.guard_optimizer(optimizer)
    return wrapped


def _outermost(modules: list[torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """Parameter id -> the outermost of ``modules`` holding it (a container's items stand for it)."""
    callable_ = []
    while modules:
        module = modules.pop()
        if isinstance(module, _UNCALLABLE):
            modules.extend(module.children())
        else:
            callable_.append(module)
    inner = {id(sub) for module in callable_ for sub in module.modules() if sub is not module}
    owner: dict[int, torch.nn.Module] = {}
    for module in callable_:
        if id(module) not in inner:
            for param in module.parameters():
                owner.setdefault(id(param), module)
    return owner


def _say_orphans(optimizer: torch.optim.Optimizer, orphans: list[torch.Tensor]) -> None:
    shapes = ", ".join(str(tuple(p.shape)) for p in orphans[:5])
    _warn.warn(
        f"the {type(optimizer).__name__} made before this call trains {len(orphans)} parameters (shapes "
        f"{shapes}) of no model the call reaches (its arguments, self, its defaults, the globals and "
        "closure variables the function names, a few attributes deep), so autoddp cannot average "
        "their gradients: every process trains its own copy of them. Pass the model to the "
        "function (or keep it beside the optimizer, self.model), or make the optimizer inside it"
    )
