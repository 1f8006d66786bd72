"""Capture: distribute the models, loaders and saves a plain single-GPU function or script makes.

While the user's code runs in a world of several processes, a ``Session`` watches, through
patches it installs and removes around that code only:

- ``torch.optim.Optimizer.__init__``: the modules owning the optimizer's parameters are wrapped as
  ``prepare`` wraps them, where they are (``optimizers``);
- ``DataLoader.__iter__`` and ``__len__``: a random loader is sharded at its first iteration (or
  when its length is first asked, as a scheduler's steps per epoch), an ordered one left whole
  (``loaders``);
- ``torch.save`` to a path: written once, by rank 0, atomically (``saves``);
- ``DistributedDataParallel.__init__``: a user's own DDP around a captured model takes over from
  autoddp's (never two);
- in a script, ``init_process_group``: the user's own group turns capture off (a torchrun-style
  script is left alone), one called after autoddp had to make the group is a clear error.

In a script the process group is made at the first moment capture needs it (``join``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from autoddp import _compat, _warn, models
from autoddp.capture import loaders, optimizers
from autoddp.capture._notice import Notice, where
from autoddp.capture._registry import Registry, user_site
from autoddp.capture.passes import Passes
from autoddp.capture.saves import Saves, opened_path
from autoddp.errors import ConfigurationError
from autoddp.models import optimizers as model_optimizers
from autoddp.state import CURRENT, RunOptions, World

_LOADER_SEED = "autoddp/capture/loader-seed/"


class Session:
    """One capture session: the patches, what was found, and the world (joined lazily in scripts)."""

    def __init__(
        self,
        options: RunOptions,
        world: World | None = None,
        join: Callable[[], World] | None = None,
    ) -> None:
        self.options = options
        self._world = world
        self._join = join
        self.made_group = False
        self.registry = Registry()
        self.busy = False
        self._patches: list[tuple[Any, str, Any]] = []
        self._loaders = 0
        self.notice: Notice | None = None
        self.saves: Saves | None = None
        self.passes = Passes()  # batches per pass of IterableDataset loaders: who ran out first
        if world is not None:
            self.world()

    # --- lifecycle ----------------------------------------------------------------------------

    def install(self) -> None:
        CURRENT.capture = self
        self.registry.install()
        self._patch(torch.optim.Optimizer, "__init__", self._optimizer_init)
        self._patch(DataLoader, "__iter__", self._loader_iter)
        self._patch(DataLoader, "__len__", self._loader_len)
        self._patch(torch.nn.parallel.DistributedDataParallel, "__init__", self._ddp_init)
        for owner in (torch, torch.serialization):
            self._patch(owner, "save", self._save)
        if self._join is not None:  # a script: the user may make the group themselves
            for owner in (dist, dist.distributed_c10d):
                self._patch(owner, "init_process_group", self._init_process_group)

    def uninstall(self) -> None:
        if self.saves is not None:
            self.saves.finish()  # rank 0's code has ended: no rank waits for its saves any more
        self.passes.write()
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches = []
        self.registry.uninstall()
        if CURRENT.capture is self:
            CURRENT.capture = None

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        self._patches.append((owner, name, original))
        setattr(owner, name, functools.wraps(original)(make(original)))

    @contextlib.contextmanager
    def _own_work(self) -> Iterator[None]:
        """autoddp's own work inside a hook: no hook reacts to it."""
        self.busy, self.registry.paused = True, True
        try:
            yield
        finally:
            self.busy, self.registry.paused = False, False

    def world(self) -> World:
        """The world the user's code runs in (joining it now in a script that has not yet)."""
        if self._world is None:
            assert self._join is not None
            self._world = self._join()
            self.made_group = True
        if self.notice is None:
            self.notice = Notice(self._world.rank, self._world.world_size)
            self.saves = Saves(
                self._world.rank, self._world.local_rank, self._world.world_size, self._world.local_world_size
            )
        return self._world

    # --- the hooks ----------------------------------------------------------------------------

    def _optimizer_init(self, original: Any) -> Any:
        def __init__(optimizer: Any, params: Any, *args: Any, **kwargs: Any) -> None:
            if self.busy:
                original(optimizer, params, *args, **kwargs)
                return
            params = self._distribute_models(params)
            original(optimizer, params, *args, **kwargs)
            model_optimizers.bind(optimizer)  # over sharded parameters: full state loads into shards
            models.guard_optimizer(optimizer)  # steps DDP did not see still get averaged gradients

        return __init__

    def _distribute_models(self, params: Any) -> Any:
        items = optimizers.materialize(params)
        found, orphans = optimizers.roots(optimizers.tensors_of(items), self.registry)
        todo = [root for root in found if not models.distributed(root)]
        if orphans:
            shapes = ", ".join(str(tuple(p.shape)) for p in orphans[:5])
            _warn.warn(
                f"{len(orphans)} of this optimizer's parameters (shapes {shapes}) belong to no "
                "nn.Module, so autoddp cannot average their gradients across processes: make them "
                "attributes of a module (self.w = nn.Parameter(...)), or pass the module to autoddp.prepare"
            )
        if not todo:
            return items
        site = user_site(sys._getframe(1))
        with self._own_work():
            world = self.world()
            mapping = optimizers.replaced_parameters(
                todo, lambda m: models.wrap(m, world, self.options, move=False)
            )
        assert self.notice is not None
        for root in todo:
            name = type(models.unwrap(root)).__name__
            self.notice.say(
                ("model", id(root)),
                f"{name} ({where(self.registry.site(root))}): {self.options.strategy.upper()} across "
                f"{world.world_size} processes, found through the optimizer at {where(site)}",
            )
        return optimizers.rebind(items, mapping)

    def _loader_iter(self, original: Any) -> Any:
        def __iter__(loader: DataLoader) -> Any:
            if not self.busy and not loader.__dict__.get("_autoddp_seen"):
                loader.__dict__["_autoddp_seen"] = True
                self._shard(loader, user_site(sys._getframe(1)))
            return self.passes.watch(loader, original)

        return __iter__

    def _loader_len(self, original: Any) -> Any:
        def __len__(loader: DataLoader) -> int:
            # len(loader) before the first pass (a scheduler's steps per epoch) is this rank's share
            if not self.busy and not loader.__dict__.get("_autoddp_seen"):
                loader.__dict__["_autoddp_seen"] = True
                self._shard(loader, user_site(sys._getframe(1)))
            return original(loader)

        return __len__

    def _shard(self, loader: DataLoader, site: tuple[str, int]) -> None:
        kind = loaders.kind(loader)
        if kind == "distributed":
            return  # prepared, or the user's own DistributedSampler: as it is
        if kind != "random":
            if self.notice is not None:  # (a script that made no group yet has nothing to say)
                line = f"DataLoader ({where(site)}): left whole: {loaders.REASONS[kind]}"
                self.notice.say(("loader", id(loader)), line, captured=False)
            return
        from autoddp.data import shard_loader, user_seed

        with self._own_work():
            world = self.world()
            assert self.notice is not None
            if _compat.loader_iterator(loader) is not None:
                reason = "already iterated with persistent workers before autoddp saw it"
                line = f"DataLoader ({where(site)}): left whole: {reason}"
                self.notice.say(("loader", id(loader)), line, captured=False)
                return
            shard_loader(loader, world, seed=self._shared_seed(user_seed(loader), world))
        self.notice.say(
            ("loader", id(loader)),
            f"DataLoader ({where(site)}): sharded, each process takes 1/{world.world_size} of every epoch",
        )

    def _shared_seed(self, seed: int, world: World) -> int:
        """Rank 0's shuffle seed for this loader, through the store: rank 0 never waits for it."""
        number, self._loaders = self._loaders, self._loaders + 1
        store = _compat.default_store()
        key = f"{_LOADER_SEED}{number}"
        if world.rank == 0:
            store.set(key, str(seed))
            return seed
        store.wait([key])
        return int(store.get(key).decode())

    def _save(self, original: Any) -> Any:
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            path = f if isinstance(f, (str, os.PathLike)) else opened_path(f)  # open(path, "wb") too
            if self.busy or path is None:
                return original(obj, f, *args, **kwargs)
            with self._own_work():
                self.world()
                assert self.saves is not None and self.notice is not None
                obj = model_optimizers.full_tensors(obj)  # sharded (FSDP) state: gathered whole
                what = self.saves.save(original, obj, path, args, kwargs, opened=None if path is f else f)
            path = os.fspath(path)
            self.notice.say(("save", os.path.abspath(path)), f"torch.save({path!r}): {what}")
            return None

        return save

    def _ddp_init(self, original: Any) -> Any:
        def __init__(ddp: Any, module: Any, *args: Any, **kwargs: Any) -> None:
            if not self.busy:
                inner = models.unwrap(module)
                if models.ddp_in_charge(inner):
                    models.release(inner)  # the user's own DDP takes over: never two
            original(ddp, module, *args, **kwargs)

        return __init__

    def _init_process_group(self, original: Any) -> Any:
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            if self.busy:  # autoddp joining the world for the script
                return original(*args, **kwargs)
            if self.made_group:
                raise ConfigurationError(
                    "this script calls init_process_group after autoddp had already made the process "
                    "group for it (at its first optimizer over a model, shuffled loader or torch.save). "
                    "Call init_process_group at the start of the script, before building the model, "
                    "or run it with autoddp --no-capture"
                )
            result = original(*args, **kwargs)
            self.uninstall()  # a torchrun-style script: left entirely alone from here on
            return result

        return init_process_group


@contextlib.contextmanager
def capturing(options: RunOptions, world: World) -> Iterator[None]:
    """Capture for the block when ``world`` has several processes and capture is on (once)."""
    if world.world_size <= 1 or not options.capture or CURRENT.capture is not None:
        yield
        return
    session = Session(options, world=world)
    session.install()
    try:
        yield
    finally:
        session.uninstall()
