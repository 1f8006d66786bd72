"""What the training batches will look like before one is drawn (``capture.batch_example``): the
first shuffled loader's first sample, read with every random stream kept."""

from __future__ import annotations

import random

import numpy
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, TensorDataset

from autoddp.in_rank.capture.batch_example import example
from autoddp.in_rank.capture.loader_hooks import kind

pytestmark = pytest.mark.unit


class Augmented(Dataset):
    """Each sample drawn with torch's, ``random``'s and NumPy's streams, as augmentations do."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        noise = torch.rand(3) + random.random() + float(numpy.random.rand())
        return torch.full((3, 8, 8), float(index)) + noise[0], index % 2


def test_the_first_shuffled_loader_gives_its_first_sample_and_its_batch_size_and_draws_nothing():
    ordered = DataLoader(TensorDataset(torch.randn(10, 5)), batch_size=4)  # (an evaluation loader)
    shuffled = DataLoader(Augmented(), batch_size=16, shuffle=True)
    torch.manual_seed(0), random.seed(0), numpy.random.seed(0)
    found = example([ordered, shuffled], kind)
    drawn = (torch.rand(2), random.random(), numpy.random.rand())
    torch.manual_seed(0), random.seed(0), numpy.random.seed(0)
    assert torch.equal(drawn[0], torch.rand(2)) and drawn[1:] == (random.random(), numpy.random.rand())
    assert found is not None and found.rows == 16 and found.kwargs == {}
    assert [tuple(arg.shape) for arg in found.args] == [(1, 3, 8, 8)]  # (inputs, targets): the inputs

    batches = DataLoader(Augmented(), batch_sampler=BatchSampler(RandomSampler(range(100)), 8, False))
    assert example([batches], kind).rows == 8


class Stream(IterableDataset):
    def __iter__(self):
        yield torch.ones(4)


class Named(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.ones(6, dtype=torch.long)}


class Keyed(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: str) -> torch.Tensor:
        return {"a": torch.ones(2)}[index]


def test_no_example_where_the_batch_cannot_be_read_or_told_apart():
    assert example([], kind) is None
    assert example([DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)], kind) is None  # ordered
    assert example([DataLoader(Stream(), batch_size=2)], kind) is None
    assert example([DataLoader(Named(), batch_size=2, shuffle=True)], kind) is None  # a dict's keys
    assert example([DataLoader(Keyed(), batch_size=2, shuffle=True)], kind) is None  # no sample 0
    assert example([DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=None, shuffle=True)], kind) is None
