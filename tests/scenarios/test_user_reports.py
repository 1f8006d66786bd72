"""What a demanding user tried: each case a real 2-process run, the outcome they would check."""

from __future__ import annotations

import concurrent.futures
import copy
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import autoddp
from autoddp import ConfigurationError
from conftest import needs_fsdp, run_python, write


def _identical(module: nn.Module) -> bool:
    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    parts = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    return all(torch.equal(parts[0], part) for part in parts)


class AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 2)
        self.dec = nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


def test_calling_the_submodules_directly_still_averages_the_gradients():
    @autoddp.distributed(nproc=2)
    def train():
        torch.manual_seed(0)
        model = AutoEncoder()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(autoddp.rank())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                x = torch.randn(8, 4)
                loss = (model.dec(model.enc(x)) - x).pow(2).mean()  # DDP never sees this forward
                opt.zero_grad()
                loss.backward()
                opt.step()
        return _identical(model), [str(w.message)[:60] for w in caught]

    identical, messages = train()
    assert identical
    assert messages == ["autoddp: AutoEncoder's gradients were computed without calli"]


def test_the_length_of_a_shuffled_loader_is_this_ranks_share_before_its_first_pass():
    @autoddp.distributed(nproc=2)
    def train():
        loader = DataLoader(torch.arange(32.0), batch_size=2, shuffle=True)
        before = len(loader)  # as a scheduler's steps_per_epoch reads it, before the model is made
        model = nn.Linear(1, 1)  # training from here
        torch.optim.SGD(model.parameters(), lr=0.1)
        return before, sum(1 for _ in loader)

    assert train() == (8, 8)


def test_a_lazy_layer_before_the_optimizer_trains_in_step():
    class Lazy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.LazyLinear(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    @autoddp.distributed(nproc=2)
    def train():
        model = Lazy()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # its parameters do not exist yet
        torch.manual_seed(autoddp.rank())
        for _ in range(2):
            loss = model(torch.randn(4, 5)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return _identical(model)

    assert train()


def test_an_unused_parameter_names_itself_and_the_fix():
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)
            self.aux = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    def train():
        model = Unused()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()  # (every .grad None at the forward DDP refuses: only its indices tell)
            loss = model(torch.randn(4, 4)).sum()
            loss.backward()
            opt.step()
        return True

    with pytest.raises(ConfigurationError, match=r"\(aux.weight, aux.bias\).*find_unused_parameters"):
        autoddp.distributed(nproc=2)(train)()
    assert autoddp.distributed(nproc=2, ddp={"find_unused_parameters": True})(train)()


@needs_fsdp
def test_a_returned_fsdp_state_dict_is_full_and_plain():
    @autoddp.distributed(nproc=2, strategy="fsdp")
    def train():
        torch.manual_seed(0)
        model = autoddp.prepare(nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)))
        return model.state_dict()

    state = train()
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "0.weight": (4, 8),
        "0.bias": (4,),
        "1.weight": (2, 4),
        "1.bias": (2,),
    }
    assert all(type(v) is torch.Tensor for v in state.values())
    nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)).load_state_dict(state)


@needs_fsdp
def test_deep_copying_a_sharded_model_gives_a_whole_plain_copy():
    # (it was refused with a ConfigurationError; issue 38 item 3: an EMA copy sees one process's model)
    @autoddp.distributed(nproc=2, strategy="fsdp")
    def train():
        torch.manual_seed(0)
        model = autoddp.prepare(nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)))
        twin = copy.deepcopy(model)
        return type(twin).__name__, {k: v for k, v in twin.state_dict().items()}

    name, state = train()
    torch.manual_seed(0)
    one = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    assert name == "Sequential"
    for key, value in one.state_dict().items():
        assert type(state[key]) is torch.Tensor and torch.equal(state[key], value), key


@pytest.mark.unit
def test_options_that_cannot_work_are_refused_when_decorating():
    with pytest.raises(ConfigurationError, match="did you mean 'find_unused_parameters'"):
        autoddp.distributed(ddp={"find_unused": True})


@needs_fsdp
def test_fsdp_blocks_naming_no_submodule_are_refused():
    @autoddp.distributed(nproc=2, strategy="fsdp", fsdp_blocks=("Nope",))
    def train():
        autoddp.prepare(nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)))

    with pytest.raises(ConfigurationError, match=r"names no submodule of Sequential.*Linear"):
        train()


UNSEEDED = """
    import os, torch, numpy
    print(os.environ["RANK"], torch.rand(1).item(), numpy.random.rand(), flush=True)
"""

FINISHES_EARLY = """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    for step in range(100):
        if dist.get_rank() == 0 and step == 3:
            break  # rank 0 is done; rank 1 waits in the next all_reduce
        dist.all_reduce(torch.ones(1))
"""

BEST_SO_FAR = """
    import sys, torch, torch.distributed as dist
    from torch import nn
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    best = float("inf")
    torch.manual_seed(int(__import__("os").environ["RANK"]))
    for epoch in range(6):
        loss = torch.rand(()).item()  # a per-rank loss
        if loss < best:
            best = loss
            torch.save({"epoch": epoch, "rank": dist.get_rank(), "loss": loss}, "best.pt")
    print(dist.get_rank(), best, flush=True)
"""


def test_the_command_behaves_as_torchrun_where_scripts_rely_on_it(tmp_path):
    command = ["-m", "autoddp.cli", "-n", "2"]
    unseeded = run_python(
        ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(write(tmp_path / "r.py", UNSEEDED))]
    )
    assert unseeded.returncode == 0, unseeded.stderr
    draws = sorted(line.split("] ", 1)[1].split()[1:] for line in unseeded.stdout.splitlines())
    assert draws[0] != draws[1]  # each rank its own numbers, as fresh interpreters draw them

    start = time.monotonic()
    early = run_python([*command, str(write(tmp_path / "e.py", FINISHES_EARLY))])
    assert early.returncode == 1 and time.monotonic() - start < 30  # fails fast, as under torchrun
    assert "Connection" in early.stderr

    start = time.monotonic()
    best = run_python(
        ["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / "b.py", BEST_SO_FAR))], cwd=tmp_path
    )
    assert best.returncode == 0, best.stderr
    assert time.monotonic() - start < 20  # no rank waits for saves rank 0 does not make
    assert torch.load(tmp_path / "best.pt")["rank"] == 0  # rank 0's file, never overwritten by rank 1


def test_command_usage_errors_are_one_line(tmp_path):
    script = write(tmp_path / "s.py", "print('hi')\n")
    commands = [
        ["-n", "2", "--ranks", "foo", str(script)],
        ["--stratgy", "fsdp", str(script)],
        ["--find-unused-parameters", "-n", "2", str(script)],
    ]
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:  # the runs at once
        bad_ranks, typo, unused = pool.map(lambda args: run_python(["-m", "autoddp.cli", *args]), commands)
    assert bad_ranks.returncode == 2 and "Traceback" not in bad_ranks.stderr
    assert "comma-separated local ranks" in bad_ranks.stderr
    assert typo.returncode == 2 and "did you mean --strategy?" in typo.stderr
    assert unused.returncode == 0, unused.stderr
