"""Capture tells evaluation from training, and says what it could not distribute.

Real 2-process gloo runs of unchanged code: a shuffled validation loader counts every sample once
on every rank (the metric equals one process's), a training loop with nothing to shard or no
optimizer is named in the notice, and the notice points at the lines that made things.
"""

from __future__ import annotations

import concurrent.futures
import json
import textwrap

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
    assert (
        "train.py:13: AutoDDPWarning: autoddp: an optimizer steps while the shuffled DataLoader at train.py:8"
        in (result.stderr)
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
    scripts = {"sgd.py": MANUAL_SGD, "manual.py": MANUAL_BATCHES, "ordered.py": IN_ORDER_TRAINING}
    with concurrent.futures.ThreadPoolExecutor(len(scripts)) as pool:  # three runs at once
        runs = [
            pool.submit(run_python, ["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / name, text))])
            for name, text in scripts.items()
        ]
        manual, batches, ordered = (run.result() for run in runs)
    assert manual.returncode == 0, manual.stderr
    assert (
        "autoddp:   not distributed: Net (sgd.py:14) got gradients at sgd.py:18, but no optimizer autoddp "
        "could see was made over its parameters" in manual.stderr
    )
    assert "pass it to autoddp.prepare(model)" in manual.stderr

    assert batches.returncode == 0, batches.stderr  # (unseeded: each process made its own data)
    assert (
        "autoddp:   Linear: its batches differ between the processes (nothing seeds the random numbers alike "
        "on every process): each of the 2 trains on its own" in batches.stderr
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
    err = capfd.readouterr().err  # (each rank draws its own data: the decorator seeds them apart)
    assert "Linear: its batches differ between the processes" in err


BEFORE_TRAINING = """
    import json, os, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x = torch.randn(64, 4) + 3
    y = (x.sum(1) > 12).long()
    data = TensorDataset(x, y)
    train = DataLoader(data, batch_size=int(sys.argv[1]), shuffle=True, num_workers=int(sys.argv[2]),
                       persistent_workers=int(sys.argv[2]) > 0)
    total = 0
    for xb, _ in train:  # the data's statistics, before any model exists
        total = total + xb.sum(0)
    mean = total / len(data)
    model = nn.Sequential(nn.Linear(4, 2))
    model.eval()
    zero_shot = sum((model(xb - mean).argmax(1) == yb).sum().item() for xb, yb in train) / len(data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    seen = []
    for epoch in range(2):
        for xb, yb in train:
            seen.append(len(xb))
            loss = nn.functional.cross_entropy(model(xb - mean), yb)
            opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad():
        val = sum(nn.functional.cross_entropy(model(xb - mean), yb).item() for xb, yb in train)
    per_batch = val / len(train)  # the mean over the pass just made: its own number of batches
    w = [p.detach().flatten().tolist() for p in model.parameters()]
    rank = os.environ.get("RANK", "0")
    with open(sys.argv[3] + "." + rank, "w") as f:
        json.dump({"mean": mean.tolist(), "zero_shot": zero_shot, "seen": seen, "w": w,
                   "batches": len(train), "per_batch": per_batch}, f)
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_passes_before_the_optimizer_see_all_the_data_and_training_is_still_sharded(tmp_path, workers):
    script = write(tmp_path / "stats.py", BEFORE_TRAINING)
    one = run_python([str(script), "64", str(workers), str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    two = run_python(["-m", "autoddp.cli", "-n", "2", str(script), "32", str(workers), str(tmp_path / "two")])
    assert two.returncode == 0, two.stderr
    single = json.loads((tmp_path / "one.0").read_text())
    ranks = [json.loads((tmp_path / f"two.{r}").read_text()) for r in (0, 1)]
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["mean"]), torch.tensor(single["mean"]))
        assert rank["zero_shot"] == pytest.approx(single["zero_shot"])
        assert rank["seen"] == [32, 32]  # training: this rank's half, with persistent workers too
        assert rank["batches"] == 2 and rank["per_batch"] == pytest.approx(single["per_batch"], rel=1e-5)
        for got, want in zip(rank["w"], single["w"], strict=True):  # full-batch steps
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    assert "first iterated outside training (no gradients, no model trained yet" in two.stderr
    assert "Warning" not in two.stderr


LOOSE_TENSORS = """
    import torch
    from torch.utils.data import DataLoader

    w = torch.zeros(4, 1, requires_grad=True)
    data = torch.randn(16, 4)
    for x in DataLoader(data, batch_size=4, shuffle=True):  # iterated once, for a look
        pass
    for start in range(0, 16, 4):
        loss = (data[start : start + 4] @ w - 1).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
            w.grad = None
"""


def test_gradients_for_tensors_no_model_holds_are_named(tmp_path):
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / "loose.py", LOOSE_TENSORS))])
    assert result.returncode == 0, result.stderr
    assert (
        "autoddp:   not distributed: the backward at loose.py:11 computed gradients, but no model is "
        "distributed" in result.stderr
    )


MANUAL_AFTER_A_LOOK = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    data = torch.randn(8, 2)
    for x in DataLoader(data, batch_size=4, shuffle=True):  # a look at the data first
        print(x.mean().item())
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, 8, 2):
        opt.zero_grad()
        model(data[start : start + 2]).sum().backward()
        opt.step()
"""

ODD = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in DataLoader(torch.randn(7, 2), batch_size=7, shuffle=True):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
"""


def test_manual_batches_after_a_look_at_a_loader_and_padding_are_said(tmp_path):
    look = run_python(["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / "look.py", MANUAL_AFTER_A_LOOK))])
    assert look.returncode == 0, look.stderr
    assert "Linear: its batches differ between the processes" in look.stderr
    odd = run_python(["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / "odd.py", ODD))])
    assert odd.returncode == 0, odd.stderr
    assert (
        "sharded, each process takes 1/2 of every epoch (1 of its 7 items repeated so that every process "
        "gets 4, as DistributedSampler pads: a full-batch step counts them twice)" in odd.stderr
    )


EARLY_STOP = """
    import os, torch
    from torch import nn
    from torch.utils.data import DataLoader

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, x in enumerate(DataLoader(torch.randn(64, 2), batch_size=4, shuffle=True)):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if os.environ["RANK"] == "1" and step == 2:  # its own loss looked good enough
            break
"""


def test_a_rank_that_stops_early_is_named_as_the_cause(tmp_path):
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / "early.py", EARLY_STOP))])
    assert result.returncode == 1
    assert (
        "autoddp: rank 1 had already ended well (its code ran to the end) while rank 0 still waited for it "
        "in a collective" in result.stderr
    )


STALE_GRADIENTS = """
    import torch
    from torch import nn
    import autoddp

    class Net(nn.Module):
        def __init__(s):  # (not called self)
            super().__init__()
            s.fc = nn.Linear(2, 1)

        def forward(s, x):
            return s.fc(x)

    def train():
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        model(torch.randn(4, 2)).sum().backward()
        opt.step()
        return model

    first = train()  # once in the caller: its gradients stay
    second = autoddp.distributed(nproc=2)(train)()
    print(type(second) is Net)
"""


def test_a_model_with_old_gradients_is_not_named_and_sites_skip_its_init(tmp_path):
    result = run_python([str(write(tmp_path / "stale.py", STALE_GRADIENTS))], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
    assert "got gradients" not in result.stderr and "no model is distributed" not in result.stderr
    assert "Net (stale.py:15): DDP across 2 processes" in result.stderr


@pytest.mark.unit
def test_a_line_the_notice_said_is_not_said_again_for_another_key(capsys):
    """A DataLoader made anew each epoch at one line is a new loader each time, one line in all."""
    from autoddp.in_rank.capture._notice import Notice

    notice = Notice(rank=0, world_size=2)
    for epoch in range(3):
        notice.say(("loader", epoch), "DataLoader (train.py:19): sharded")
    assert capsys.readouterr().err.count("DataLoader (train.py:19): sharded") == 1


def test_a_shuffled_pass_begun_before_the_optimizer_is_named_as_such_and_warned_at_step(tmp_path):
    """A shuffled loader whose iterator was made before the optimizer: its pass is left whole; the
    warning names that loader and the fix, not "no pass over a shuffled DataLoader ran", and, the
    script being seeded, says that the model splits each of its batches at its call."""
    script = write(
        tmp_path / "early.py",
        """
        import torch, torch.nn as nn
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
        batches = iter(loader)  # made before the optimizer
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        """,
    )
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script)])
    assert result.returncode == 0, result.stderr
    assert (
        "early.py:12: AutoDDPWarning: autoddp: an optimizer steps while the shuffled DataLoader at early.py:5"
        in (result.stderr)
    )
    # (seeded: the pass left whole is the same on every rank, so the model splits each batch)
    assert "each process loads every batch, and the model splits it at its call" in result.stderr
    assert "Linear: its batches, the same on every process" in result.stderr
    assert "make the optimizer and call model.train() before iterating the loader" in result.stderr
    assert "no pass over a shuffled DataLoader ran" not in result.stderr
    assert "not distributed" not in result.stderr


@pytest.mark.parametrize("front", ["command", "decorator"])
def test_a_users_distributed_sampler_made_for_one_process_is_named_with_the_fix(tmp_path, front):
    """Helpers that read the world before the process group exists give DistributedSampler a
    world of one: every rank reads all of the data (one process's result, but no speed-up)."""
    body = """
        import torch, torch.distributed as dist, torch.nn as nn
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, world, rank))
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    """
    if front == "command":
        script, line = write(tmp_path / "own_sampler.py", body), 7
    else:  # world and rank read where the decorator is applied, before the call
        lines = textwrap.dedent(body).strip("\n").splitlines()
        indented = "\n".join("    " + text for text in lines[5:])
        source = "\n".join([*lines[:5], "@autoddp.distributed(nproc=2)", "def train():", indented, "train()"])
        script, line = write(tmp_path / "own_sampler.py", "import autoddp\n" + source), 9
    command = ["-m", "autoddp.cli", "-n", "2", str(script)] if front == "command" else [str(script)]
    result = run_python(command)
    assert result.returncode == 0, result.stderr
    assert (
        f"DataLoader (own_sampler.py:{line}): its own DistributedSampler(num_replicas=1, rank=0): every rank "
        "reads all of it, the same samples as one process: no speed-up; make the DistributedSampler after "
        "the process group exists" in result.stderr
    ), result.stderr
