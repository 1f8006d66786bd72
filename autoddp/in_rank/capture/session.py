"""One capture session: installs its hook families around the user's code, joins the world lazily.

While the user's code runs in a world of several processes, a ``Session`` watches, through
patches it installs and removes around that code only:

- ``torch.optim.Optimizer.__init__`` and ``add_param_group``: the modules owning the optimizer's
  parameters are wrapped as ``prepare`` wraps them, where they are (``optimizers``);
- ``DataLoader.__init__``: the line that made a loader is remembered, for the notice;
- ``DataLoader.__iter__`` and ``__len__``: a random loader is sharded (or split) at its first
  iteration or length, an ordered one left whole; a pass that begins in an evaluation context
  gets all of a random loader (``loader_hooks``);
- ``torch.save`` to a path: written once, by rank 0, atomically (``saves``); ``open(path, "wb")``
  of such a file: a private file of the rank's own, so that no rank's open empties it (``opens``);
- ``open`` for writing (an audit hook): the files several ranks wrote are named (``shared_files``);
- ``multiprocessing``'s ``Process.start`` and ``join``: training in processes the user's code
  starts itself is said, as not distributed (``children``);
- ``DistributedDataParallel.__init__``: a user's own DDP takes over from autoddp's (never two);
- ``torch.autograd.backward`` (its first call; each, and ``grad``, counted for ``models._reduction``)
  and every optimizer step (global step hook): what could not be distributed is said
  (``steps``, ``_undistributed``);
- in a script, ``init_process_group``: the user's own group turns capture off, one called after
  autoddp had to make the group is a clear error;
- experiment trackers the user's code imports (``wandb.init``, TensorBoard's ``SummaryWriter``,
  MLflow's ``start_run`` and ``log_*``): one run, rank 0's; the other ranks' make nothing
  (``trackers``).

Each family of hooks has its owner (``Optimizers``, ``Loaders``, ``Saves``, ``Steps``,
``devices.Devices``, ``Trackers``) with its own patches; the session holds what they share. In a
script the process group is made at the first moment capture needs it (``world``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

from autoddp.core import _patches
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import CURRENT, RunOptions, World
from autoddp.in_rank.capture import devices
from autoddp.in_rank.capture._notice import Notice
from autoddp.in_rank.capture._registry import Registry
from autoddp.in_rank.capture._undistributed import Undistributed
from autoddp.in_rank.capture.children import Children
from autoddp.in_rank.capture.loader_hooks import Loaders
from autoddp.in_rank.capture.optimizers import Optimizers
from autoddp.in_rank.capture.passes import Passes
from autoddp.in_rank.capture.saves import Saves
from autoddp.in_rank.capture.shared_files import SharedFiles, install_hook
from autoddp.in_rank.capture.steps import Steps
from autoddp.in_rank.capture.too_large import TooLarge
from autoddp.in_rank.capture.trackers import Trackers


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
        #: Capture runs a script from its first line (the command): every name the user's code binds
        #: to torch's functions is bound after the hooks (a decorated function's module was not).
        self.script = join is not None
        self.made_group = False
        self.registry = Registry()
        self.busy = False
        self._patches = _patches.Patches()  # init_process_group, in a script
        known = world or planned
        self.shared_files = SharedFiles(known.rank, known.world_size) if known is not None else None
        self.ended_well = False  # the user's code returned (set by the caller): files are compared
        self.undistributed = Undistributed(known.world_size if known is not None else 0)
        self.notice: Notice | None = None if planned is None else Notice(planned.rank, planned.world_size)
        self.passes = Passes()  # batches per pass of IterableDataset loaders: who ran out first
        self.optimizers = Optimizers(self)
        self.loaders = Loaders(self)
        self.saves = Saves(self)
        self.steps = Steps(self)
        self.children = Children(self)  # processes the user's code starts itself
        self.trackers = Trackers(self, known)  # wandb, TensorBoard, MLflow: one run, rank 0's
        self.devices = devices.Devices(known, lambda: self.notice)  # cuda:0 habits: the own GPU
        self.too_large = TooLarge(self.devices, options, lambda: self.notice)  # .to("cuda"), sharded later
        if world is not None:
            self.world()

    def install(self) -> None:
        """Put the hooks in place; on an error, none of them stays."""
        CURRENT.capture = self
        try:
            install_hook()
            self.registry.install()
            self.devices.install()
            self.too_large.install()
            for family in self._families():
                family.install()
            if self._join is not None:  # a script: the user may make the group themselves
                patches = [(owner, "init_process_group") for owner in (dist, dist.distributed_c10d)]
                self._patches.install(
                    _patches.wrapping(owner, name, self._init_process_group) for owner, name in patches
                )
            self.steps.install_step_hook()
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        """Take the hooks out (idempotent): torch's attributes are as they were before ``install``."""
        try:
            if self.ended_well:
                self.children.check(ended=True)
            if self.saves.joined and self.shared_files is not None and self.notice is not None:
                if self.ended_well:
                    self.shared_files.publish()
                self.saves.finish()  # rank 0's code has ended: no rank waits for its saves any more
                if self.ended_well:
                    self.shared_files.gather(set(self.saves.counts), self.notice.say)
            self.passes.write()
        finally:
            self.take_out()

    def take_out(self) -> None:
        """Every hook out, and nothing else (also in a process the user's code forked: there the
        code runs as the user wrote it, and no rank waits for anything of its)."""
        for family in self._families():
            family.uninstall()
        self._patches.restore()
        self.steps.remove_step_hook()
        self.registry.uninstall()
        self.devices.uninstall()
        self.too_large.uninstall()
        if CURRENT.capture is self:
            CURRENT.capture = None

    def _families(self) -> tuple[Any, ...]:
        """The owners of the hook families installed and taken out alike."""
        return (self.optimizers, self.loaders, self.steps, self.saves, self.children, self.trackers)

    @contextlib.contextmanager
    def own_work(self) -> Iterator[None]:
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
        if not self.saves.joined:
            here = self._world
            self.saves.join(here.rank, here.world_size)
            self.shared_files = self.shared_files or SharedFiles(here.rank, here.world_size)
        return self._world

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
def capturing(
    options: RunOptions, world: World, made_before: Sequence[tuple[Any, Any]] = ()
) -> Iterator[None]:
    """Capture for the block when ``world`` has several processes and capture is on (once);
    ``made_before``: the models (each with its optimizer) wrapped before the block, said first."""
    if world.world_size <= 1 or not options.capture or CURRENT.capture is not None:
        yield
        return
    session = Session(options, world=world)
    session.install()
    for model, optimizer in made_before:
        session.optimizers.say_made_before(model, optimizer)
    try:
        yield
        session.ended_well = True
    finally:
        session.uninstall()
