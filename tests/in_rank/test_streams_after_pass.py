"""The user's random streams after a sharded pass are one process's, and workers' seeds differ by rank.

One process's sampler draws from the user's streams at every pass (``RandomSampler`` without a
generator takes a seed from torch's global generator, one with a generator advances it); the
sharded sampler draws its order from states of its own. Real 2-process gloo runs of an unchanged
script under ``autoddp -n 2`` are compared with ``python script.py``: what the script draws after
one and two epochs (``torch.rand``, a model made for the next fold, the sampler's generator,
``random`` and NumPy) for every kind of torch's random samplers and samplers of one's own, and
the seeds the DataLoader workers get (rank 0's are one process's, rank 1's its own).
"""

from __future__ import annotations

import json

import torch
from torch.utils.data import DataLoader, TensorDataset

import autoddp
from conftest import run_python, write

SCRIPT = r"""
import json, random, sys
import numpy
import torch
from torch.utils.data import (DataLoader, RandomSampler, Sampler, SubsetRandomSampler, TensorDataset,
                              WeightedRandomSampler)

torch.manual_seed(0)
random.seed(0)
numpy.random.seed(0)
data = TensorDataset(torch.randn(20, 3), torch.randn(20, 1))


class Buckets(Sampler):
    "A bucket sampler of one's own: random shuffles its buckets in place, NumPy each bucket."

    def __init__(self, n):
        self.buckets = [list(range(start, min(start + 4, n))) for start in range(0, n, 4)]

    def __len__(self):
        return sum(map(len, self.buckets))

    def __iter__(self):
        random.shuffle(self.buckets)
        for bucket in self.buckets:
            yield from numpy.random.permutation(bucket).tolist()


class Batches(Sampler):
    "A batch sampler of one's own, shuffling with torch's global generator."

    def __len__(self):
        return 5

    def __iter__(self):
        order = torch.randperm(20).tolist()
        return iter([order[i : i + 4] for i in range(0, 20, 4)])


def sampler(kind):
    generator = torch.Generator().manual_seed(7)
    return {
        "shuffle": None,
        "shuffle-generator": RandomSampler(data, generator=generator),
        "replacement": RandomSampler(data, replacement=True, num_samples=26),
        "replacement-generator": RandomSampler(data, replacement=True, num_samples=70, generator=generator),
        "num-samples-generator": RandomSampler(data, num_samples=33, generator=generator),
        "subset": SubsetRandomSampler(list(range(3, 17))),
        "subset-generator": SubsetRandomSampler(list(range(3, 17)), generator=generator),
        "weighted": WeightedRandomSampler([1.0] * 10 + [3.0] * 10, 24),
        "weighted-generator": WeightedRandomSampler([1.0] * 20, 18, replacement=False, generator=generator),
        "buckets": Buckets(20),
        "batches": Batches(),
    }[kind], generator


seen = {}
for kind in sys.argv[2].split(","):
    chosen, generator = sampler(kind)
    for fold in range(2):  # k-fold: a new model for every fold
        model = torch.nn.Linear(3, 1)
        seen[f"{kind} {fold} first weights"] = model.weight.tolist()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if kind == "batches":
            loader = DataLoader(data, batch_sampler=chosen)
        else:
            loader = DataLoader(data, batch_size=4, sampler=chosen, shuffle=chosen is None)
        for epoch in range(2):
            for x, y in loader:
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
            seen[f"{kind} {fold} {epoch}"] = {
                "torch": torch.rand(1).item(),
                "random": random.random(),
                "numpy": float(numpy.random.rand()),
                "generator": torch.rand(1, generator=generator).item(),
            }

# "train for N iterations" on a huge sampler: a loop left early has drawn what one process's did
generator = torch.Generator().manual_seed(3)
huge = RandomSampler(data, replacement=True, num_samples=10**9, generator=generator)
for step, _ in enumerate(DataLoader(data, batch_size=4, sampler=huge)):
    if step == 20:
        break
seen["huge"] = {"torch": torch.rand(1).item(), "generator": torch.rand(1, generator=generator).item()}

rank = __import__("os").environ.get("RANK", "one")
with open(f"{sys.argv[1]}.{rank}", "w") as f:
    json.dump(seen, f)
"""

KINDS = (
    "shuffle,shuffle-generator,replacement,replacement-generator,num-samples-generator,"
    "subset,subset-generator,weighted,weighted-generator,buckets,batches"
)


def test_the_streams_after_every_pass_are_one_processs_for_every_sampler_kind(tmp_path):
    script = write(tmp_path / "folds.py", SCRIPT)
    out = str(tmp_path / "seen")
    one = run_python([str(script), out, KINDS])
    assert one.returncode == 0, one.stderr
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script), out, KINDS])
    assert result.returncode == 0, result.stderr
    reference = json.loads((tmp_path / "seen.one").read_text())
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"seen.{rank}").read_text())
        for key, expected in reference.items():
            assert seen[key] == expected, (rank, key)


WORKERS_SCRIPT = r"""
import json, os, random, sys
import numpy
import torch
from torch.utils.data import DataLoader, Dataset


class Augmented(Dataset):
    "Each sample is the augmentation its worker draws: torch's, random's and NumPy's."

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([torch.rand(1).item(), random.random(), float(numpy.random.rand())])


def seed_worker(worker_id):  # torch's reproducibility recipe
    seed = torch.initial_seed() % 2**32
    numpy.random.seed(seed)
    random.seed(seed)


torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=1,
                    worker_init_fn=seed_worker, generator=torch.Generator().manual_seed(0))
drawn = []
for epoch in range(2):
    for batch in loader:
        drawn += sorted(batch.tolist())
        optimizer.zero_grad()
        model(batch).sum().backward()
        optimizer.step()
after = torch.rand(1).item()
with open(f"{sys.argv[1]}.{os.environ.get('RANK', 'one')}", "w") as f:
    json.dump({"drawn": drawn, "after": after}, f)
"""


def test_dataloader_workers_augment_differently_on_every_rank(tmp_path):
    script = write(tmp_path / "augment.py", WORKERS_SCRIPT)
    out = str(tmp_path / "drawn")
    one = run_python([str(script), out])
    assert one.returncode == 0, one.stderr
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script), out])
    assert result.returncode == 0, result.stderr
    reference = json.loads((tmp_path / "drawn.one").read_text())
    rank0, rank1 = (json.loads((tmp_path / f"drawn.{rank}").read_text()) for rank in (0, 1))
    one_process = set(map(tuple, reference["drawn"]))
    assert set(map(tuple, rank0["drawn"])) <= one_process  # rank 0's workers are one process's
    assert not set(map(tuple, rank1["drawn"])) & set(map(tuple, rank0["drawn"]))  # rank 1's its own
    assert rank0["after"] == rank1["after"] == reference["after"]


UNCOPYABLE_SCRIPT = r"""
import threading
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset


class Locked(Sampler):
    "A sampler holding a lock: it cannot be copied."

    def __init__(self):
        self.lock = threading.Lock()

    def __len__(self):
        return 8

    def __iter__(self):
        return iter(torch.randperm(8).tolist())


torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for (x,) in DataLoader(TensorDataset(torch.randn(8, 1)), batch_size=2, sampler=Locked()):
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()
"""


def test_a_sampler_that_cannot_be_copied_is_said_at_the_loop(tmp_path):
    script = write(tmp_path / "locked.py", UNCOPYABLE_SCRIPT)
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script)])
    assert result.returncode == 0, result.stderr
    assert "cannot copy this Locked" in result.stderr
    assert "locked.py:23: AutoDDPWarning: autoddp: cannot copy" in result.stderr  # at the loop's line
    assert "copy.deepcopy(sampler) must work" in result.stderr


def _folds():
    """k-fold in a function: a model per fold, the global generator after each fold's epoch."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    seen = []
    for _ in range(3):
        model = torch.nn.Linear(3, 1)
        seen.append(model.weight.tolist())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in DataLoader(data, batch_size=4, shuffle=True):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        seen.append(torch.rand(1).item())
    return seen


_folds_on_two = autoddp.distributed(nproc=2)(_folds)


def test_k_fold_in_a_decorated_function_makes_one_processs_models():
    assert _folds_on_two() == _folds()
