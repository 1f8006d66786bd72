"""Capture: distribute the models, loaders and saves a plain single-GPU function or script makes.

While the user's code runs in a world of several processes, a ``Session`` watches, through
patches it installs and removes around that code only:

- ``torch.optim.Optimizer.__init__`` and ``add_param_group``: the modules owning the optimizer's
  parameters are wrapped as ``prepare`` wraps them, where they are (``optimizers``);
- ``DataLoader.__init__``: the line that made a loader is remembered, for the notice;
- ``DataLoader.__iter__`` and ``__len__``: a random loader is sharded (or split) at its first
  iteration or length, an ordered one left whole; a pass that begins in an evaluation context
  gets all of a random loader (``loaders``);
- ``torch.save`` to a path: written once, by rank 0, atomically (``saves``);
- ``open`` for writing (an audit hook): the files several ranks wrote are named (``shared_files``);
- ``DistributedDataParallel.__init__``: a user's own DDP takes over from autoddp's (never two);
- ``torch.autograd.backward`` (its first call; each, and ``grad``, counted for ``models.counted``)
  and every optimizer step (global step hook): what could not be distributed is said (``_undistributed``);
- in a script, ``init_process_group``: the user's own group turns capture off, one called after
  autoddp had to make the group is a clear error.

In a script the process group is made at the first moment capture needs it (``join``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader

from autoddp import _compat, _patches, _warn, models
from autoddp.capture import devices, loaders, optimizers
from autoddp.capture._notice import Notice, where
from autoddp.capture._registry import DEPTH, Registry, user_site
from autoddp.capture._undistributed import Undistributed, caller_site, candidate_roots, grad_versions
from autoddp.capture.passes import Passes
from autoddp.capture.saves import Saves, saving
from autoddp.capture.shared_files import SharedFiles, install_hook
from autoddp.data import split
from autoddp.errors import ConfigurationError
from autoddp.state import CURRENT, RunOptions, World

#: Where the user's code made a DataLoader (kept in its ``__dict__``, for the notice).
_SITE = "_autoddp_site"


class Session:
    """One capture session: the patches, what was found, and the world (joined lazily in scripts)."""

    def __init__(
        self,
        options: RunOptions,
        world: World | None = None,
        join: Callable[[], World] | None = None,
        planned: World | None = None,
    ) -> None:
        """``world``: joined already; else ``join`` makes it when first needed (``planned``: what it
        will be, so that the notice can speak before)."""
        self.options = options
        self._world = world
        self._join = join
        self.made_group = False
        self.registry = Registry()
        self.busy = False
        self._patches = _patches.Patches()
        self._handles: list[Any] = []
        self._constructing: set[int] = set()  # optimizers in __init__ (its add_param_group calls)
        self._loaders = 0
        self.optimizers_made = 0  # by the user's code, in this session
        self.saves: Saves | None = None
        known = world or planned
        self.shared_files = SharedFiles(known.rank, known.world_size) if known is not None else None
        self.ended_well = False  # the user's code returned (set by the caller): files are compared
        self.undistributed = Undistributed(known.world_size if known is not None else 0)
        self.notice: Notice | None = None if planned is None else Notice(planned.rank, planned.world_size)
        self.passes = Passes()  # batches per pass of IterableDataset loaders: who ran out first
        self.devices = devices.Devices(known, lambda: self.notice)  # cuda:0 habits: the own GPU
        if world is not None:
            self.world()

    # --- lifecycle ----------------------------------------------------------------------------

    def install(self) -> None:
        """Put the hooks in place; on an error, none of them stays."""
        CURRENT.capture = self
        try:
            install_hook()
            self.registry.install()
            self.devices.install()
            patches = [
                (torch.optim.Optimizer, "__init__", self._optimizer_init),
                (torch.optim.Optimizer, "add_param_group", self._add_param_group),
                (DataLoader, "__init__", self._loader_init),
                (DataLoader, "__iter__", self._loader_iter),
                (DataLoader, "__len__", self._loader_len),
                (torch.nn.parallel.DistributedDataParallel, "__init__", self._ddp_init),
                (torch.autograd, "backward", lambda original: self._backward(models.counted(original))),
                (torch.autograd, "grad", lambda original: models.counted(original, accumulates=False)),
                *((owner, "save", self._save) for owner in (torch, torch.serialization)),
            ]
            if self._join is not None:  # a script: the user may make the group themselves
                for owner in (dist, dist.distributed_c10d):
                    patches.append((owner, "init_process_group", self._init_process_group))
            self._patches.install(_patches.wrapping(owner, name, make) for owner, name, make in patches)
            self._handles.append(register_optimizer_step_pre_hook(self._before_step))
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        """Take the hooks out (idempotent): torch's attributes are as they were before ``install``."""
        try:
            if self.saves is not None and self.shared_files is not None and self.notice is not None:
                if self.ended_well:
                    self.shared_files.publish()
                self.saves.finish()  # rank 0's code has ended: no rank waits for its saves any more
                if self.ended_well:
                    self.shared_files.gather(set(self.saves.counts), self.notice.say)
            self.passes.write()
        finally:
            self._patches.restore()
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self.registry.uninstall()
            self.devices.uninstall()
            if CURRENT.capture is self:
                CURRENT.capture = None

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
        if self.saves is None:
            here = self._world
            self.saves = Saves(here.rank, here.world_size)
            self.shared_files = self.shared_files or SharedFiles(here.rank, here.world_size)
        return self._world

    # --- the hooks ----------------------------------------------------------------------------

    def _optimizer_init(self, original: Any) -> Any:
        def __init__(optimizer: Any, params: Any, *args: Any, **kwargs: Any) -> None:
            if self.busy:
                original(optimizer, params, *args, **kwargs)
                return
            self.optimizers_made += 1
            params = self._distribute_models(params)
            self._constructing.add(id(optimizer))  # its own add_param_group calls: done above
            try:
                original(optimizer, params, *args, **kwargs)
            finally:
                self._constructing.discard(id(optimizer))
            models.bind_optimizer(optimizer)  # over sharded parameters: full state loads into shards
            models.guard_optimizer(optimizer)  # steps DDP did not see still get averaged gradients

        return __init__

    def _add_param_group(self, original: Any) -> Any:
        def add_param_group(optimizer: Any, param_group: Any) -> None:
            if self.busy or id(optimizer) in self._constructing or not isinstance(param_group, dict):
                original(optimizer, param_group)
                return
            original(optimizer, self._distribute_models([param_group])[0])  # a head added later
            models.bind_optimizer(optimizer)
            models.guard_optimizer(optimizer)

        return add_param_group

    def _distribute_models(self, params: Any) -> Any:
        items = optimizers.materialize(params)
        found, orphans = optimizers.roots(optimizers.tensors_of(items), self.registry)
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
                f"{world.world_size} processes, found through the optimizer at {where(site)}"
                f"{models.split_note(root)}",
            )
        return optimizers.rebind(items, mapping)

    def _loader_init(self, original: Any) -> Any:
        def __init__(loader: DataLoader, *args: Any, **kwargs: Any) -> None:
            if not self.busy:  # the notice names the line that made it, not where it is first iterated
                loader.__dict__.setdefault(_SITE, user_site(sys._getframe(1), made=loader))
            original(loader, *args, **kwargs)

        return __init__

    def _loader_iter(self, original: Any) -> Any:
        def __iter__(loader: DataLoader) -> Any:
            if self.busy:
                return original(loader)
            fresh = not split.is_split(loader)
            site = loader.__dict__.get(_SITE) or user_site(sys._getframe(1))
            whole_while_training = self._begin_pass(loader, site)
            iterator = self.passes.watch(loader, original)
            if fresh and split.is_split(loader):  # split just now: its first pass weighed too
                iterator = split.weighed(loader, iterator)
            # a whole pass while gradients are on may be training: an optimizer step in it is said
            self.undistributed.begin_pass(site if whole_while_training else None, iterator)
            return iterator

        return __iter__

    def _loader_len(self, original: Any) -> Any:
        def __len__(loader: DataLoader) -> int:
            # Before the first pass (a scheduler's steps per epoch) as a pass beginning now would be;
            # after one, the length of the order in place (``total / len(loader)`` after the loop).
            if self.busy:
                return original(loader)
            kind = loaders.pass_kind(CURRENT.wrapped_models())
            if not loader.__dict__.get("_autoddp_seen"):
                loader.__dict__["_autoddp_seen"] = True
                self._shard(loader, loader.__dict__.get(_SITE) or user_site(sys._getframe(1)), kind)
            shares = loader.__dict__.get(loaders.Shares.KEY)
            which = shares.counted(kind) if shares is not None else None
            if shares is None or shares.in_use == which:
                return original(loader)
            return shares.length(which)

        return __len__

    def _begin_pass(self, loader: DataLoader, site: tuple[str, int]) -> bool:
        """Before a pass: shard a random loader the first time; give the pass the order it needs.

        True when the pass gets all of a random loader while gradients are on.
        """
        kind = loaders.pass_kind(CURRENT.wrapped_models())
        if not loader.__dict__.get("_autoddp_seen"):
            loader.__dict__["_autoddp_seen"] = True
            self._shard(loader, site, kind)
        shares = loader.__dict__.get(loaders.Shares.KEY)
        if shares is None:
            return False
        shares.begin_pass(loader, kind)
        if shares.in_use == "shard":
            self.undistributed.data_shared = True
        return shares.in_use == "whole" and torch.is_grad_enabled()

    def _shard(self, loader: DataLoader, site: tuple[str, int], first_pass: str = loaders.TRAINING) -> None:
        kind = loaders.kind(loader)
        if kind in ("distributed", "iterable"):
            self.undistributed.data_shared = True  # given out by rank already, or by the dataset
        if kind == "distributed":  # prepared, or the user's own DistributedSampler: as it is
            with self._own_work():
                foreign = loaders.foreign_shares(loader, self.world())
            if foreign is not None and self.notice is not None:
                self.notice.say(("loader", id(loader)), f"DataLoader ({where(site)}): {foreign}")
            return
        if kind != "random":
            if kind == "ordered":
                self.undistributed.ordered.append(site)
            if self.notice is not None:
                line = f"DataLoader ({where(site)}): left whole: {loaders.REASONS[kind]}"
                self.notice.say(("loader", id(loader)), line, captured=False)
            return
        from autoddp.data.loaders import shard_loader, user_seed

        with self._own_work():
            world = self.world()
            assert self.notice is not None
            if _compat.loader_iterator(loader) is not None:
                reason = "already iterated with persistent workers before autoddp saw it"
                line = f"DataLoader ({where(site)}): left whole: {reason}"
                self.notice.say(("loader", id(loader)), line, captured=False)
                return
            whole = (loader.sampler, loader.batch_sampler)
            if self.options.split_batches:  # one process's batches, in parts: no seed of autoddp's
                shard_loader(loader, world, split=True)
            else:
                number, self._loaders = self._loaders, self._loaders + 1  # the n-th: its own seed
                seed = loaders.shared_seed(user_seed(loader, number=number), world.rank, number)
                shard_loader(loader, world, seed=seed, split=False)
            shard = (loader.sampler, loader.batch_sampler)
            loader.__dict__[loaders.Shares.KEY] = loaders.Shares(whole, shard)
        share = loaders.share(loader, world.world_size)
        if first_pass != loaders.TRAINING:
            line = (
                f"DataLoader ({where(site)}): shuffled, first iterated outside training (no gradients, "
                f"no model trained yet, or every model in eval()): left whole there, every rank sees "
                f"all of it; a pass while training is sharded, {share}"
            )
        else:
            line = f"DataLoader ({where(site)}): sharded, {share}; left whole in evaluation passes"
        self.notice.say(("loader", id(loader)), line)

    def _save(self, original: Any) -> Any:
        return saving(self, original)

    def _backward(self, original: Any) -> Any:
        def backward(*args: Any, **kwargs: Any) -> Any:
            if self.busy:
                return original(*args, **kwargs)
            if self.undistributed.backward_checked:
                result = original(*args, **kwargs)
            else:
                result = self._first_backward(original, sys._getframe(1), args, kwargs)
            if self.options.split_batches:  # loss.item() then prints the global batch's loss
                models.show_split_loss_whole(args[0] if args else kwargs.get("tensors"))
            return result

        return backward

    def _first_backward(self, original: Any, frame: Any, args: Any, kwargs: Any) -> Any:
        """With no optimizer made yet, which models does the first backward train by hand?"""
        self.undistributed.backward_checked = True
        models.check_loss(args[0] if args else kwargs.get("tensors"), self.options.split_batches)
        if self.optimizers_made:
            return original(*args, **kwargs)
        roots = candidate_roots(self.registry, frame, CURRENT.wrapped_models())
        before, result = grad_versions(roots), original(*args, **kwargs)
        wrapped = bool(CURRENT.wrapped_models())
        self.undistributed.after_first_backward(self.notice, roots, before, user_site(frame), wrapped)
        return result

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.busy and self.undistributed.at_step:
            self.undistributed.before_step(self.notice, caller_site())

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
        session.ended_well = True
    finally:
        session.uninstall()
