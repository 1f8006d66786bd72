"""DataLoader sharding and gather: real 2-process gloo worlds, nothing in torch.distributed mocked."""

from __future__ import annotations

import inspect
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import interleave
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)
from torch.utils.data.distributed import DistributedSampler

import autoddp
from autoddp import ConfigurationError
from autoddp.core.state import World
from autoddp.in_rank.data.gather import gather
from autoddp.in_rank.data.loaders import shard_loader
from autoddp.in_rank.world import current

pytestmark = pytest.mark.smoke  # CI runs these on the lowest and the newest torch too (-m smoke)


class Indices(Dataset):
    """Item i is i; ``marker`` shows whether worker_init_fn ran in the DataLoader worker."""

    def __init__(self, n: int):
        self.n = n
        self.marker = "main"

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Marked(Indices):
    def __getitem__(self, i):
        return i, self.marker


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(6))


class Pairs(Sampler):
    """A custom batch sampler: consecutive pairs, in an order shuffled by the global RNG."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n // 2

    def __iter__(self):
        for b in torch.randperm(self.n // 2).tolist():
            yield [2 * b, 2 * b + 1]


class Sized(DataLoader):
    """A DataLoader subclass whose own ``__init__`` takes none of DataLoader's arguments."""

    def __init__(self, dataset, *, size, workers=0):
        self.size = size
        super().__init__(
            dataset, batch_size=size, shuffle=True, num_workers=workers, persistent_workers=workers > 0
        )


class Same(DataLoader):
    """A DataLoader subclass with DataLoader's own signature."""


def mark_worker(worker_id):
    get_worker_info().dataset.marker = f"worker{worker_id}"


def tagged_collate(batch):
    return "tagged", [i for i, _ in batch], sorted({m for _, m in batch})


def _all(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _flat(loader):
    """One epoch of a loader of ints, as a flat list."""
    return [i for batch in loader for i in torch.as_tensor(batch).reshape(-1).tolist()]


def _joined(batches):
    return [i for batch in batches for i in batch]


def _assert_partition(shares, n):
    """Each rank's share is disjoint from the others and together they cover range(n)."""
    assert all(len(s) == len(shares[0]) for s in shares)
    assert sorted(interleave(shares)) == list(range(n))


# -- order: shuffling, epochs, seeds -------------------------------------------------------------


@autoddp.distributed(nproc=2)
def _shuffled_epochs(seed):
    torch.manual_seed(seed)
    loader = DataLoader(Indices(10), batch_size=3, shuffle=True)
    sharded = shard_loader(loader, current())
    epochs = [_flat(sharded) for _ in range(3)]
    sharded.sampler.set_epoch(0)
    again = [_flat(sharded) for _ in range(2)]

    # The seed comes from the loader's generator when it has one, whatever torch.manual_seed says.
    orders = []
    for global_seed in (seed, seed + 1):
        torch.manual_seed(global_seed)
        with_generator = DataLoader(Indices(10), shuffle=True, generator=torch.Generator().manual_seed(5))
        orders.append(_flat(autoddp.prepare(with_generator)))
    return {
        "same_object": sharded is loader,
        "distributed": isinstance(sharded.sampler, DistributedSampler),
        "batch_sampler": type(sharded.batch_sampler).__name__,
        "batches": len(sharded),
        "epochs": _all(epochs),
        "again": again,
        "generator_orders": orders,
    }


def test_shuffled_epochs_are_disjoint_complete_different_and_seeded():
    first, repeat, other = _shuffled_epochs(1), _shuffled_epochs(1), _shuffled_epochs(2)
    assert first["same_object"] and first["distributed"] and first["batch_sampler"] == "BatchSampler"
    assert first["batches"] == 2  # 5 samples per rank in batches of 3
    rank0, rank1 = first["epochs"]
    globals_ = []
    for epoch in range(3):
        _assert_partition([rank0[epoch], rank1[epoch]], 10)
        globals_.append(interleave([rank0[epoch], rank1[epoch]]))
    assert len({tuple(order) for order in globals_}) == 3  # every epoch reshuffles
    assert first["again"] == rank0[:2]  # set_epoch(0) wins, then the epochs continue from it
    assert repeat["epochs"] == first["epochs"]  # same torch.manual_seed, same order
    assert other["epochs"][0][0] != first["epochs"][0][0]  # another seed, another order
    assert first["generator_orders"][0] == first["generator_orders"][1]


@autoddp.distributed(nproc=2, start_method="spawn")
def _seeds_differ_per_rank():
    torch.manual_seed(100 + autoddp.rank())  # as if each process had seeded itself differently
    loader = autoddp.prepare(DataLoader(Indices(9), batch_size=2, shuffle=True))
    return _all(_flat(loader)), _all(len(loader))


def test_ranks_agree_on_the_order_even_when_seeded_differently():
    shares, lengths = _seeds_differ_per_rank()
    assert lengths == [3, 3]
    assert [len(s) for s in shares] == [5, 5]  # 9 samples padded to 10
    order = interleave(shares)
    assert sorted(order[:9]) == list(range(9)) and order[9] == order[0]


@autoddp.distributed(nproc=2)
def _odd_sizes():
    out = {}
    for shuffle in (False, True):
        loader = autoddp.prepare(DataLoader(Indices(11), batch_size=2, shuffle=shuffle))
        batches = [b.tolist() for b in loader]
        out[shuffle] = _all((len(loader), len(batches), [i for b in batches for i in b]))
    return out


def test_odd_dataset_gives_every_rank_the_same_number_of_batches():
    out = _odd_sizes()
    (len0, seen0, seq0), (len1, seen1, seq1) = out[False]
    assert len0 == len1 == seen0 == seen1 == 3
    assert seq0 == [0, 2, 4, 6, 8, 10] and seq1 == [1, 3, 5, 7, 9, 0]  # padded from the start
    (len0, seen0, shuf0), (len1, seen1, shuf1) = out[True]
    assert len0 == len1 == seen0 == seen1 == 3
    order = interleave([shuf0, shuf1])
    assert sorted(order[:11]) == list(range(11)) and order[11] == order[0]


# -- settings and classes ------------------------------------------------------------------------


@autoddp.distributed(nproc=2)
def _settings_survive():
    import multiprocessing

    generator = torch.Generator().manual_seed(3)
    context = multiprocessing.get_context("fork")
    full = DataLoader(
        Indices(20),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        collate_fn=tagged_collate,
        pin_memory=True,
        drop_last=True,
        timeout=30,
        worker_init_fn=mark_worker,
        multiprocessing_context=context,
        generator=generator,
        prefetch_factor=3,
        persistent_workers=True,
        pin_memory_device="cpu",
        **IN_ORDER,
    )
    before = {name: getattr(full, name) for name in SETTINGS}
    sharded = shard_loader(full, current())
    after = {name: getattr(sharded, name) for name in SETTINGS}
    kept = {name: after[name] is before[name] or after[name] == before[name] for name in SETTINGS}

    loader = DataLoader(
        Marked(12),
        batch_size=3,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        worker_init_fn=mark_worker,
        collate_fn=tagged_collate,
        generator=torch.Generator().manual_seed(4),
    )
    sharded_loader = autoddp.prepare(loader)
    epochs = []
    for _ in range(2):
        epochs.append(list(sharded_loader))
    iterators_reused = sharded_loader._iterator is not None
    return {
        "same": sharded is full and sharded_loader is loader,
        "kept": kept,
        "generator": sharded.generator is generator,
        "context": sharded.multiprocessing_context is context,
        "epochs": _all(epochs),
        "persistent": iterators_reused,
    }


# in_order exists from torch 2.6 on.
IN_ORDER = {"in_order": False} if "in_order" in inspect.signature(DataLoader).parameters else {}
SETTINGS = [
    "batch_size",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    *IN_ORDER,
    "dataset",
]


def test_every_setting_survives_and_persistent_workers_iterate_two_epochs():
    out = _settings_survive()
    assert out["same"] and out["generator"] and out["context"] and out["persistent"]
    assert out["kept"] == dict.fromkeys(SETTINGS, True)
    rank0, rank1 = out["epochs"]
    orders = []
    for epoch in range(2):
        shares = []
        for batches in (rank0[epoch], rank1[epoch]):
            assert len(batches) == 2  # 6 samples per rank in batches of 3
            assert all(tag == "tagged" for tag, _, _ in batches)  # collate_fn kept
            assert all(markers and all(m.startswith("worker") for m in markers) for *_, markers in batches)
            shares.append([i for _, ids, _ in batches for i in ids])
        _assert_partition(shares, 12)
        orders.append(interleave(shares))
    assert orders[0] != orders[1]


@autoddp.distributed(nproc=2, capture=False)  # prepare's own rules: capture would shard at list(loader)
def _rebuilt_after_persistent_iteration():
    out = {}
    loader = Same(
        Indices(12),
        batch_size=3,
        shuffle=True,
        num_workers=1,
        persistent_workers=True,
        worker_init_fn=mark_worker,
        collate_fn=torch.utils.data.default_collate,
        generator=torch.Generator().manual_seed(8),
        timeout=20,
    )
    list(loader)  # the persistent iterator now holds the old sampler
    rebuilt = autoddp.prepare(loader)
    out["class"] = type(rebuilt).__name__
    out["new_object"] = rebuilt is not loader
    out["kept"] = all(
        getattr(rebuilt, name) is getattr(loader, name) or getattr(rebuilt, name) == getattr(loader, name)
        for name in SETTINGS
    )
    out["sharded"] = _all([_flat(rebuilt), _flat(rebuilt)])

    batched = DataLoader(
        Indices(12),
        batch_sampler=BatchSampler(RandomSampler(range(12)), 4, False),
        num_workers=1,
        persistent_workers=True,
    )
    list(batched)
    rebuilt_batches = autoddp.prepare(batched)
    batches = [b.tolist() for b in rebuilt_batches]
    out["batches"] = _all(batches)
    out["batch_sampler_kept"] = type(rebuilt_batches.batch_sampler) is BatchSampler and isinstance(
        rebuilt_batches.sampler, DistributedSampler
    )

    own_init = Sized(Indices(12), size=3, workers=1)
    list(own_init)
    try:
        autoddp.prepare(own_init)
        out["refused"] = None
    except ConfigurationError as error:
        out["refused"] = str(error)
    return out


def test_loader_iterated_with_persistent_workers_is_rebuilt_with_its_settings():
    out = _rebuilt_after_persistent_iteration()
    assert out["class"] == "Same" and out["new_object"] and out["kept"]
    rank0, rank1 = out["sharded"]
    for epoch in range(2):
        _assert_partition([rank0[epoch], rank1[epoch]], 12)
    assert rank0[0] != rank0[1]
    b0, b1 = out["batches"]
    assert [len(b) for b in b0] == [4, 2] and [len(b) for b in b1] == [4, 2]  # still batched
    _assert_partition([_joined(b0), _joined(b1)], 12)
    assert out["batch_sampler_kept"]
    assert "Sized" in out["refused"] and "before the first iteration" in out["refused"]


@autoddp.distributed(nproc=2)
def _subclass_in_place():
    loader = Sized(Indices(8), size=2)
    sharded = autoddp.prepare(loader)
    return sharded is loader, type(sharded).__name__, sharded.size, _all(_flat(sharded))


def test_subclass_with_its_own_init_keeps_its_class():
    same, name, size, shares = _subclass_in_place()
    assert same and name == "Sized" and size == 2
    _assert_partition(shares, 8)


# -- samplers and batch samplers -----------------------------------------------------------------


@autoddp.distributed(nproc=2)
def _batch_samplers():
    torch.manual_seed(autoddp.rank())  # Pairs draws from the global RNG: ranks must still agree
    plain = autoddp.prepare(
        DataLoader(Indices(10), batch_sampler=BatchSampler(RandomSampler(range(10)), 3, False))
    )
    custom = autoddp.prepare(DataLoader(Indices(10), batch_sampler=Pairs(10)))
    return {
        "plain": _all([[b.tolist() for b in plain] for _ in range(2)]),
        "plain_kind": (plain.batch_size, type(plain.batch_sampler).__name__),
        "plain_distributed": isinstance(plain.batch_sampler.sampler, DistributedSampler),
        "custom": _all([[b.tolist() for b in custom] for _ in range(2)]),
        "custom_len": _all(len(custom)),
    }


def test_batch_samplers_stay_batched_and_are_distributed():
    out = _batch_samplers()
    assert out["plain_kind"] == (None, "BatchSampler") and out["plain_distributed"]
    rank0, rank1 = out["plain"]
    for epoch in range(2):
        assert [len(b) for b in rank0[epoch]] == [len(b) for b in rank1[epoch]] == [3, 2]
        _assert_partition([_joined(rank0[epoch]), _joined(rank1[epoch])], 10)
    assert rank0[0] != rank0[1]

    # Pairs: 5 batches, shared out whole; rank 1's last batch repeats the first one.
    assert out["custom_len"] == [3, 3]
    rank0, rank1 = out["custom"]
    for epoch in range(2):
        assert len(rank0[epoch]) == len(rank1[epoch]) == 3
        order = interleave([rank0[epoch], rank1[epoch]])
        assert sorted(order[:5]) == [[2 * b, 2 * b + 1] for b in range(5)] and order[5] == order[0]
    assert rank0[0] != rank0[1] or rank1[0] != rank1[1]


@autoddp.distributed(nproc=2)
def _other_samplers(seed):
    torch.manual_seed(seed)
    torch.rand(autoddp.rank() + 1)  # the ranks' global RNG states now differ, their seeds do not
    weights = torch.arange(1.0, 21.0)
    weighted = autoddp.prepare(
        DataLoader(Indices(20), batch_size=4, sampler=WeightedRandomSampler(weights, 12, replacement=False))
    )
    subset = autoddp.prepare(
        DataLoader(
            Indices(20),
            batch_size=4,
            sampler=SubsetRandomSampler(list(range(1, 20, 2)), generator=torch.Generator().manual_seed(9)),
        )
    )
    return {
        "weighted": _all([_flat(weighted) for _ in range(2)]),
        "subset": _all([_flat(subset) for _ in range(2)]),
        "distributed": [isinstance(x.sampler, DistributedSampler) for x in (weighted, subset)],
    }


def test_other_samplers_are_shared_out_disjointly():
    out = _other_samplers(0)
    assert out["distributed"] == [True, True]
    rank0, rank1 = out["weighted"]
    for epoch in range(2):
        assert len(rank0[epoch]) == len(rank1[epoch]) == 6
        order = interleave([rank0[epoch], rank1[epoch]])
        assert len(set(order)) == 12  # drawn without replacement: ranks share one draw
    assert rank0[0] != rank0[1]
    rank0, rank1 = out["subset"]
    for epoch in range(2):
        assert len(rank0[epoch]) == len(rank1[epoch]) == 5
        assert sorted(rank0[epoch] + rank1[epoch]) == list(range(1, 20, 2))
    assert rank0[0] != rank0[1]
    again = _other_samplers(0)
    assert again["weighted"] == out["weighted"] and again["subset"] == out["subset"]
    assert _other_samplers(1)["weighted"] != out["weighted"]


@pytest.mark.unit
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_sharded_pass_hands_out_its_items_without_a_python_frame_each(shuffle):
    """The training step's data: torch's DistributedSampler hands out a list's items, and so does
    autoddp's (no generator of its own resumed per item), with one process's draws (the pass's
    seed) made on the user's stream as that sampler's pass makes them."""
    from autoddp.in_rank.data.samplers import AutoEpochSampler

    data = range(4096)
    original = RandomSampler(data) if shuffle else SequentialSampler(data)
    sampler = AutoEpochSampler(
        data, world=World(rank=1, world_size=2), shuffle=shuffle, seed=7, original=original
    )
    sampler.set_epoch(1)
    list(sampler)  # epoch 1 (what a first pass imports is not counted)
    torch.manual_seed(3)
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
    try:
        items = list(sampler)
    finally:
        sys.setprofile(None)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    list(original)  # one process's pass
    assert torch.equal(after, torch.get_rng_state())
    torch_order = DistributedSampler(data, num_replicas=2, rank=1, shuffle=shuffle, seed=7)
    torch_order.set_epoch(2)
    assert items == list(torch_order)
    assert len(calls) < 30, calls[:40]  # a few per pass, not 2048 (one per item)


# -- loaders left alone --------------------------------------------------------------------------


@autoddp.distributed(nproc=2)
def _left_alone():
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        own = DistributedSampler(Indices(8))
        loader = DataLoader(Indices(8), batch_size=2, sampler=own)
        out["own"] = autoddp.prepare(loader) is loader and loader.sampler is own
        batched = DataLoader(Indices(8), batch_sampler=BatchSampler(DistributedSampler(Indices(8)), 2, False))
        inner = batched.batch_sampler
        out["batched"] = autoddp.prepare(batched) is batched and batched.batch_sampler is inner
        twice = autoddp.prepare(DataLoader(Indices(8), shuffle=True))
        sampler = twice.sampler
        out["twice"] = autoddp.prepare(twice) is twice and twice.sampler is sampler
        stream = DataLoader(Stream(), batch_size=2)
        stream_sampler = stream.sampler
        out["stream"] = autoddp.prepare(stream) is stream and stream.sampler is stream_sampler
        out["stream_items"] = _flat(stream)
    out["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    return out


def test_distributed_and_iterable_loaders_are_left_alone_with_a_warning():
    out = _left_alone()
    assert out["own"] and out["batched"] and out["twice"] and out["stream"]
    assert out["stream_items"] == list(range(6))
    messages = out["warnings"]
    assert all(category == "AutoDDPWarning" for category, _ in messages)
    sharded = [m for _, m in messages if "already sharded; left as is" in m]
    assert len(sharded) == 3
    assert "set_epoch" in sharded[0] and "set_epoch" not in sharded[2]
    streams = [m for _, m in messages if "IterableDataset" in m]
    assert len(streams) == 1 and "autoddp.rank()" in streams[0] and "get_worker_info" in streams[0]


@pytest.mark.unit
def test_world_of_one_returns_the_loader_unchanged():
    loader = DataLoader(Indices(5), batch_size=2, shuffle=True)
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    assert shard_loader(loader, World()) is loader
    assert loader.sampler is sampler and loader.batch_sampler is batch_sampler


# -- gather --------------------------------------------------------------------------------------


def _values(batch):
    return torch.stack([batch.float() * 10, batch.float() ** 2], dim=1)


@autoddp.distributed(nproc=2)
def _gathered():
    out = {}
    loader = autoddp.prepare(DataLoader(Indices(11), batch_size=3))
    rows = torch.cat([_values(batch) for batch in loader])
    out["ordered"] = gather(rows, loader)
    out["indices"] = gather(torch.cat(list(loader)), loader)

    shuffled = autoddp.prepare(DataLoader(Indices(11), batch_size=4, shuffle=True))
    out["shuffled"] = gather(torch.cat(list(shuffled)), shuffled)

    batched = autoddp.prepare(DataLoader(Indices(11), batch_sampler=BatchSampler(range(11), 2, False)))
    out["batched"] = gather(torch.cat(list(batched)), batched)

    rank = autoddp.rank()
    out["concatenated"] = gather(torch.full((2 + rank,), rank))
    out["uneven_2d"] = gather(torch.arange(6 * (rank + 1)).reshape(3 * (rank + 1), 2) + 100 * rank)
    out["empty_on_one"] = gather(torch.ones(rank * 2, dtype=torch.bool))

    dropping = autoddp.prepare(DataLoader(Indices(11), batch_size=4, drop_last=True))
    try:
        gather(torch.cat(list(dropping)), dropping)
        out["refused"] = None
    except ConfigurationError as error:
        out["refused"] = str(error)
    out["refused_everywhere"] = _all(out["refused"] is not None)
    return out


def test_gather_restores_the_single_process_order():
    out = _gathered()
    single = torch.cat([_values(batch) for batch in DataLoader(Indices(11), batch_size=3)])
    assert torch.equal(out["ordered"], single)
    assert out["indices"].tolist() == list(range(11))
    assert sorted(out["shuffled"].tolist()) == list(range(11))
    assert out["batched"].tolist() == list(range(11))
    assert out["concatenated"].tolist() == [0, 0, 1, 1, 1]
    expected = torch.cat([torch.arange(6).reshape(3, 2), torch.arange(12).reshape(6, 2) + 100])
    assert torch.equal(out["uneven_2d"], expected)
    assert out["empty_on_one"].tolist() == [True, True] and out["empty_on_one"].dtype == torch.bool
    assert "drop_last" in out["refused"] and "without loader=" in out["refused"]
    assert out["refused_everywhere"] == [True, True]


@pytest.mark.unit
def test_gather_outside_a_process_group_returns_the_tensor():
    t = torch.arange(3)
    assert gather(t) is t
    assert gather(t, DataLoader(Indices(3))) is t


@pytest.mark.unit
def test_sequential_sampler_mapping_in_a_plain_call():
    # Without a process group nothing is broadcast; the sampler is still shared out by rank.
    shares = []
    for rank in range(2):
        loader = DataLoader(Indices(5), sampler=SequentialSampler(range(5)), batch_size=2)
        shares.append(_flat(shard_loader(loader, World(rank=rank, world_size=2))))
    assert shares == [[0, 2, 4], [1, 3, 0]]


@pytest.mark.parametrize("bad", [torch.tensor(1.0), [1, 2]])
def test_gather_refuses_what_has_no_rows(bad):
    @autoddp.distributed(nproc=2)
    def run():
        try:
            gather(bad)
        except ConfigurationError as error:
            return str(error)

    assert "gather()" in run()
