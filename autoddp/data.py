"""Data sharding: give each process a disjoint share of every DataLoader, and gather results back.

``shard_loader`` swaps a loader's sampler (or batch sampler) for a distributed one, in place when it
can, so the loader keeps its class, identity and every constructor setting. The distributed
samplers here move to the next epoch by themselves on every pass, draw their seed from the user's
own seed, and pad so that every rank sees the same number of samples and batches. ``gather``
collects per-sample results (predictions, losses) from every rank, in the single-process order.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from autoddp import _compat
from autoddp.errors import ConfigurationError
from autoddp.state import World
from autoddp.world import current

__all__ = ["gather", "shard_loader"]

# Seeds travel as int64 tensors; torch seeds are unsigned 64-bit, so fold them into this range.
_SEED_RANGE = 2**62


class _DistributedSampler(DistributedSampler):
    """A DistributedSampler (padded, never dropping samples) that moves to the next epoch by itself.

    Every pass over it (DataLoader iterates its sampler once per epoch, also with persistent
    workers) uses the next epoch, so each epoch is shuffled differently, identically on every rank,
    with no ``set_epoch`` call. An explicit ``set_epoch(n)`` still wins: the next pass uses ``n``,
    the ones after it ``n + 1``, ``n + 2``... The epoch advances when the pass starts yielding, not
    when ``iter()`` is called, because DataLoader may create and drop a sampler iterator unused.
    """

    def __init__(self, source: Any, *, world: World, shuffle: bool, seed: int) -> None:
        super().__init__(
            source,
            num_replicas=world.world_size,
            rank=world.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=False,
        )
        self._next_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass; later passes continue from it."""
        super().set_epoch(epoch)
        self._next_epoch = epoch

    def _begin_pass(self) -> None:
        self.epoch = self._next_epoch
        self._next_epoch = self.epoch + 1

    def __iter__(self) -> Iterator[Any]:
        self._begin_pass()
        yield from super().__iter__()


class _ShardedSampler(_DistributedSampler):
    """Shards any sampler or batch sampler by its own order: each rank takes every W-th item.

    On every pass the wrapped sampler is drawn in full under a seed shared by all ranks (its
    ``generator``, if it has that attribute, is replaced for the draw by one seeded from the shared
    seed and the epoch, and torch's global CPU generator is seeded the same way and restored
    afterwards), so all ranks see the same order and take disjoint shares of it. The order is
    padded by repeating its start, as DistributedSampler does, so every rank gets the same number
    of items. Wrapping a batch sampler shards whole batches.
    """

    def __init__(self, sampler: Any, *, world: World, seed: int) -> None:
        super().__init__(sampler, world=world, shuffle=False, seed=seed)
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        self._begin_pass()
        order = _draw(self.sampler, (self.seed + self.epoch) % 2**64)
        yield from _share(order, self.rank, self.num_replicas)


def _draw(sampler: Any, seed: int) -> list[Any]:
    """The full order of one pass over ``sampler``, drawn under ``seed``."""
    replaced = False
    if hasattr(sampler, "generator"):
        original = sampler.generator
        try:
            sampler.generator = torch.Generator().manual_seed(seed)
            replaced = True
        except (AttributeError, TypeError):
            pass
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return list(sampler)
    finally:
        if replaced:
            sampler.generator = original


def _share(order: list[Any], rank: int, world_size: int) -> list[Any]:
    """Rank ``rank``'s share of ``order``, padded by repeating its start to a multiple of the world."""
    if not order:
        return []
    total = math.ceil(len(order) / world_size) * world_size
    padded = (order * math.ceil(total / len(order)))[:total]
    return padded[rank:total:world_size]


def shard_loader(loader: DataLoader, world: World) -> DataLoader:
    """Return ``loader`` giving this process a disjoint share of each epoch (unchanged with one process).

    Every constructor setting, the loader's class and (when it has not been iterated with
    persistent workers yet) its identity are kept; only the sampler changes. ``batch_size`` stays
    per process, so the global batch is ``batch_size * world_size``. Epochs advance by themselves,
    the shuffle seed comes from the loader's ``generator`` or ``torch.manual_seed``, and every rank
    gets the same number of batches (the last samples are padded with repeats from the start).
    """
    if world.world_size <= 1:
        return loader
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn(
            f"autoddp cannot shard a DataLoader over an IterableDataset "
            f"({type(loader.dataset).__name__}): it takes no sampler, so every process would read "
            "all of it. Left unchanged; shard inside the dataset's __iter__ instead, e.g. keep "
            "every autoddp.world_size()-th item starting at autoddp.rank() (and split further "
            "between DataLoader workers with torch.utils.data.get_worker_info()).",
            UserWarning,
            stacklevel=2,
        )
        return loader
    existing = _distributed_sampler(loader)
    if existing is not None:
        hint = (
            ""
            if isinstance(existing, _DistributedSampler)
            else " It does not advance epochs by itself: call its set_epoch(epoch) before each epoch."
        )
        warnings.warn(
            f"this DataLoader's sampler is already a DistributedSampler ({type(existing).__name__}): "
            f"already sharded; left as is.{hint}",
            UserWarning,
            stacklevel=2,
        )
        return loader

    batch_sampler = loader.batch_sampler
    user_batches = loader.batch_size is None and batch_sampler is not None
    plain_batches = user_batches and type(batch_sampler) is BatchSampler
    if user_batches and not plain_batches:
        source = batch_sampler
    elif plain_batches:
        source = batch_sampler.sampler
    else:
        source = loader.sampler
    seed = _shared_seed(_user_seed(loader, source), world)

    if user_batches and not plain_batches:
        new_sampler = loader.sampler
        new_batch_sampler = _distribute(batch_sampler, world, seed)
    else:
        new_sampler = _distribute(source, world, seed)
        if plain_batches:
            new_batch_sampler = BatchSampler(new_sampler, batch_sampler.batch_size, batch_sampler.drop_last)
        elif batch_sampler is not None:
            new_batch_sampler = BatchSampler(new_sampler, loader.batch_size, loader.drop_last)
        else:
            new_batch_sampler = None

    if _compat.loader_iterator(loader) is None:
        # DataLoader.__setattr__ refuses these names after __init__; nothing else holds them yet.
        object.__setattr__(loader, "sampler", new_sampler)
        object.__setattr__(loader, "batch_sampler", new_batch_sampler)
        return loader
    return _rebuild(loader, new_sampler, new_batch_sampler, user_batches)


def _distributed_sampler(loader: DataLoader) -> DistributedSampler | None:
    """The DistributedSampler that decides this loader's order, if it has one."""
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, DistributedSampler):
        return batch_sampler
    inner = getattr(batch_sampler, "sampler", None)
    if isinstance(inner, DistributedSampler):
        return inner
    if isinstance(loader.sampler, DistributedSampler):
        return loader.sampler
    return None


def _distribute(sampler: Any, world: World, seed: int) -> DistributedSampler:
    """The distributed counterpart of ``sampler`` for this rank."""
    if type(sampler) is SequentialSampler:
        return _DistributedSampler(sampler.data_source, world=world, shuffle=False, seed=seed)
    if (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler.num_samples == len(sampler.data_source)
    ):
        return _DistributedSampler(sampler.data_source, world=world, shuffle=True, seed=seed)
    try:
        len(sampler)
    except TypeError as error:
        raise ConfigurationError(
            f"autoddp cannot shard the DataLoader's {type(sampler).__name__}: it has no len(), so its "
            "share per process is unknown. Give it a __len__, or shard it yourself by making it a "
            "subclass of torch.utils.data.distributed.DistributedSampler that yields only this "
            "process's share (autoddp leaves those as they are)"
        ) from error
    return _ShardedSampler(sampler, world=world, seed=seed)


def _user_seed(loader: DataLoader, sampler: Any) -> int:
    """The seed the user chose: the sampler's or the loader's generator, else ``torch.manual_seed``."""
    for generator in (getattr(sampler, "generator", None), loader.generator):
        if isinstance(generator, torch.Generator):
            return generator.initial_seed() % _SEED_RANGE
    return torch.initial_seed() % _SEED_RANGE


def _shared_seed(seed: int, world: World) -> int:
    """Rank 0's ``seed`` on every rank, so all of them shuffle alike even when spawned."""
    import torch.distributed as dist

    if world.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return seed
    value = torch.tensor([seed], dtype=torch.int64, device=_comm_device(torch.device("cpu")))
    dist.broadcast(value, src=0)
    return int(value.item())


def _comm_device(preferred: torch.device) -> torch.device:
    """``preferred`` if the default process group can communicate on it, else a device it can."""
    import torch.distributed as dist

    config = dist.get_backend_config()  # e.g. "cpu:gloo,cuda:gloo" or "cpu:gloo,cuda:nccl"
    if ":" in config:
        types = {pair.split(":")[0].strip() for pair in config.split(",")}
    else:
        types = {"cpu"} if "gloo" in config else {"cuda"}
    if preferred.type in types:
        return preferred
    if "cpu" in types:
        return torch.device("cpu")
    if "cuda" in types and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(current().device)


def _rebuild(loader: DataLoader, sampler: Any, batch_sampler: Any, user_batches: bool) -> DataLoader:
    """A new ``type(loader)`` with every setting of ``loader`` and the given samplers.

    Needed when the loader already holds a persistent-workers iterator, which keeps the sampler
    it was created with.
    """
    kwargs: dict[str, Any] = {}
    for name, parameter in inspect.signature(DataLoader.__init__).parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if name == "shuffle":
            continue  # decided by the sampler
        if name in ("sampler", "batch_sampler", "batch_size", "drop_last"):
            continue
        if hasattr(loader, name):
            kwargs[name] = getattr(loader, name)
    if user_batches:
        # With a batch sampler DataLoader stores batch_size=None; passing it on would unbatch.
        kwargs["batch_sampler"] = batch_sampler
    else:
        kwargs.update(sampler=sampler, batch_size=loader.batch_size, drop_last=loader.drop_last)

    cls = type(loader)
    advice = (
        f"autoddp cannot shard this {cls.__name__}: it was already iterated with persistent workers, "
        "which keep the old sampler, so it has to be rebuilt, and "
    )
    fix = (
        f". Call autoddp.prepare(loader) before the first iteration, or let {cls.__name__}.__init__ "
        "accept DataLoader's keyword arguments (e.g. **kwargs passed on to DataLoader.__init__)."
    )
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as error:
        raise ConfigurationError(
            f"{advice}its __init__ does not take DataLoader's arguments ({error}){fix}"
        ) from error
    try:
        rebuilt = cls(**kwargs)
    except TypeError as error:
        raise ConfigurationError(f"{advice}rebuilding it failed ({error}){fix}") from error
    if user_batches and type(batch_sampler) is BatchSampler:
        object.__setattr__(rebuilt, "sampler", sampler)
    return rebuilt


def gather(tensor: torch.Tensor, loader: DataLoader | None = None) -> torch.Tensor:
    """All ranks' rows of ``tensor`` on every rank, so metrics match a single-process run.

    Every rank must call it. Rows may differ in number between ranks. Without ``loader`` the rows
    are concatenated in rank order. With the sharded ``loader`` the tensor was built from (one row
    per sample, one full pass in order, ``drop_last=False``), the rows come back in the global
    sample order and the padding repeats are dropped: for an unshuffled loader the result equals
    the single-process one. Outside a process group the tensor is returned unchanged. The result
    lies on ``tensor``'s device and carries no gradient.
    """
    import torch.distributed as dist

    if not isinstance(tensor, torch.Tensor):
        raise ConfigurationError(f"gather() needs a torch.Tensor, got {type(tensor).__name__}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    world_size = dist.get_world_size()

    shapes: list[Any] = [None] * world_size
    dist.all_gather_object(shapes, (tuple(tensor.shape), str(tensor.dtype)))
    if any(len(shape) == 0 for shape, _ in shapes):
        raise ConfigurationError(
            "gather() needs a tensor with a first (sample) dimension on every rank, but got a 0-d "
            "tensor; pass tensor.reshape(1), or use torch.distributed.all_reduce for a single number"
        )
    if len({(shape[1:], dtype) for shape, dtype in shapes}) > 1:
        described = ", ".join(f"rank {r}: {tuple(s)} {d}" for r, (s, d) in enumerate(shapes))
        raise ConfigurationError(
            "gather() needs tensors that differ only in their first dimension and share a dtype "
            f"on every rank; got {described}"
        )
    rows = [shape[0] for shape, _ in shapes]

    device = _comm_device(tensor.device)
    local = tensor.detach().to(device).contiguous()
    longest = max(rows)
    if local.shape[0] < longest:
        filler = local.new_zeros((longest - local.shape[0], *local.shape[1:]))
        local = torch.cat([local, filler])
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local)
    parts = [part[:count] for part, count in zip(parts, rows, strict=True)]

    if loader is None:
        return torch.cat(parts).to(tensor.device)
    per_rank, total = _layout(loader, world_size, rows)
    interleaved = torch.stack(parts, dim=1).reshape(per_rank * world_size, *local.shape[1:])
    return interleaved[:total].to(tensor.device)


def _layout(loader: DataLoader, world_size: int, rows: Sequence[int]) -> tuple[int, int]:
    """Samples per rank and samples in all for ``loader``, checked against the rows gathered."""
    sampler = _distributed_sampler(loader)
    fix = "or call gather(tensor) without loader= to concatenate the rows in rank order"
    if sampler is None:
        raise ConfigurationError(
            "gather(loader=...) needs a loader sharded by autoddp.prepare (or autoddp.data.shard_loader), "
            f"and this one has no DistributedSampler; prepare it before iterating, {fix}"
        )
    if sampler is loader.batch_sampler:
        raise ConfigurationError(
            "gather(loader=...) cannot restore the sample order of a loader whose custom batch sampler "
            f"was sharded batch by batch; {fix}"
        )
    if sampler.num_replicas != world_size:
        raise ConfigurationError(
            f"gather(loader=...) got a loader sharded for {sampler.num_replicas} processes in a world "
            f"of {world_size}; shard it in this run with autoddp.prepare, {fix}"
        )
    total = len(sampler.dataset)
    if sampler.total_size < total:
        raise ConfigurationError(
            f"gather(loader=...) got a loader whose sampler drops samples (drop_last=True keeps "
            f"{sampler.total_size} of {total}); use drop_last=False for evaluation, {fix}"
        )
    if any(count != sampler.num_samples for count in rows):
        raise ConfigurationError(
            f"gather(loader=...) expects one row per sample of one full pass, {sampler.num_samples} "
            f"on every rank, but got {list(rows)} rows per rank. Iterate the loader once to the end "
            f"with drop_last=False (drop_last=True drops the last incomplete batch), {fix}"
        )
    return sampler.num_samples, total
