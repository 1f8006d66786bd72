"""Data sharding: give each process a disjoint share of every DataLoader.

``shard_loader`` swaps a loader's sampler (or batch sampler) for a distributed one
(``autoddp.in_rank.data.samplers``), in place when it can, so the loader keeps its class, identity and every
constructor setting. The samplers move to the next epoch by themselves on every pass, draw their
seed from the user's own seed, and pad so that every rank sees the same number of samples and
batches. ``autoddp.gather`` collects per-sample results back in the single-process order.
"""

from __future__ import annotations

import inspect
import types
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

from autoddp.core import _compat, _warn
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import CURRENT, World
from autoddp.in_rank.data import draws
from autoddp.in_rank.data.samplers import AutoEpochSampler, ShardedSampler
from autoddp.in_rank.world import streams
from autoddp.in_rank.world.process_group import comm_device

# Seeds travel as int64 tensors; torch seeds are unsigned 64-bit, so fold them into this range.
_SEED_RANGE = 2**62


def shard_loader(
    loader: DataLoader, world: World, *, seed: int | None = None, split: bool | None = None
) -> DataLoader:
    """Return ``loader`` giving this process a disjoint share of each epoch (unchanged with one process).

    Every constructor setting, the loader's class and (when it has not been iterated with
    persistent workers yet) its identity are kept; only the sampler changes. ``batch_size`` stays
    per process, so the global batch is ``batch_size * world_size``. Epochs advance by themselves,
    the shuffle seed comes from the loader's ``generator`` or ``torch.manual_seed``, and every rank
    gets the same number of batches (the last samples are padded with repeats from the start).
    ``seed``: the shuffle seed all ranks agreed on already (else rank 0's is broadcast).
    ``split`` (default: the run's ``split_batches``): a loader whose order is random keeps one
    process's batches instead, each rank taking its part of every one (``autoddp.in_rank.data.split``);
    a loader in order is sharded as always (evaluation, ``autoddp.gather``).
    """
    if world.world_size <= 1:
        return loader
    if isinstance(loader.dataset, IterableDataset):
        if not shards_itself(loader.dataset):
            _warn.warn(
                f"autoddp cannot shard a DataLoader over an IterableDataset "
                f"({type(loader.dataset).__name__}): it takes no sampler, so every process would read "
                "all of it. Left unchanged; shard inside the dataset's __iter__ instead, e.g. keep "
                "every autoddp.world_size()-th item starting at autoddp.rank() (and split further "
                "between DataLoader workers with torch.utils.data.get_worker_info()), or set "
                "dataset.autoddp_sharded = True if it already shards itself."
            )
        return loader
    if _already_sharded(loader):
        return loader

    if (CURRENT.options.split_batches if split is None else split) and not in_order(loader):
        from autoddp.in_rank.data.split import split_loader

        return split_loader(loader, world)

    inner = wrapped_batches(loader)
    if inner is not None:
        return _shard_wrapped(loader, inner, world, seed)

    batch_sampler = loader.batch_sampler
    user_batches = loader.batch_size is None and batch_sampler is not None
    plain_batches = user_batches and type(batch_sampler) is BatchSampler
    if user_batches and not plain_batches:
        source = batch_sampler
    elif plain_batches:
        source = batch_sampler.sampler
    else:
        source = loader.sampler
    if seed is None:
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

    if isinstance(new_batch_sampler, BatchSampler):
        _refuse_no_batch(source, new_batch_sampler, world)
    draws.seed_workers_by_rank(loader, world.rank)
    if _compat.loader_iterator(loader) is None:
        # DataLoader.__setattr__ refuses these names after __init__; nothing else holds them yet.
        object.__setattr__(loader, "sampler", new_sampler)
        object.__setattr__(loader, "batch_sampler", new_batch_sampler)
        return loader
    return _rebuild(loader, new_sampler, new_batch_sampler, user_batches)


def _already_sharded(loader: DataLoader) -> bool:
    """True (said once, with a hint where its epochs do not advance by themselves) for a loader
    whose sampler is a DistributedSampler already: left as it is."""
    existing = distributed_sampler(loader)
    if existing is None:
        return False
    hint = (
        ""
        if isinstance(existing, AutoEpochSampler)
        else " It does not advance epochs by itself: call its set_epoch(epoch) before each epoch."
    )
    _warn.warn(
        f"this DataLoader's sampler is already a DistributedSampler ({type(existing).__name__}): "
        f"already sharded; left as is.{hint}"
    )
    return True


def in_order(loader: DataLoader) -> bool:
    """True for a loader that yields its data set in order in plain batches (``shuffle=False``)."""
    batches = loader.batch_sampler
    if batches is not None and type(batches) is not BatchSampler:
        inner = wrapped_batches(loader)
        if inner is None:
            return False  # a batch sampler of the user's
        batches = inner
    sampler = batches.sampler if batches is not None else loader.sampler
    return type(sampler) is SequentialSampler


def wrapped_batches(loader: DataLoader) -> BatchSampler | None:
    """DataLoader's own BatchSampler, when the loader's class wrapped it after ``__init__``.

    A loader made with a ``batch_size`` gets a plain BatchSampler from DataLoader; another object
    in its place means a subclass put one around it (timm's MultiEpochsDataLoader repeats it
    forever, to keep its workers across epochs). The order is the wrapped BatchSampler's, found
    through ``.sampler`` attributes, and the subclass keeps its own iteration logic.
    """
    if loader.batch_size is None or type(loader.batch_sampler) is BatchSampler:
        return None
    found = loader.batch_sampler
    for _ in range(4):
        found = getattr(found, "sampler", None)
        if type(found) is BatchSampler:
            return found
    return None


def _shard_wrapped(loader: DataLoader, inner: BatchSampler, world: World, seed: int | None) -> DataLoader:
    """Shard a loader whose BatchSampler its class wrapped: the sampler inside changes, the wrapper stays."""
    if seed is None:
        seed = _shared_seed(_user_seed(loader, inner.sampler), world)
    sampler = _distribute(inner.sampler, world, seed)
    _refuse_no_batch(inner.sampler, BatchSampler(sampler, inner.batch_size, inner.drop_last), world)
    inner.sampler = sampler  # DataLoader's own object, made for this loader: every iterator sees it
    draws.seed_workers_by_rank(loader, world.rank)
    object.__setattr__(loader, "sampler", sampler)
    return loader


def _refuse_no_batch(source: Any, batches: BatchSampler, world: World) -> None:
    """Refuse a ``drop_last`` loader that sharding leaves without a single batch.

    One process would train on at least one batch; each rank's share would yield none, and the
    run would end well with an untrained model. An error names the numbers and the fix: keeping
    one process's count instead would mean a smaller batch or repeated samples, silently.
    """
    if not batches.drop_last:
        return
    try:
        total, share = len(source), len(batches.sampler)
    except TypeError:  # an endless sampler: never out of batches
        return
    size = batches.batch_size
    if share >= size or total < size:
        return
    raise ConfigurationError(
        f"this DataLoader has drop_last=True and batch_size={size}: sharded over {world.world_size} "
        f"processes, each process gets {share} of its {total} samples, fewer than one batch, so it "
        f"would yield no batch at all (one process: {total // size} batch"
        f"{'es' if total // size > 1 else ''}) and nothing would train. Use a batch_size of at most "
        f"{share} (the global batch is batch_size x {world.world_size}), or drop_last=False"
    )


#: Names in an IterableDataset's ``__iter__`` (or its attributes) that show it reads the rank itself.
_RANK_NAMES = frozenset(
    {
        "rank",
        "get_rank",
        "global_rank",
        "world_size",
        "get_world_size",
        "num_replicas",
        "RANK",
        "WORLD_SIZE",
        "split_dataset_by_node",
        "split_by_node",
    }
)


def shards_itself(dataset: IterableDataset) -> bool:
    """True for an IterableDataset that gives each rank its own share (so no warning is due).

    Recognised by ``dataset.autoddp_sharded = True`` (the explicit opt-out), by an attribute that
    holds the rank or world size (``rank``, ``world_size``, ``num_replicas``...), or by those names
    (``autoddp.rank()``, ``dist.get_rank()``, ``os.environ["RANK"]``, ``split_dataset_by_node``)
    in the code of its ``__iter__``, nested functions included.
    """
    flag = getattr(dataset, "autoddp_sharded", None)
    if flag is not None:
        return bool(flag)
    if _RANK_NAMES & set(getattr(dataset, "__dict__", {})):
        return True
    code = getattr(getattr(type(dataset), "__iter__", None), "__code__", None)
    return code is not None and _mentions_rank(code)


def _mentions_rank(code: types.CodeType) -> bool:
    if _RANK_NAMES & {*code.co_names, *code.co_varnames}:
        return True
    for constant in code.co_consts:
        if isinstance(constant, str) and constant in _RANK_NAMES:
            return True
        if isinstance(constant, types.CodeType) and _mentions_rank(constant):
            return True
    return False


def distributed_sampler(loader: DataLoader) -> DistributedSampler | None:
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


#: (count of processes, this process's index): the attributes by which a sampler of another
#: library says that it gives each process its own share already (accelerate's BatchSamplerShard:
#: num_processes, process_index; DistributedSampler's kin: num_replicas, rank).
RANK_ATTRIBUTES = (("num_processes", "process_index"), ("num_replicas", "rank"), ("world_size", "rank"))


def sharded_by_rank(loader: DataLoader) -> Any | None:
    """The sampler in ``loader``'s chain (its batch sampler, its sampler and those they wrap, a few
    levels deep) that already shares the data out among several processes by rank, if one does:
    a framework's own (``accelerate``'s ``prepare``) is left as it is, never sharded twice."""
    todo, seen = [loader.batch_sampler, loader.sampler], set()
    for _ in range(12):
        if not todo:
            break
        found = todo.pop(0)
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        for count, index in RANK_ATTRIBUTES:
            number, position = getattr(found, count, None), getattr(found, index, None)
            if type(number) is int and type(position) is int and number > 1 and 0 <= position < number:
                return found
        todo += [getattr(found, "batch_sampler", None), getattr(found, "sampler", None)]
    return None


def _distribute(sampler: Any, world: World, seed: int) -> DistributedSampler:
    """The distributed counterpart of ``sampler`` for this rank."""
    if type(sampler) is SequentialSampler:
        return AutoEpochSampler(sampler.data_source, world=world, shuffle=False, seed=seed)
    if (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler.num_samples == len(sampler.data_source)
    ):
        return AutoEpochSampler(sampler.data_source, world=world, shuffle=True, seed=seed, original=sampler)
    return ShardedSampler(sampler, world=world, seed=seed)


def user_seed(loader: DataLoader, number: int = 0) -> int:
    """The shuffle seed for ``loader``, the ``number``-th loader sharded in this run (see ``_user_seed``)."""
    batch_sampler = loader.batch_sampler
    if loader.batch_size is None and batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return _user_seed(loader, batch_sampler, number)
    sampler = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    return _user_seed(loader, sampler, number)


def _user_seed(loader: DataLoader, sampler: Any, number: int = 0) -> int:
    """The seed the user chose: the next draw of the sampler's or loader's generator, else torch's seed.

    As in one process: a generator the user passed decides the order, so a fresh one seeded alike
    repeats it, and one reused by the loaders of later epochs moves on (by one process's draws:
    the generator is read from a copy, never drawn from here). Without one, the ``number``-th
    loader of the run (a loader made anew every epoch) gets its own seed derived from torch's. In
    a worker autoddp seeded (``autoddp.in_rank.world.streams``), torch's seed is the caller's unless the
    function set its own.
    """
    for generator in (getattr(sampler, "generator", None), loader.generator):
        if isinstance(generator, torch.Generator):
            copy = torch.Generator(device=generator.device)
            copy.set_state(generator.get_state())
            draw = torch.empty((), dtype=torch.int64, device=generator.device).random_(generator=copy)
            return int(draw.item()) % _SEED_RANGE
    seed = torch.initial_seed()
    if CURRENT.seeds is not None and seed == CURRENT.seeds[0]:
        seed = CURRENT.seeds[1]
    if number:
        seed = streams.derive(seed.to_bytes(8, "little"), number)
    return seed % _SEED_RANGE


def _shared_seed(seed: int, world: World) -> int:
    """Rank 0's ``seed`` on every rank, so all of them shuffle alike even when spawned."""
    import torch.distributed as dist

    if world.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return seed
    value = torch.tensor([seed], dtype=torch.int64, device=comm_device(torch.device("cpu")))
    dist.broadcast(value, src=0)
    return int(value.item())


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
