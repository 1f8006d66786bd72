"""Capture's DataLoader hooks: a random loader gets its share per rank when iterated, an ordered one
stays whole (``Loaders``; ``autoddp.in_rank.data.loaders`` is the sharding they, and ``prepare``, use).

A DataLoader whose order is random (``shuffle=True``, any sampler but the sequential one, a custom
batch sampler) is sharded on its first iteration exactly as ``autoddp.prepare`` shards it. A
sequential loader (``shuffle=False``: the usual evaluation loader) is left whole, so metrics
computed by plain code equal the single-process ones (every rank evaluates everything). So is
every pass of a random loader that begins in an evaluation context (gradients off, or every
captured model in ``eval()`` mode): a shuffled validation loader counts every sample once on every
rank, as in one process. A DataLoader subclass that wraps DataLoader's own BatchSampler to keep
its workers across epochs (timm's MultiEpochsDataLoader) is judged by the order inside the
wrapper, and keeps its wrapper.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from autoddp.core import _compat, _patches
from autoddp.core.state import CURRENT, World
from autoddp.in_rank import models
from autoddp.in_rank.capture._notice import where
from autoddp.in_rank.capture._registry import user_site
from autoddp.in_rank.data import split
from autoddp.in_rank.data.loaders import (
    distributed_sampler,
    shard_loader,
    sharded_by_rank,
    user_seed,
    wrapped_batches,
)

#: Where the user's code made a DataLoader (kept in its ``__dict__``, for the notice).
_SITE = "_autoddp_site"


def kind(loader: DataLoader) -> str:
    """``"random"`` (shard it), ``"ordered"``, ``"iterable"`` or ``"distributed"`` (leave it whole)."""
    if isinstance(loader.dataset, IterableDataset):
        return "iterable"
    if distributed_sampler(loader) is not None or sharded_by_rank(loader) is not None:
        return "distributed"  # (a framework's own share by rank too: accelerate's BatchSamplerShard)
    batch_sampler = loader.batch_sampler
    wrapped = wrapped_batches(loader)  # a subclass's wrapper around DataLoader's own BatchSampler
    if wrapped is not None:
        return "ordered" if type(wrapped.sampler) is SequentialSampler else "random"
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return "random"  # a custom batch sampler: shared out by whole batches
    sampler = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    return "ordered" if type(sampler) is SequentialSampler else "random"


REASONS = {
    "ordered": "in order (shuffle=False, e.g. evaluation): every rank sees all of it",
    "iterable": "an IterableDataset takes no sampler: shard inside its __iter__ with autoddp.rank()",
    "distributed": "it already has a DistributedSampler",
}


def foreign_shares(loader: DataLoader, world: World) -> str | None:
    """For the notice: what a loader's own DistributedSampler made for another world does here
    (built before the process group existed: ``num_replicas=1``); None when it fits this rank."""
    sampler = distributed_sampler(loader)
    rank, world_size = world.rank, world.world_size
    if sampler is None or (sampler.num_replicas, sampler.rank) == (world_size, rank):
        return None
    own = f"its own DistributedSampler(num_replicas={sampler.num_replicas}, rank={sampler.rank})"
    fix = (
        "make the DistributedSampler after the process group exists (num_replicas=dist.get_world_size(), "
        "rank=dist.get_rank()), or leave it out and use shuffle=True: autoddp shares a shuffled loader out"
    )
    if sampler.num_replicas == 1:
        return f"{own}: every rank reads all of it, the same samples as one process: no speed-up; {fix}"
    return (
        f"{own}: this rank reads the share of rank {sampler.rank} of {sampler.num_replicas}, not its own "
        f"(rank {rank} of {world_size}): samples are missed or read twice, unlike one process; {fix}"
    )


def padding(loader: DataLoader) -> str:
    """For the notice: how many samples a sharded ``loader`` repeats so every rank gets as many."""
    sampler = distributed_sampler(loader)
    try:
        repeated = sampler.total_size - len(sampler.dataset) if sampler is not None else 0
    except TypeError:  # a sampler with no length: nothing is padded
        return ""
    if repeated <= 0:
        return ""
    return (
        f" ({repeated} of its {len(sampler.dataset)} items repeated so that every process gets "
        f"{sampler.num_samples}, as DistributedSampler pads: a full-batch step counts them twice)"
    )


_LOADER_SEED = "autoddp/capture/loader-seed/"


def shared_seed(seed: int, rank: int, number: int) -> int:
    """Rank 0's shuffle seed for the run's ``number``-th loader, through the store: rank 0 never
    waits for it."""
    store = _compat.default_store()
    key = f"{_LOADER_SEED}{number}"
    if rank == 0:
        store.set(key, str(seed))
        return seed
    store.wait([key])
    return int(store.get(key).decode())


def share(loader: DataLoader, world_size: int) -> str:
    """For the notice: what each process takes of a sharded ``loader``."""
    if type(loader.batch_sampler).__name__ == "SplitBatches":
        return (
            f"each process takes its part (1/{world_size}) of every batch: one process's batches, "
            "steps and len(loader) (split_batches)"
        )
    return f"each process takes 1/{world_size} of every epoch{padding(loader)}"


#: What a pass beginning now is, for a random loader: it gets all of it, except in training.
TRAINING, EVALUATING, UNTRAINED = "training", "evaluating", "untrained"


def pass_kind(models: list[torch.nn.Module]) -> str:
    """``EVALUATING`` with gradients off or every distributed model in ``eval()``; ``UNTRAINED``
    while no model is distributed (no optimizer over one yet: the data's statistics, a zero-shot
    evaluation); ``TRAINING`` otherwise. ``models``: the models distributed in this world (and
    the user's own DDP models: a framework's, Lightning's)."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return EVALUATING
    if not models:
        return UNTRAINED
    return TRAINING if any(model.training for model in models) else EVALUATING


class Shares:
    """A random loader's two orders: all of it (passes outside training) and this rank's share.

    Kept in the loader's ``__dict__`` once capture sharded it; ``begin_pass`` puts the order a pass
    needs in place before the pass begins (DataLoader reads its samplers when an iterator is made,
    so an iterator already running keeps its own; the iterator that persistent workers keep
    between passes is given the order too, before it resets for the next pass).

    ``len(loader)`` counts the order of the last pass (``total / len(loader)`` after an evaluation
    divides by all its batches). Before any pass, and after one made before any model trained, it
    is this rank's share unless asked while evaluating: a scheduler's steps per epoch are read
    before training begins.
    """

    KEY = "_autoddp_shares"

    def __init__(self, whole: tuple, shard: tuple) -> None:
        self.whole, self.shard = whole, shard
        self.in_use = "shard"
        self.passes = 0
        self.last = TRAINING  # the kind of the last pass

    def begin_pass(self, loader: DataLoader, kind: str) -> None:
        """Put the order a pass of ``kind`` needs in place: all of it, except in training."""
        self.passes += 1
        self.last = kind
        self._use(loader, "shard" if kind == TRAINING else "whole")

    def counted(self, kind: str) -> str:
        """The order ``len(loader)`` counts when asked now, in a context of ``kind``."""
        if self.passes and self.last == EVALUATING:
            return "whole"
        return "whole" if kind == EVALUATING and not self.passes else "shard"

    def _use(self, loader: DataLoader, which: str) -> None:
        if which == self.in_use:
            return
        sampler, batch_sampler = self.whole if which == "whole" else self.shard
        # DataLoader.__setattr__ refuses these names after __init__; a running iterator keeps its own.
        object.__setattr__(loader, "sampler", sampler)
        object.__setattr__(loader, "batch_sampler", batch_sampler)
        persistent = _compat.loader_iterator(loader)
        if persistent is not None:
            _compat.set_iterator_order(persistent, batch_sampler if batch_sampler is not None else sampler)
        self.in_use = which

    def length(self, which: str) -> int:
        """``len(loader)`` with the order ``which`` in place (without putting it there)."""
        sampler, batch_sampler = self.whole if which == "whole" else self.shard
        return len(batch_sampler if batch_sampler is not None else sampler)


class Loaders:
    """The DataLoader hooks of one capture session: where each loader was made, its passes, its shard."""

    def __init__(self, session: Any) -> None:
        """``session``: the capture ``Session`` (its options, notice, passes and world)."""
        self.session = session
        self._made = 0  # random loaders sharded so far: the n-th gets its own seed
        self._patches = _patches.Patches()

    def install(self) -> None:
        patches = [
            (DataLoader, "__init__", self._loader_init),
            (DataLoader, "__iter__", self._loader_iter),
            (DataLoader, "__len__", self._loader_len),
        ]
        self._patches.install(_patches.wrapping(owner, name, make) for owner, name, make in patches)

    def uninstall(self) -> None:
        self._patches.restore()

    def _trained(self) -> list[torch.nn.Module]:
        """The models a pass may train: those autoddp distributed, and the user's own DDP models."""
        return [*CURRENT.wrapped_models(), *self.session.steps.own_ddp]

    def _loader_init(self, original: Any) -> Any:
        def __init__(loader: DataLoader, /, *args: Any, **kwargs: Any) -> None:
            if not self.session.busy:  # the notice names the line that made it, not where it is iterated
                loader.__dict__.setdefault(_SITE, user_site(sys._getframe(1), made=loader))
            original(loader, *args, **kwargs)

        return __init__

    def _loader_iter(self, original: Any) -> Any:
        def __iter__(loader: DataLoader, /) -> Any:
            session = self.session
            if session.busy:
                return original(loader)
            fresh = not split.is_split(loader)
            site = loader.__dict__.get(_SITE) or user_site(sys._getframe(1))
            whole_while_training = self._begin_pass(loader, site)
            iterator = session.passes.watch(loader, original)
            if pass_kind(self._trained()) == TRAINING:  # its last batch ends an accumulation window
                # (an IterableDataset's length may be the whole's, or differ between ranks: not read)
                models.training_pass(None if isinstance(loader.dataset, IterableDataset) else iterator)
            if fresh and split.is_split(loader):  # split just now: its first pass weighed too
                iterator = split.weighed(loader, iterator)
            # a whole pass while gradients are on may be training: an optimizer step in it is said
            session.undistributed.begin_pass(site if whole_while_training else None, iterator)
            return iterator

        return __iter__

    def _loader_len(self, original: Any) -> Any:
        def __len__(loader: DataLoader, /) -> int:
            # Before the first pass (a scheduler's steps per epoch) as a pass beginning now would be;
            # after one, the length of the order in place (``total / len(loader)`` after the loop).
            if self.session.busy:
                return original(loader)
            kind = pass_kind(self._trained())
            if not loader.__dict__.get("_autoddp_seen"):
                loader.__dict__["_autoddp_seen"] = True
                self._shard(loader, loader.__dict__.get(_SITE) or user_site(sys._getframe(1)), kind)
            shares = loader.__dict__.get(Shares.KEY)
            which = shares.counted(kind) if shares is not None else None
            if shares is None or shares.in_use == which:
                return original(loader)
            return shares.length(which)

        return __len__

    def _begin_pass(self, loader: DataLoader, site: tuple[str, int]) -> bool:
        """Before a pass: shard a random loader the first time; give the pass the order it needs.

        True when the pass gets all of a random loader while gradients are on.
        """
        kind = pass_kind(self._trained())
        if not loader.__dict__.get("_autoddp_seen"):
            loader.__dict__["_autoddp_seen"] = True
            self._shard(loader, site, kind)
        shares = loader.__dict__.get(Shares.KEY)
        if shares is None:
            return False
        shares.begin_pass(loader, kind)
        if shares.in_use == "shard":
            self.session.undistributed.data_shared = CURRENT.sharded_data = True
        return shares.in_use == "whole" and torch.is_grad_enabled()

    def _shard(self, loader: DataLoader, site: tuple[str, int], first_pass: str = TRAINING) -> None:
        session = self.session
        found = kind(loader)
        if found in ("distributed", "iterable"):
            session.undistributed.data_shared = CURRENT.sharded_data = (
                True  # given out by rank already, or by the dataset
            )
        if found == "distributed":  # prepared, or the user's own DistributedSampler: as it is
            with session.own_work():
                foreign = foreign_shares(loader, session.world())
            if foreign is not None and session.notice is not None:
                session.notice.say(
                    ("loader", id(loader)), f"DataLoader ({where(site)}): {foreign}", subject=loader
                )
            return
        if found != "random":
            if found == "ordered":
                session.undistributed.ordered.append(site)
            if session.notice is not None:
                line = f"DataLoader ({where(site)}): left whole: {REASONS[found]}"
                session.notice.say(("loader", id(loader)), line, captured=False, subject=loader)
            return
        with session.own_work():
            world = session.world()
            if not self._shard_random(loader, site, world):
                return
        each = share(loader, world.world_size)
        if first_pass != TRAINING:
            line = (
                f"DataLoader ({where(site)}): shuffled, first iterated outside training (no gradients, "
                f"no model trained yet, or every model in eval()): left whole there, every rank sees "
                f"all of it; a pass while training is sharded, {each}"
            )
        else:
            line = f"DataLoader ({where(site)}): sharded, {each}; left whole in evaluation passes"
        session.notice.say(("loader", id(loader)), line, subject=loader)

    def _shard_random(self, loader: DataLoader, site: tuple[str, int], world: World) -> bool:
        """Shard a random ``loader`` (False: left whole, and said so)."""
        notice = self.session.notice
        assert notice is not None
        if _compat.loader_iterator(loader) is not None:
            reason = "already iterated with persistent workers before autoddp saw it"
            line = f"DataLoader ({where(site)}): left whole: {reason}"
            notice.say(("loader", id(loader)), line, captured=False, subject=loader)
            return False
        whole = (loader.sampler, loader.batch_sampler)
        if self.session.options.split_batches:  # one process's batches, in parts: no seed of autoddp's
            shard_loader(loader, world, split=True)
        else:
            number, self._made = self._made, self._made + 1  # the n-th: its own seed
            seed = shared_seed(user_seed(loader, number=number), world.rank, number)
            shard_loader(loader, world, seed=seed, split=False)
        shard = (loader.sampler, loader.batch_sampler)
        loader.__dict__[Shares.KEY] = Shares(whole, shard)
        return True
