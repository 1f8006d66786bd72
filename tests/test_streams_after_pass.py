"""The user's random streams after a sharded pass are one process's, and workers' seeds differ by rank.

One process's sampler draws from the user's streams at every pass (``RandomSampler`` without a
generator takes a seed from torch's global generator, one with a generator advances it); the
sharded sampler draws its order from states of its own. Real 2-process gloo runs of an unchanged
script under ``autoddp -n 2`` are compared with ``python script.py``: what the script draws after
one and two epochs (``torch.rand``, a model made for the next fold, the sampler's generator,
``random`` and NumPy) for every kind of torch's random samplers, and the seeds the DataLoader
workers get (rank 0's are one process's, rank 1's its own).
"""

from __future__ import annotations

import json

from conftest import run_python, write

SCRIPT = r"""
import json, random, sys
import numpy
import torch
from torch.utils.data import (DataLoader, RandomSampler, SubsetRandomSampler, TensorDataset,
                              WeightedRandomSampler, get_worker_info)

torch.manual_seed(0)
random.seed(0)
numpy.random.seed(0)
data = TensorDataset(torch.randn(20, 3), torch.randn(20, 1))


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
    }[kind], generator


seen = {}
for kind in sys.argv[2].split(","):
    chosen, generator = sampler(kind)
    for fold in range(2):  # k-fold: a new model for every fold
        model = torch.nn.Linear(3, 1)
        seen[f"{kind} {fold} first weights"] = model.weight.tolist()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
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
    "subset,subset-generator,weighted,weighted-generator"
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
