"""The promise: 2 processes with batch B end with the weights of 1 process with batch 2B."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import autoddp

pytestmark = pytest.mark.smoke  # CI runs these on the lowest and the newest torch too (-m smoke)

N, B, EPOCHS, LR = 40, 4, 3, 0.05


class Indexed(Dataset):
    """A regression dataset that also returns each sample's index (to replay the order)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(N, 5, generator=g)
        self.y = self.x @ torch.randn(5, generator=g) + 0.1 * torch.randn(N, generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def make_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def step(model, opt, x, y):
    loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


@autoddp.distributed(nproc=2)
def train_distributed(model, loader):
    # plain single-GPU code: no sampler, no set_epoch, no DDP in sight
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    seen = []
    for _ in range(EPOCHS):
        for x, y, idx in loader:
            step(model, opt, x, y)
            seen.append(idx)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, seen)
    return model.state_dict(), per_rank


def test_two_processes_equal_one_process_with_the_global_batch():
    torch.manual_seed(7)
    loader = DataLoader(Indexed(), batch_size=B, shuffle=True)
    state, (rank0_batches, rank1_batches) = train_distributed(make_model(), loader)

    # every epoch the ranks saw disjoint halves of the data; epochs were shuffled differently
    steps = N // (2 * B)
    epochs = [
        [
            torch.cat([a, b])
            for a, b in zip(
                rank0_batches[e * steps : (e + 1) * steps],
                rank1_batches[e * steps : (e + 1) * steps],
                strict=True,
            )
        ]
        for e in range(EPOCHS)
    ]
    for batches in epochs:
        assert sorted(torch.cat(batches).tolist()) == list(range(N))
    assert torch.cat(epochs[0]).tolist() != torch.cat(epochs[1]).tolist()

    # replay the same global batches (size 2B) in one process
    reference = make_model()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    data = Indexed()
    for batches in epochs:
        for idx in batches:
            step(reference, opt, data.x[idx], data.y[idx])

    for key, value in reference.state_dict().items():
        assert torch.allclose(state[key], value, atol=1e-6), key
