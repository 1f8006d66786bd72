"""autoddp's own DDP settings change nothing in the results: weights bitwise equal to torch's defaults."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoddp
from autoddp.in_rank.models.ddp import DEFAULTS, ddp_of


@pytest.mark.parametrize("setting", sorted(DEFAULTS))
def test_each_default_leaves_the_weights_bitwise_equal(setting):
    @autoddp.distributed(nproc=2, capture=False)
    def train():
        torch.manual_seed(0)
        template = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        ours = autoddp.prepare(copy.deepcopy(template))  # with autoddp's defaults
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(template))  # torch's defaults
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
        torch.manual_seed(autoddp.rank())
        for _ in range(5):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            for model, optimizer in zip((ours, theirs), optimizers, strict=True):
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        used = getattr(ddp_of(ours), setting)
        same = all(
            torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.module.parameters(), strict=True)
        )
        return used, same

    used, same = train()
    assert used == DEFAULTS[setting]
    assert same
