"""Loaders that plain code makes, captured: huge and endless samplers, samplers of one's own,
loaders re-created every epoch, too few samples for a batch, DataLoader subclasses.

Real 2-process gloo runs under the decorator and the command; each test checks the exact indices
every rank saw (disjoint, complete per epoch, the same draw on every rank) or the exact message.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
import torch.distributed as dist
from helpers import interleave
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler

import autoddp
from autoddp import ConfigurationError
from conftest import run_python, write

HUGE = int(1e10)  # "train for N iterations": a sampler far longer than any list could hold


class Indices(Dataset):
    """Item i is i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _all(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# -- 1. huge and endless samplers are streamed, not drawn in full --------------------------------

STEPS = 2500  # 10,000 items per rank: the order is drawn in several parts


@autoddp.distributed(nproc=2)
def _huge_sampler():
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)  # a model in training
    torch.optim.SGD(model.parameters(), lr=0.1)
    data = Indices(10)
    loader = DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True, num_samples=HUGE))
    length = len(loader)
    seen, draws = [], []
    batches = iter(loader)
    state = torch.get_rng_state()
    for _ in range(STEPS):
        seen += next(batches).tolist()
        draws.append(torch.rand(1).item())  # the user's own draws between batches (dropout, noise)
    torch.set_rng_state(state)
    torch.empty((), dtype=torch.int64).random_()  # as one process's RandomSampler: its seed
    replay = [torch.rand(1).item() for _ in range(STEPS)]
    return {"len": length, "seen": _all(seen), "own_stream": draws == replay, "seed": loader.sampler.seed}


def test_a_huge_sampler_is_streamed_and_shared_out_by_position():
    out = _huge_sampler()
    assert out["len"] == HUGE // 2 // 4
    shares = out["seen"]
    assert len(shares[0]) == len(shares[1]) == STEPS * 4
    # one draw, made under the shared seed, dealt out by position: rank r takes every 2nd item
    reference = RandomSampler(
        Indices(10), replacement=True, num_samples=HUGE, generator=torch.Generator().manual_seed(out["seed"])
    )
    assert interleave(shares) == list(itertools.islice(reference, 2 * STEPS * 4))
    assert out["own_stream"]  # the user's stream: one process's sampler's draw, then the user's draws


class Forever(Sampler):
    """An endless sampler with no length: one shuffled pass of range(n) after another."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        while True:
            yield from torch.randperm(self.n).tolist()


@autoddp.distributed(nproc=2)
def _endless_sampler():
    model = torch.nn.Linear(1, 1)  # a model in training
    torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Indices(10), batch_size=3, sampler=Forever(10))
    seen = []
    for step, batch in enumerate(loader):
        seen += batch.tolist()
        torch.rand(autoddp.rank() + 1)  # the ranks draw differently in between: the order is unmoved
        if step == 2999:
            break
    try:
        len(loader)
    except TypeError:  # as in one process: an endless sampler has no length
        length = None
    return {"seen": _all(seen), "len": length, "seed": loader.sampler.seed}


def test_an_endless_sampler_without_a_length_is_streamed():
    out = _endless_sampler()
    assert out["len"] is None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(out["seed"])
        reference = list(itertools.islice(iter(Forever(10)), 2 * 3000 * 3))
    assert interleave(out["seen"]) == reference


ENDLESS_SCRIPT = """
    import json, os, sys, torch
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)  # a model in training
    torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(10))
    iterations = RandomSampler(data, replacement=True, num_samples=int(1e10))
    loader = DataLoader(data, batch_size=2, sampler=iterations)
    seen = []
    for step, (i,) in enumerate(loader):  # train for 100 iterations
        seen += i.tolist()
        if step == 99:
            break
    with open(sys.argv[1] + "." + os.environ.get("RANK", "0"), "w") as f:
        json.dump({"seen": seen, "len": len(loader), "seed": getattr(loader.sampler, "seed", None)}, f)
"""


def test_an_unmodified_script_trains_for_n_iterations_on_a_huge_sampler(tmp_path):
    script = write(tmp_path / "iterations.py", ENDLESS_SCRIPT)
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script), str(tmp_path / "out")])
    assert result.returncode == 0, result.stderr
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1)]
    assert [r["len"] for r in ranks] == [HUGE // 2 // 2] * 2
    assert ranks[0]["seed"] == ranks[1]["seed"]
    generator = torch.Generator().manual_seed(ranks[0]["seed"])
    reference = RandomSampler(Indices(10), replacement=True, num_samples=HUGE, generator=generator)
    assert interleave([r["seen"] for r in ranks]) == list(itertools.islice(reference, 400))
    assert "sharded" in result.stderr


# -- 3. samplers of one's own that shuffle with Python's random or NumPy -------------------------


class Buckets(Sampler):
    """A bucket sampler of one's own: Python's random shuffles the buckets, NumPy each bucket."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        import numpy

        buckets = [list(range(start, min(start + 8, self.n))) for start in range(0, self.n, 8)]
        random.shuffle(buckets)
        return iter([i for bucket in buckets for i in numpy.random.permutation(bucket).tolist()])


class Augmented(Indices):
    """A dataset that augments with Python's random in __getitem__ (between the sampler's draws)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.draws: list[float] = []

    def __getitem__(self, i: int) -> int:
        self.draws.append(random.random())
        return i


@autoddp.distributed(nproc=2)
def _own_sampler():
    import numpy

    model = torch.nn.Linear(1, 1)  # a model in training
    torch.optim.SGD(model.parameters(), lr=0.1)

    random.seed(autoddp.rank())  # the ranks' own streams differ: the order must not
    numpy.random.seed(autoddp.rank())
    data = Augmented(40)
    loader = DataLoader(data, batch_size=4, sampler=Buckets(40))
    epochs, own = [], []
    for _ in range(3):
        batches = iter(loader)
        state = random.getstate()
        order, draws = [], []
        for batch in batches:
            order += batch.tolist()
            draws.append(random.random())
        random.setstate(state)  # replay: one process's sampler shuffles 5 buckets, then per batch
        random.shuffle([None] * 5)  # the dataset's 4 draws and the step's
        replay = [[random.random() for _ in range(5)] for _ in range(5)]
        own.append(replay == [[*data.draws[4 * b : 4 * b + 4], draws[b]] for b in range(5)])
        data.draws.clear()
        epochs.append(order)
    return {"epochs": _all(epochs), "own": own}


def test_a_sampler_shuffling_with_random_and_numpy_is_split_disjointly():
    out = _own_sampler()
    rank0, rank1 = out["epochs"]
    for epoch in range(3):
        assert sorted(rank0[epoch] + rank1[epoch]) == list(range(40))  # none unseen, none twice
    assert len({tuple(interleave([rank0[e], rank1[e]])) for e in range(3)}) == 3  # reshuffled
    assert out["own"] == [True] * 3  # the user's random stream advances as one process's


# -- 4. a DataLoader made anew every epoch reshuffles, as in one process -------------------------


def _new_loader_every_epoch():
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)  # a model in training
    torch.optim.SGD(model.parameters(), lr=0.1)
    data = Indices(16)
    reused = torch.Generator().manual_seed(5)
    epochs = {"global": [], "fresh": [], "reused": []}
    for _ in range(3):
        for name, orders in epochs.items():
            generator = {"global": None, "fresh": torch.Generator().manual_seed(5), "reused": reused}[name]
            loader = DataLoader(data, batch_size=4, shuffle=True, generator=generator)
            orders.append([i for batch in loader for i in batch.tolist()])
    return epochs


@autoddp.distributed(nproc=2)
def _new_loader_every_epoch_on_two():
    return _all(_new_loader_every_epoch())


def test_a_loader_made_anew_every_epoch_reshuffles_as_in_one_process():
    one = _new_loader_every_epoch()
    rank0, rank1 = _new_loader_every_epoch_on_two()
    for name in ("global", "fresh", "reused"):
        orders = [interleave([rank0[name][e], rank1[name][e]]) for e in range(3)]
        assert all(sorted(order) == list(range(16)) for order in orders), name  # disjoint, complete
        # a new order every epoch where one process has one (the global generator, a generator
        # reused), the same order where one process repeats it (a fresh generator, same seed)
        assert len({tuple(order) for order in orders}) == len({tuple(order) for order in one[name]}), name
    assert len({tuple(order) for order in one["global"]}) == 3 and len({tuple(o) for o in one["fresh"]}) == 1


NEW_LOADER_SCRIPT = """
    import json, os, sys, torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)  # a model in training
    torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(16))
    seen = []
    for epoch in range(3):
        loader = DataLoader(data, batch_size=4, shuffle=True)  # made anew every epoch
        seen.append([i for (batch,) in loader for i in batch.tolist()])
    with open(sys.argv[1] + "." + os.environ.get("RANK", "0"), "w") as f:
        json.dump(seen, f)
"""


def test_an_unmodified_script_making_its_loader_every_epoch_reshuffles(tmp_path):
    script = write(tmp_path / "epochs.py", NEW_LOADER_SCRIPT)
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script), str(tmp_path / "out")])
    assert result.returncode == 0, result.stderr
    rank0, rank1 = [json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1)]
    orders = [interleave([rank0[e], rank1[e]]) for e in range(3)]
    assert all(sorted(order) == list(range(16)) for order in orders)
    assert len({tuple(order) for order in orders}) == 3


# -- 7. a drop_last loader that sharding would leave without a batch -----------------------------


def test_a_drop_last_loader_that_sharding_leaves_without_a_batch_is_a_clear_error():
    @autoddp.distributed(nproc=2)
    def train():
        loader = DataLoader(Indices(100), batch_size=64, shuffle=True, drop_last=True)
        for _ in loader:  # one process: 1 batch; each of 2 processes would have 50 samples, no batch
            pass

    with pytest.raises(ConfigurationError) as caught:
        train()
    first = str(caught.value).splitlines()[0]
    note = caught.value.__notes__[0]  # both raise it; either may be first
    assert note.startswith(("autoddp: [rank 0 of 2] raised", "autoddp: [rank 1 of 2] raised")), note
    assert first == (
        "this DataLoader has drop_last=True and batch_size=64: sharded over 2 processes, "
        "each process gets 50 of its 100 samples, fewer than one batch, so it would yield no batch at "
        "all (one process: 1 batch) and nothing would train. Use a batch_size of at most 50 (the "
        "global batch is batch_size x 2), or drop_last=False"
    )


# -- 12. a DataLoader subclass with its own __iter__ (workers reused across epochs) --------------


class Repeating:
    """Goes over a batch sampler again and again, so one loader iterator serves every epoch."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        while True:
            yield from self.sampler


class ReusedWorkers(DataLoader):
    """The user's pattern (as timm's MultiEpochsDataLoader): one iterator, made once, for all epochs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._DataLoader__initialized = False
        self.batch_sampler = Repeating(self.batch_sampler)
        self._DataLoader__initialized = True
        self.iterator = super().__iter__()

    def __len__(self) -> int:
        return len(self.batch_sampler.sampler)

    def __iter__(self):
        for _ in range(len(self)):
            yield next(self.iterator)


@autoddp.distributed(nproc=2)
def _reused_workers():
    torch.manual_seed(0)
    train = ReusedWorkers(Indices(20), batch_size=4, shuffle=True)
    evaluation = ReusedWorkers(Indices(20), batch_size=4)
    epochs, evaluated = [], []
    for _ in range(3):
        epochs.append([i for batch in train for i in batch.tolist()])
        evaluated.append([i for batch in evaluation for i in batch.tolist()])
    return {"epochs": _all(epochs), "evaluated": _all(evaluated), "len": _all([len(train), len(evaluation)])}


def test_a_loader_subclass_with_its_own_iter_is_sharded_or_left_whole_by_its_order(capfd):
    out = _reused_workers()
    assert out["len"] == [[3, 5], [3, 5]]  # 10 samples each in batches of 4; all 20 for evaluation
    rank0, rank1 = out["epochs"]
    orders = [interleave([rank0[e], rank1[e]]) for e in range(3)]
    assert all(sorted(order) == list(range(20)) for order in orders)  # disjoint, complete
    assert len({tuple(order) for order in orders}) == 3  # reshuffled every epoch
    assert out["evaluated"] == [[list(range(20))] * 3] * 2  # in order: every rank all of it
    notice = capfd.readouterr().err
    assert notice.count("sharded, each process takes 1/2") == 1
    assert notice.count("left whole: in order") == 1


# -- the notice names the line that made each loader ---------------------------------------------

SITES_SCRIPT = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    class Sized(DataLoader):
        def __init__(self, dataset, size):
            super().__init__(dataset, batch_size=size, shuffle=True)


    model = torch.nn.Linear(1, 1)  # a model in training
    torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(16))
    train = DataLoader(data, batch_size=4, shuffle=True)  # made here
    own = Sized(data, 4)  # made here
    evaluation = DataLoader(data, batch_size=4)  # made here


    def epoch(loader):
        return [i for (batch,) in loader for i in batch.tolist()]


    for loader in (train, own, evaluation):
        epoch(loader)
"""


def test_the_notice_names_the_line_that_made_each_loader(tmp_path):
    script = write(tmp_path / "sites.py", SITES_SCRIPT)
    made = [n for n, line in enumerate(script.read_text().splitlines(), 1) if line.endswith("# made here")]
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script)])
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "DataLoader (" in line]
    sharded = "sharded, each process takes 1/2 of every epoch; left whole in evaluation passes"
    assert lines == [
        f"autoddp:   DataLoader (sites.py:{made[0]}): {sharded}",
        f"autoddp:   DataLoader (sites.py:{made[1]}): {sharded}",
        f"autoddp:   DataLoader (sites.py:{made[2]}): left whole: in order (shuffle=False, e.g. "
        "evaluation): every rank sees all of it",
    ]
