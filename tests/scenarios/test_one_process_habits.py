"""Habits of one-process scripts that used to crash or hang with several (issue 31, item 4).

Real 2-process gloo runs: buffers added and removed mid-run (pruning), a data set whose length
changes between epochs, a script reading stdin, a script making its own group of one process.
"""

from __future__ import annotations

import inspect
import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.utils.prune as prune
from helpers import free_port
from torch import nn

import autoddp
from tests.conftest import run_python, write

N = 16  # samples: each rank takes its half, one process the whole (mean losses: the same step)


def _share(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(N, 4, generator=generator)
    y = torch.randn(N, 2, generator=generator)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _pruned_mid_run(rank: int, world: int) -> tuple[list[torch.Tensor], bool]:
    """Train, prune a layer, train, make the pruning permanent, add and delete a buffer, train."""
    x, y = _share(rank, world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        out = model(x)
        if hasattr(model, "scale"):
            out = out * model.scale
        loss = (out - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    prune.l1_unstructured(model[0], name="weight", amount=0.5)  # weight_orig and a weight_mask buffer
    step()
    prune.remove(model[0], "weight")  # the mask buffer goes: the model has no buffer left
    step()
    model.register_buffer("scale", torch.full((2,), 0.5))  # a buffer on a model that had none
    step()
    del model.scale
    step()
    state = [p.detach().clone() for p in model.parameters()]
    flat = torch.cat([p.flatten() for p in state])
    identical = True
    if world > 1:
        parts = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(parts, flat)
        identical = all(torch.equal(parts[0], part) for part in parts)
    return state, identical


def test_buffers_added_and_removed_mid_run_train_as_one_process():
    @autoddp.distributed(nproc=2)
    def train():
        return _pruned_mid_run(autoddp.rank(), autoddp.world_size())

    state, identical = train()
    assert identical
    for got, want in zip(state, _pruned_mid_run(0, 1)[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _Scaled(nn.Module):
    """A model with a buffer its forward uses while it is there (``getattr(self, "scale", None)``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
        self.register_buffer("scale", torch.full((2,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x)))
        scale = getattr(self, "scale", None)
        return out if scale is None else out * scale


def _pruned_then_evaluated() -> tuple[list[torch.Tensor], float]:
    """The pruning tutorial's flow, trained: prune, train, make it permanent and delete the last
    buffer (each rebuilds the DDP inside the forward), train, then evaluate in ``eval()`` with
    gradients on (no ``torch.no_grad()``) over the shuffled loader: one process's numbers."""
    generator = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=generator), torch.randn(64, 2, generator=generator)
    )
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    model = _Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prune.l1_unstructured(model.fc1, name="weight", amount=0.5)
    for epoch in range(2):
        model.train()
        for x, y in loader:
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if epoch == 0:
            prune.remove(model.fc1, "weight")
            del model.scale  # the model's last buffer
    model.eval()
    total = sum((model(x) - y).pow(2).mean().item() * len(x) for x, y in loader)
    return [p.detach().clone() for p in model.parameters()], total / len(data)


def test_a_model_pruned_and_its_last_buffer_deleted_evaluates_as_one_process_under_the_decorator():
    @autoddp.distributed(nproc=2, split_batches=True)
    def train() -> tuple[list[torch.Tensor], float]:
        return _pruned_then_evaluated()

    state, loss = train()
    want_state, want_loss = _pruned_then_evaluated()
    # (before: the DDP rebuilt inside the forward was taken for one of the user's own, always in
    # training mode, so the evaluation pass got rank 0's share of the loader: about half the loss)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for got, want in zip(state, want_state, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _prepared_then_evaluated(prepare: bool) -> float:
    """A model given to ``autoddp.prepare`` inside the function, trained, then evaluated in
    ``eval()`` with gradients on over the shuffled loader: the mean loss over all of it."""
    generator = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=generator), torch.randn(64, 2, generator=generator)
    )
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = autoddp.prepare(model) if prepare else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return sum((model(x) - y).pow(2).mean().item() * len(x) for x, y in loader) / len(data)


def test_a_model_prepared_inside_a_captured_function_evaluates_as_one_process():
    @autoddp.distributed(nproc=2, split_batches=True)
    def train() -> float:
        return _prepared_then_evaluated(prepare=True)

    # (before: prepare's DDP, made while the user's code ran, was taken for one of the user's own)
    assert train() == pytest.approx(_prepared_then_evaluated(prepare=False), rel=1e-5)


@pytest.mark.timeout(90)
def test_a_model_pruned_and_its_last_buffer_deleted_evaluates_as_one_process_under_the_command(tmp_path):
    flow = inspect.getsource(_Scaled) + "\n\n" + inspect.getsource(_pruned_then_evaluated)
    script = tmp_path / "pruned.py"
    script.write_text(
        "import json\nimport torch\nimport torch.nn.utils.prune as prune\nfrom torch import nn\n\n"
        + flow
        + "\n\nstate, loss = _pruned_then_evaluated()\n"
        "print(json.dumps([loss, [p.tolist() for p in state]]))\n"
    )
    result = run_python(["-m", "autoddp.cli", "-n", "2", "--split-batches", str(script)], timeout=80)
    assert result.returncode == 0, result.stderr[-3000:]
    loss, state = json.loads(result.stdout.strip().splitlines()[-1])
    want_state, want_loss = _pruned_then_evaluated()
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for got, want in zip(state, want_state, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def test_a_data_set_that_grows_and_shrinks_between_epochs_is_shared_out_at_its_length_now(tmp_path):
    script = write(
        tmp_path / "curriculum.py",
        """
        import json, os, sys
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, Dataset

        class Curriculum(Dataset):  # more (then fewer) samples as training goes on
            def __init__(self):
                self.n = 32
            def __len__(self):
                return self.n
            def __getitem__(self, i):
                return torch.tensor([float(i)])

        data = Curriculum()
        model = nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(data, batch_size=4, shuffle=True)
        epochs = []
        for n in (32, 96, 16):
            data.n = n
            seen = []
            length = len(loader)
            for x in loader:
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                seen += x.flatten().long().tolist()
            epochs.append({"len": length, "seen": seen})
        with open(os.path.join(sys.argv[1], os.environ.get("RANK", "0") + ".json"), "w") as f:
            json.dump(epochs, f)
        """,
    )
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script), str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    for epoch, n in enumerate((32, 96, 16)):
        shares = [ranks[rank][epoch] for rank in (0, 1)]
        assert [share["len"] for share in shares] == [n // 2 // 4] * 2  # this rank's batches, now
        assert sorted(shares[0]["seen"] + shares[1]["seen"]) == list(range(n))  # each sample once


OWN_GROUP = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", RANKS)
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {total.item()}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(75)
def test_a_scripts_own_group_of_one_process_is_refused_at_its_line(tmp_path):
    script = write(tmp_path / "own_group.py", OWN_GROUP.replace("RANKS", "rank=0, world_size=1"))
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script), str(free_port())], timeout=60)
    assert result.returncode != 0
    # (every rank refuses it; the report leads with whichever rank failed first)
    assert re.search(
        r"ConfigurationError: \[rank [01] of 2\] this script makes its own process group", result.stderr
    )
    assert "rank=0, world_size=1" in result.stderr and "autoddp -n 1" in result.stderr
    assert 'own_group.py", line 6' in result.stderr  # the script's own line


@pytest.mark.timeout(75)
@pytest.mark.parametrize("capture", [True, False])
def test_a_scripts_own_tcp_address_is_served_by_rank_0(tmp_path, capture):
    ranks = "rank=int(os.environ['RANK']), world_size=int(os.environ['WORLD_SIZE'])"
    script = write(tmp_path / "own_address.py", OWN_GROUP.replace("RANKS", ranks))
    flags = [] if capture else ["--no-capture"]
    command = ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", *flags, str(script), str(free_port())]
    result = run_python(command, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 of 2: 2.0" in result.stdout and "rank 1 of 2: 2.0" in result.stdout


LATE_RANK_1 = """
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # no timeout=: torch's would be 30 minutes
if dist.get_rank() == 1:
    time.sleep(600)
dist.all_reduce(torch.ones(1))
"""


@pytest.mark.timeout(100)
@pytest.mark.parametrize("capture", [True, False])
def test_the_commands_timeout_bounds_a_scripts_own_group_that_gives_none(tmp_path, capture):
    script = write(tmp_path / "late.py", LATE_RANK_1)
    flags = [] if capture else ["--no-capture"]
    command = ["-m", "autoddp.cli", "-n", "2", "--timeout", "5", "--hang-report", "0", *flags, str(script)]
    result = run_python(command, timeout=80)
    assert result.returncode != 0
    assert "[rank 0 of 2]" in result.stderr and 'late.py", line 9' in result.stderr, result.stderr[-3000:]
    assert re.search(r"[Tt]imed out|timeout", result.stderr), result.stderr[-3000:]


def test_rank_0_reads_the_commands_stdin_and_the_others_an_empty_one(tmp_path):
    script = write(
        tmp_path / "reads_stdin.py",
        """
        import os, sys
        text = sys.stdin.read()  # a config, a prompt's answer, data piped in
        with open(os.path.join(sys.argv[1], os.environ.get("RANK", "0") + ".txt"), "w") as f:
            f.write(text)
        """,
    )
    for method in ("fork", "spawn"):
        command = ["-m", "autoddp.cli", "-n", "2", "--start-method", method, str(script), str(tmp_path)]
        result = run_python(command, stdin="lr 0.1\nepochs 3\n")
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / "0.txt").read_text() == "lr 0.1\nepochs 3\n"
        assert (tmp_path / "1.txt").read_text() == ""  # as torchrun's other ranks find it


def test_input_in_a_decorated_function_reads_the_callers_stdin_on_rank_0(tmp_path):
    script = write(
        tmp_path / "asks.py",
        """
        import torch.distributed as dist
        import autoddp

        @autoddp.distributed(nproc=2)
        def ask():
            answer = input("continue? ") if autoddp.rank() == 0 else None
            answers = [None, None]
            dist.all_gather_object(answers, answer)
            return answers

        print(ask())
        """,
    )
    result = run_python([str(script)], stdin="yes\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("['yes', None]")


RUNNING_NORMALISER = """
import torch, torch.nn as nn

class Normalised(nn.Module):  # a running normaliser, as in RL and tabular code
    def __init__(self):
        super().__init__()
        self.norm = nn.Module()
        self.norm.register_buffer("mean", torch.zeros(4))
        self.norm.register_buffer("scale", torch.ones(4))  # never updated: not named
        self.bn = nn.BatchNorm1d(4)  # hinted on its own
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        if self.training:
            self.norm.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.lin(self.bn((x - self.norm.mean) / self.norm.scale))

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4) + 3, torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
model = Normalised()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


@pytest.mark.timeout(75)
def test_a_buffer_the_forward_updates_is_hinted_once_at_the_users_line(tmp_path):
    script = write(tmp_path / "normaliser.py", RUNNING_NORMALISER)
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script)], timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    said = "Normalised's forward updates buffers (norm.mean), running statistics that DDP does not average"
    assert result.stderr.count(said) == 1, result.stderr
    assert "normaliser.py:25: AutoDDPWarning: autoddp: " + said in result.stderr  # the forward's line
    assert "all-reduce the batch's sums and counts" in result.stderr
    assert "Normalised has BatchNorm layers" in result.stderr  # BatchNorm's own hint, not this one
    quiet = write(tmp_path / "static.py", RUNNING_NORMALISER.replace("if self.training:", "if False:"))
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(quiet)], timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "forward updates buffers" not in result.stderr, result.stderr
