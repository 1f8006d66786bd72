"""Models found through their optimizers: the root modules owning an optimizer's parameters.

When an optimizer is constructed (``torch.optim.Optimizer.__init__``, which every optimizer calls)
the parameters it is given are traced to the modules that own them and up to their root
(``Registry``, else the user's frames); each root not yet distributed is wrapped as
``autoddp.prepare`` wraps it, but where it is (nothing is moved), before the optimizer stores the
parameters. A strategy that replaces parameters (sharding) gets the optimizer bound to the new ones.
``Optimizers`` owns the two hooks (``__init__``, and ``add_param_group`` for a head added later).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from autoddp.core import _patches, _warn
from autoddp.core.memory.optimizers import groups_made
from autoddp.core.state import CURRENT
from autoddp.in_rank import models
from autoddp.in_rank.capture._notice import where
from autoddp.in_rank.capture._registry import DEPTH, Registry, frame_candidates, user_site

#: Containers that cannot be called: a model held in one is the model, not the container.
_UNCALLABLE = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)


class Optimizers:
    """The optimizer hooks of one capture session: the models an optimizer is made over are distributed."""

    def __init__(self, session: Any) -> None:
        """``session``: the capture ``Session`` (its registry, options, notice and world)."""
        self.session = session
        self.made = 0  # optimizers made by the user's code, in this session
        self._constructing: set[int] = set()  # optimizers in __init__ (its add_param_group calls)
        self._patches = _patches.Patches()

    def install(self) -> None:
        patches = [
            (torch.optim.Optimizer, "__init__", self._optimizer_init),
            (torch.optim.Optimizer, "add_param_group", self._add_param_group),
        ]
        self._patches.install(_patches.wrapping(owner, name, make) for owner, name, make in patches)

    def uninstall(self) -> None:
        self._patches.restore()

    def _optimizer_init(self, original: Any) -> Any:
        def __init__(optimizer: Any, /, params: Any, *args: Any, **kwargs: Any) -> None:
            if self.session.busy or CURRENT.alone:  # (in a rank0() body rank 0 trains alone)
                original(optimizer, params, *args, **kwargs)
                return
            self.made += 1
            defaults = (
                args[0] if args else kwargs.get("defaults", {})
            )  # (Optimizer.__init__(params, defaults))
            params = self._distribute_models(params, (type(optimizer), dict(defaults)))
            self._constructing.add(id(optimizer))  # its own add_param_group calls: done above
            try:
                original(optimizer, params, *args, **kwargs)
            finally:
                self._constructing.discard(id(optimizer))
            models.bind_optimizer(optimizer)  # over sharded parameters: full state loads into shards
            models.guard_optimizer(optimizer)  # steps DDP did not see still get averaged gradients
            models.measured_from_here()  # (strategy="auto": the first step's peak, from here)

        return __init__

    def _add_param_group(self, original: Any) -> Any:
        def add_param_group(optimizer: Any, /, param_group: Any) -> None:
            busy = self.session.busy or CURRENT.alone
            if busy or id(optimizer) in self._constructing or not isinstance(param_group, dict):
                original(optimizer, param_group)
                return
            made = (type(optimizer), dict(optimizer.defaults))
            original(optimizer, self._distribute_models([param_group], made)[0])  # a head added later
            models.bind_optimizer(optimizer)
            models.guard_optimizer(optimizer)

        return add_param_group

    def say_made_before(self, root: Any, optimizer: Any) -> None:
        """The notice's line for a model that an optimizer made before the call trains (wrapped
        where the call reached it, before capture began)."""
        found_through = f"the {type(optimizer).__name__} made before the call"
        self._say_wrapped(root, "made before the call", found_through)

    def _say_wrapped(self, root: Any, made: str, found_through: str) -> None:
        """The notice's one line for a model capture wrapped: where it was made, what found it."""
        session = self.session
        assert session.notice is not None
        session.notice.say(
            ("model", id(root)),
            f"{models.class_name(root)} ({made}): {models.strategy_label(root)} across "
            f"{session.world().world_size} processes, found through {found_through}"
            f"{models.split_note(root)}{models.plan_note(root)}",
            subject=root,
        )

    def _distribute_models(self, params: Any, made: tuple[type, dict] | None = None) -> Any:
        """``params`` over the models they belong to, distributed; ``made``: the optimizer's class and
        its defaults (its state is weighed by strategy="auto")."""
        session = self.session
        items = materialize(params)
        found, orphans = roots(tensors_of(items), session.registry)
        todo = [root for root in found if not models.distributed(root)]
        if orphans:
            shapes = ", ".join(str(tuple(p.shape)) for p in orphans[:5])
            _warn.warn(
                f"{len(orphans)} of this optimizer's parameters (shapes {shapes}) belong to no "
                "nn.Module autoddp can find, so it cannot average their gradients across processes: "
                "either they are attributes of no module, or their module was built before the call "
                "and your code reaches it only in ways autoddp does not follow (a closure, more than "
                f"{DEPTH} attributes or container items deep). Pass the module to autoddp.prepare(model) "
                "before making the optimizer, or make loose tensors attributes of a module "
                "(self.w = nn.Parameter(...))"
            )
        if not todo:
            return items
        site = user_site(sys._getframe(1))
        with session.own_work():
            world = session.world()
            training = (made[0], groups_made(items, made[1])) if made else None
            mapping = replaced_parameters(
                todo, lambda m: models.wrap(m, world, session.options, move=False, training=training)
            )
        for root in todo:
            self._say_wrapped(root, where(session.registry.site(root)), f"the optimizer at {where(site)}")
        return rebind(items, mapping)


def materialize(params: Any) -> list[Any]:
    """The optimizer's ``params`` argument as a list (generators are read once, groups copied)."""
    items = list(params) if not isinstance(params, torch.Tensor) else [params]
    return [dict(item, params=_as_list(item["params"])) if isinstance(item, dict) else item for item in items]


def _as_list(params: Any) -> list[Any]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def tensors_of(items: list[Any]) -> list[torch.Tensor]:
    """Every parameter in a materialized ``params`` argument (plain, named, or in groups)."""
    found: list[torch.Tensor] = []
    for item in items:
        for entry in item["params"] if isinstance(item, dict) else [item]:
            tensor = entry[1] if isinstance(entry, tuple) else entry
            if isinstance(tensor, torch.Tensor):
                found.append(tensor)
    return found


def roots(params: list[torch.Tensor], registry: Registry) -> tuple[list[torch.nn.Module], list[torch.Tensor]]:
    """The root modules owning ``params`` (each once, in order) and the parameters no module owns."""
    found: dict[int, torch.nn.Module] = {}
    orphans: list[torch.Tensor] = []
    unknown: list[torch.Tensor] = []
    for param in params:
        owner = registry.owner(param)
        if owner is None:
            unknown.append(param)
            continue
        root = _climb(owner, registry)
        found.setdefault(id(root), root)
    if found:  # a part of a model wrapped before (pruned or replaced under capture): that model
        holders = _holders(CURRENT.wrapped_models())
        found = {id(m): m for m in (holders.get(id(root), root) for root in found.values())}
    if unknown:
        index = _frame_index(sys._getframe(1))
        for param in unknown:
            root = index.get(id(param))
            if root is None:
                orphans.append(param)
            else:
                found.setdefault(id(root), root)
    return list(found.values()), orphans


def _climb(module: torch.nn.Module, registry: Registry) -> torch.nn.Module:
    path = [module]
    while (parent := registry.parent(path[-1])) is not None:
        path.append(parent)
    for candidate in reversed(path):  # the outermost callable module on the way up
        if not isinstance(candidate, _UNCALLABLE):
            return candidate
    return module


def _holders(wrapped: list[torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """id(submodule) -> the wrapped model it is part of (the registry knows no parent above a
    model built before capture)."""
    holders: dict[int, torch.nn.Module] = {}
    for model in wrapped:
        for sub in models.unwrap(model).modules():
            holders.setdefault(id(sub), model)
    return holders


def _frame_index(frame: Any) -> dict[int, torch.nn.Module]:
    """Parameter id -> the outermost module holding it, among modules the user's frames reach."""
    candidates = list(frame_candidates(frame))
    inner = {id(sub) for module in candidates for sub in module.modules() if sub is not module}
    index: dict[int, torch.nn.Module] = {}
    for module in candidates:
        if id(module) in inner or isinstance(module, _UNCALLABLE):
            continue
        for param in module.parameters():
            index.setdefault(id(param), module)
    return index


def rebind(items: list[Any], mapping: dict[int, torch.Tensor]) -> list[Any]:
    """``items`` with each parameter replaced by ``mapping[id(param)]`` where a strategy replaced it."""
    if not mapping:
        return items

    def swap(entry: Any) -> Any:
        if isinstance(entry, tuple):
            return (entry[0], mapping.get(id(entry[1]), entry[1]))
        return mapping.get(id(entry), entry)

    return [
        dict(item, params=[swap(e) for e in item["params"]]) if isinstance(item, dict) else swap(item)
        for item in items
    ]


def replaced_parameters(
    roots_: Iterable[torch.nn.Module], wrap: Callable[[torch.nn.Module], torch.nn.Module]
) -> dict[int, torch.Tensor]:
    """Wrap each root; id(old parameter) -> new parameter for those the wrapping replaced."""
    mapping: dict[int, torch.Tensor] = {}
    for root in roots_:
        before = list(root.named_parameters())
        wrapped = wrap(root)
        after = dict(wrapped.named_parameters())
        for name, old in before:
            new = after.get(name)
            if new is not None and new is not old:
                mapping[id(old)] = new
    return mapping
