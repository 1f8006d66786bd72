"""Single-device habits keep results right: real 2-process gloo runs, outcomes a user checks.

Casting or re-initialising a model after it was wrapped, random numbers, rank-0-only saves,
results in other containers, gradient accumulation with one process.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import time
import typing

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import fork_or_skip
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import autoddp
from autoddp.in_rank.models.ddp import is_wrapped

STEPS = 3
LR = 0.1


def _batch(rank: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)  # each rank's own data, known to the test
    return torch.randn(8, 4, generator=generator).to(dtype), torch.randn(8, 2, generator=generator).to(dtype)


def _train(model: nn.Module, batches: list, steps: int = STEPS) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        for x, y in batches:
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


def _reference(state: dict, dtype: torch.dtype) -> dict:
    """One process, the global batch (both ranks' data at once), from the same start."""
    model = nn.Linear(4, 2).to(dtype)
    model.load_state_dict(state)
    x0, y0 = _batch(0, dtype)
    x1, y1 = _batch(1, dtype)
    _train(model, [(torch.cat([x0, x1]), torch.cat([y0, y1]))])
    return model.state_dict()


def _gathered(model: nn.Module) -> list[torch.Tensor]:
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    parts = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    return parts


@pytest.mark.parametrize("cast", ["double", "to_bfloat16", "half"])
def test_casting_after_wrapping_keeps_gradients_averaged(cast):
    @autoddp.distributed(nproc=2)
    def train(model):
        if cast == "double":
            model = model.double()
        elif cast == "to_bfloat16":
            model = model.to(dtype=torch.bfloat16)
        else:
            model = model.half()
        dtype = next(model.parameters()).dtype
        start = {k: v.clone() for k, v in model.state_dict().items()}
        _train(model, [_batch(autoddp.rank(), dtype)])
        parts = _gathered(model)
        return start, model.state_dict(), torch.equal(parts[0], parts[1]), str(dtype)

    torch.manual_seed(0)
    start, final, identical, dtype = train(nn.Linear(4, 2))
    assert identical, "the ranks drifted apart after the cast"
    if cast == "double":
        assert dtype == "torch.float64"
        reference = _reference(start, torch.float64)
        for name, value in final.items():
            torch.testing.assert_close(value, reference[name], rtol=1e-12, atol=1e-12)


def test_weights_reinitialised_inside_the_function_start_identical():
    @autoddp.distributed(nproc=2, start_method="spawn")
    def train(model):
        model.apply(lambda m: nn.init.normal_(m.weight) if isinstance(m, nn.Linear) else None)
        start = {k: v.clone() for k, v in model.state_dict().items()}  # differs per rank
        _train(model, [_batch(autoddp.rank())])
        parts = _gathered(model)
        return start, model.state_dict(), torch.equal(parts[0], parts[1])

    rank0_start, final, identical = train(nn.Linear(4, 2).double())
    assert identical
    reference = _reference(rank0_start, torch.float64)  # training started from rank 0's weights
    for name, value in final.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-12, atol=1e-12)


def test_a_layer_replaced_after_wrapping_is_synchronised():
    @autoddp.distributed(nproc=2)
    def train(model):
        torch.manual_seed(autoddp.rank())  # a new layer with different weights on each rank
        model.fc = nn.Linear(4, 2).double()
        _train(model, [_batch(autoddp.rank())])
        parts = _gathered(model)
        return torch.equal(parts[0], parts[1])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)

    assert train(Net())


def test_freezing_after_wrapping_trains_the_rest_in_step():
    @autoddp.distributed(nproc=2)
    def train(model):
        model[0].requires_grad_(False)  # fine-tuning: freeze the first layer after wrapping
        x, y = _batch(autoddp.rank(), torch.float32)
        _train(model, [(x, y)])
        return torch.equal(*_gathered(model))

    assert train(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))


def _draws() -> tuple:
    return autoddp.rank(), torch.rand(2).tolist(), random.random(), float(np.random.rand())


@autoddp.distributed(nproc=2, start_method="fork")
def _draw_forked():
    out = [None, None]
    dist.all_gather_object(out, _draws())
    return out


@autoddp.distributed(nproc=2, start_method="spawn")
def _draw_spawned():
    out = [None, None]
    dist.all_gather_object(out, _draws())
    return out


def _seed_caller(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_random_streams_differ_by_rank_repeat_and_agree_across_start_methods():
    fork_or_skip()  # (a CUDA build after an in-process compile: autoddp refuses fork, said)
    _seed_caller(1)
    forked = _draw_forked()
    after_call = torch.rand(1)
    _seed_caller(1)
    torch.rand(1)  # the call drew nothing from the caller's own stream:
    _seed_caller(1)
    assert torch.equal(torch.rand(1), after_call)
    _seed_caller(1)
    spawned = _draw_spawned()
    _seed_caller(1)
    again = _draw_forked()
    assert forked == spawned == again  # one rule under both start methods; a seeded run repeats
    (r0, *draws0), (r1, *draws1) = forked
    assert (r0, r1) == (0, 1)
    assert all(a != b for a, b in zip(draws0, draws1, strict=True))  # every library differs by rank
    _seed_caller(2)
    assert _draw_forked() != forked


def test_a_seed_set_inside_the_function_applies_as_written():
    @autoddp.distributed(nproc=2, start_method="spawn")
    def draw():
        torch.manual_seed(7)
        random.seed(7)
        out = [None, None]
        dist.all_gather_object(out, (torch.rand(3).tolist(), random.random()))
        return out

    torch.manual_seed(7)
    random.seed(7)
    expected = (torch.rand(3).tolist(), random.random())
    assert draw() == [expected, expected]


def test_the_sampler_still_shuffles_from_the_callers_seed():
    @autoddp.distributed(nproc=2)
    def epoch(loader):
        out = [None, None]
        dist.all_gather_object(out, [int(i) for batch in loader for i in batch])
        return out

    data = list(range(10))
    torch.manual_seed(5)
    seen = epoch(DataLoader(data, batch_size=2, shuffle=True))
    expected = [list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=5)) for r in (0, 1)]
    assert seen == expected
    assert sorted(seen[0] + seen[1]) == data  # disjoint shares of one permutation


def test_a_rank0_only_save_does_not_satisfy_a_later_save_of_every_rank(tmp_path):
    @autoddp.distributed(nproc=2)
    def train(folder):
        model = nn.Linear(2, 2)
        best, final = os.path.join(folder, "best.pt"), os.path.join(folder, "final.pt")
        if autoddp.is_main():
            autoddp.save(model, best)  # rank 0 alone: the others never wait for it
            time.sleep(1.0)  # rank 1 reaches the next save long before rank 0 does
        autoddp.save(model, final)  # every rank: each returns once final.pt is complete
        present = os.path.exists(final)
        autoddp.barrier()  # collectives still pair up
        marker = os.path.join(folder, "marker")
        with autoddp.rank0():
            open(marker, "w").close()
        out = [None, None]
        dist.all_gather_object(out, (present, os.path.exists(marker)))
        return out

    assert train(str(tmp_path)) == [(True, True), (True, True)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "final.pt", "marker"]


class Point(typing.NamedTuple):
    x: torch.Tensor
    y: int


@dataclasses.dataclass
class Metrics:
    loss: torch.Tensor
    name: str


def test_results_in_other_containers_come_back_detached_on_the_cpu():
    @autoddp.distributed(nproc=2)
    def train():
        w = torch.ones(2, requires_grad=True)
        graded = w * 2  # carries a grad_fn
        counts = collections.defaultdict(list)
        counts["a"].append(graded)
        return {
            "defaultdict": counts,
            "ordered": collections.OrderedDict(b=graded),
            "dataclass": Metrics(graded, "m"),
            "namedtuple": Point(graded, 3),
        }

    out = train()
    counts = out["defaultdict"]
    assert type(counts) is collections.defaultdict and counts.default_factory is list
    assert type(out["ordered"]) is collections.OrderedDict
    assert type(out["dataclass"]) is Metrics and out["dataclass"].name == "m"
    assert type(out["namedtuple"]) is Point and out["namedtuple"].y == 3
    for tensor in (counts["a"][0], out["ordered"]["b"], out["dataclass"].loss, out["namedtuple"].x):
        assert tensor.grad_fn is None and not tensor.requires_grad and tensor.device.type == "cpu"
        assert torch.equal(tensor, torch.full((2,), 2.0))


def _accumulate(model: nn.Module) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i in range(4):  # gradient accumulation, as written for several GPUs
        x, y = _batch(i, torch.float32)
        if i % 2 == 0:
            with model.no_sync():
                (model(x) - y).pow(2).mean().backward()
        else:
            (model(x) - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return model.weight.detach().clone()


def test_no_sync_works_with_one_process_and_with_nothing_to_train():
    @autoddp.distributed(nproc=1)
    def one_process(model):
        return _accumulate(model)

    @autoddp.distributed(nproc=2)
    def frozen(model):
        with model.no_sync():
            model(torch.ones(1, 4))
        return is_wrapped(model)

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    result = one_process(model)
    plain = nn.Linear(4, 2)
    plain.load_state_dict(start)
    assert torch.equal(result, _accumulate_plain(plain))
    assert type(model) is nn.Linear  # the caller's own model is plain again after the call
    assert frozen(nn.Linear(4, 2).requires_grad_(False)) is False


def _accumulate_plain(model: nn.Module) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i in range(4):
        x, y = _batch(i, torch.float32)
        (model(x) - y).pow(2).mean().backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    return model.weight.detach().clone()
