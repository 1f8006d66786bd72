"""Capture tells evaluation from training, and says what it could not distribute.

Real 2-process gloo runs of unchanged code: a shuffled validation loader counts every sample once
on every rank (the metric equals one process's), a training loop with nothing to shard or no
optimizer is named in the notice, and the notice points at the lines that made things.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoddp
from conftest import run_python, write

N = 32


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, generator=generator)
    return TensorDataset(torch.arange(N), x, (x.sum(1) > 0).long())


def shuffled_validation(batch: int, mode: str):
    """Train full-batch (order-independent), then evaluate through a *shuffled* loader."""
    torch.manual_seed(0)
    data = _data()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    train = DataLoader(data, batch_size=batch, shuffle=True)
    val = DataLoader(data, batch_size=4, shuffle=True)  # as many scripts (and GPU defaults) do
    results = []
    for _ in range(2):
        model.train()
        for _, x, y in train:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        correct, seen = 0, []
        if mode == "no_grad":
            with torch.no_grad():
                batches = len(val)
                for i, x, y in val:
                    seen += i.tolist()
                    correct += (model(x).argmax(1) == y).sum().item()
        else:  # eval() alone, gradients still on
            model.eval()
            batches = len(val)
            for i, x, y in val:
                seen += i.tolist()
                correct += (model(x).argmax(1) == y).sum().item()
        with torch.no_grad():  # the training loader reused to measure training accuracy
            train_seen = sorted(i for batch_ in train for i in batch_[0].tolist())
        results.append((correct / len(data), sorted(seen), batches, train_seen))
    return results, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["no_grad", "eval"])
def test_a_shuffled_validation_loader_is_evaluated_whole_on_every_rank(mode):
    @autoddp.distributed(nproc=2)
    def two():
        results, weights = shuffled_validation(N // 2, mode)
        return results, weights

    results, weights = two()
    reference, reference_weights = shuffled_validation(N, mode)
    for got, want in zip(weights, reference_weights, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (accuracy, seen, batches, train_seen), (want_accuracy, *_rest) in zip(
        results, reference, strict=True
    ):
        assert accuracy == pytest.approx(want_accuracy, abs=1e-9)  # every sample counted once
        assert seen == list(range(N)) and batches == N // 4
        assert train_seen == list(range(N))  # the training loader too, when it evaluates


STEP_IN_EVAL = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(torch.randn(8, 2), batch_size=2, shuffle=True)
    model.eval()  # left over from an evaluation: this "training" loop would get all the data
    for x in loader:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
"""


def test_an_optimizer_stepping_in_a_whole_pass_is_said_at_the_users_line(tmp_path):
    script = write(tmp_path / "train.py", STEP_IN_EVAL)
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script)])
    assert result.returncode == 0, result.stderr
    assert "train.py:13: UserWarning: an optimizer steps while the shuffled DataLoader at train.py:8" in (
        result.stderr
    )
    assert "call model.train() before iterating the loader" in result.stderr


MANUAL_SGD = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 1)

        def forward(self, x):
            return self.fc(x)

    model = Net()
    loader = DataLoader(torch.randn(8, 2), batch_size=2, shuffle=True)
    for x in loader:
        model.zero_grad()
        model(x).pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
"""

MANUAL_BATCHES = """
    import torch
    from torch import nn

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(8, 2)
    for start in range(0, 8, 2):
        opt.zero_grad()
        model(data[start : start + 2]).sum().backward()
        opt.step()
"""

IN_ORDER_TRAINING = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in DataLoader(torch.randn(8, 2), batch_size=2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
"""


def test_training_that_nothing_distributes_is_named_in_the_notice(tmp_path):
    manual = run_python(["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / "sgd.py", MANUAL_SGD))])
    assert manual.returncode == 0, manual.stderr
    assert (
        "autoddp:   not distributed: Net (sgd.py:14) got gradients at sgd.py:18, but no optimizer was "
        "made over its parameters" in manual.stderr
    )
    assert "pass it to autoddp.prepare(model)" in manual.stderr

    batches = run_python(["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / "manual.py", MANUAL_BATCHES))])
    assert batches.returncode == 0, batches.stderr
    assert (
        "autoddp:   not distributed: no shuffled DataLoader was iterated before the first optimizer step "
        "(manual.py:11), so unless the code gives each process its own data, every process trains on the "
        "same batches, 2 times the work" in batches.stderr
    )

    ordered = run_python(
        ["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / "ordered.py", IN_ORDER_TRAINING))]
    )
    assert ordered.returncode == 0, ordered.stderr
    assert "(the DataLoader at ordered.py:8 is in order, shuffle=False, so autoddp left it whole" in (
        ordered.stderr
    )
    for result in (manual, batches, ordered):
        assert result.stderr.count("autoddp: capture:") == 1


def test_distributed_training_gets_no_such_line(capfd):
    @autoddp.distributed(nproc=2)
    def train():
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in DataLoader(torch.randn(8, 2), batch_size=2, shuffle=True):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

    train()
    err = capfd.readouterr().err
    assert "autoddp: capture:" in err and "not distributed" not in err


SITES = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4))

        def forward(self, x):
            return self.body(x)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.randn(4, 2)).sum().backward()
    opt.step()
"""


def test_the_notice_points_at_the_line_that_made_the_model_and_the_hint_is_said_once(tmp_path):
    script = write(tmp_path / "sites.py", SITES)
    result = run_python(["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script)])
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert "Net (sites.py:13): DDP across 2 processes, found through the optimizer at sites.py:14" in output
    assert output.count("has BatchNorm layers") == 1


def test_a_function_under_the_decorator_is_told_the_same(capfd):
    @autoddp.distributed(nproc=2)
    def train():
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.randn(8, 2)
        for start in range(0, 8, 2):
            opt.zero_grad()
            model(data[start : start + 2]).sum().backward()
            opt.step()
        return json.dumps(1)

    assert train() == "1"
    assert "not distributed: no shuffled DataLoader was iterated" in capfd.readouterr().err
