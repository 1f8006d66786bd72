"""Zero edits: models, optimizers, loaders and saves made by plain code are distributed.

Real 2-process gloo runs, the decorator and the command alike; the outcomes are the ones a user
checks: the data each rank saw, weights equal to one process with the global batch, the
evaluation metric, the file written once.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from helpers import inspected, reports
from torch import nn
from torch.utils.data import DataLoader, Dataset

import autoddp
from autoddp.in_rank.models.ddp import is_wrapped
from conftest import run_python, write

N = 16  # samples; per-process batch N/2, so each epoch is one full-batch step (order-independent)
EPOCHS = 3


class Indexed(Dataset):
    """Samples that say which index they are, with a fixed target."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(N, 4, generator=generator)
        self.y = self.x @ torch.randn(4, 2, generator=generator)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def plain_train(batch: int, path: str | None = None):
    """Single-GPU code as people write it: everything built inside."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Indexed()
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    evaluation = DataLoader(data, batch_size=4)
    seen = []
    for _ in range(EPOCHS):
        epoch = []
        for i, x, y in loader:
            epoch += i.tolist()
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        seen.append(sorted(epoch))
    with torch.no_grad():
        metric = sum((model(x) - y).pow(2).sum().item() for _, x, y in evaluation) / N
    if path is not None:
        torch.save(model.state_dict(), path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, metric, seen


@autoddp.distributed(nproc=2)
def _train_on_two(path):
    state, metric, seen = plain_train(N // 2, path)
    everyone = [None, None]
    dist.all_gather_object(everyone, seen)
    return state, metric, everyone


def test_a_plain_function_is_distributed_and_matches_one_process_with_the_global_batch(tmp_path, capfd):
    path = str(tmp_path / "model.pt")
    state, metric, seen = _train_on_two(path)
    for epoch in range(EPOCHS):  # each rank a disjoint half of the data, every epoch
        rank0, rank1 = seen[0][epoch], seen[1][epoch]
        assert len(rank0) == len(rank1) == N // 2 and sorted(rank0 + rank1) == list(range(N))
    reference, reference_metric, _ = plain_train(N)  # one process, batch 2B
    for name, value in state.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-5)
    assert metric == pytest.approx(reference_metric, rel=1e-5)  # evaluation saw all the data
    saved = nn.Linear(4, 2)
    saved.load_state_dict(torch.load(path))  # complete, plain keys
    torch.testing.assert_close(saved.weight.detach(), state["weight"], rtol=1e-5, atol=1e-5)
    notice = capfd.readouterr().err
    assert notice.count("autoddp: capture:") == 1  # said once, by rank 0
    assert "Linear (test_capture.py:" in notice and "found through the optimizer" in notice
    assert "sharded" in notice and "left whole: in order" in notice
    assert "written once, by rank 0" in notice and "capture=False" in notice


PLAIN_SCRIPT = """
    import sys, json, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    device = "cuda" if torch.cuda.is_available() else "cpu"  # as single-GPU scripts say it
    torch.manual_seed(0)
    N = 16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=g)
    y = x @ torch.randn(4, 2, generator=g)
    data = TensorDataset(torch.arange(N), x, y)
    model = nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=int(sys.argv[1]), shuffle=True)
    evaluation = DataLoader(data, batch_size=4)
    seen = []
    for epoch in range(3):
        for i, xb, yb in loader:
            seen += i.tolist()
            loss = (model(xb) - yb).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad():
        metric = sum((model(xb) - yb).pow(2).sum().item() for _, xb, yb in evaluation) / N
    torch.save(model.state_dict(), sys.argv[2])
    with open(sys.argv[3] + "." + str(__import__("os").environ.get("RANK", "0")), "w") as f:
        json.dump({"seen": seen, "metric": metric, "w": model.weight.tolist()}, f)
"""


def test_an_unmodified_script_under_the_command(tmp_path):
    script = write(tmp_path / "train.py", PLAIN_SCRIPT)
    single = run_python([str(script), "16", str(tmp_path / "one.pt"), str(tmp_path / "one")])
    assert single.returncode == 0, single.stderr
    result = run_python(
        ["-m", "autoddp.cli", "-n", "2", str(script), "8", str(tmp_path / "two.pt"), str(tmp_path / "two")]
    )
    assert result.returncode == 0, result.stderr
    one = json.loads((tmp_path / "one.0").read_text())
    ranks = [json.loads((tmp_path / f"two.{r}").read_text()) for r in (0, 1)]
    for epoch in range(3):
        halves = [r["seen"][epoch * 8 : (epoch + 1) * 8] for r in ranks]
        assert sorted(halves[0] + halves[1]) == list(range(16))
    torch.testing.assert_close(torch.tensor(ranks[0]["w"]), torch.tensor(one["w"]), rtol=1e-5, atol=1e-5)
    assert ranks[0]["w"] == ranks[1]["w"]
    assert ranks[0]["metric"] == pytest.approx(one["metric"], rel=1e-5)
    saved = nn.Linear(4, 2)
    saved.load_state_dict(torch.load(tmp_path / "two.pt"))
    assert saved.weight.tolist() == ranks[0]["w"]
    assert result.stderr.count("autoddp: capture:") == 1


def test_two_models_and_two_optimizers_stay_identical_on_every_rank():
    @autoddp.distributed(nproc=2)
    def gan():
        torch.manual_seed(0)  # both ranks build the same models; the noise below differs per rank
        generator = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4))
        critic = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        g_opt = torch.optim.Adam(generator.parameters(), lr=1e-2)
        c_opt = torch.optim.Adam(critic.parameters(), lr=1e-2)
        torch.manual_seed(autoddp.rank() + 10)
        for _ in range(3):
            real = torch.randn(8, 4) + 2
            fake = generator(torch.randn(8, 3))
            c_loss = critic(fake.detach()).mean() - critic(real).mean()
            c_opt.zero_grad()
            c_loss.backward()
            c_opt.step()
            g_loss = -critic(generator(torch.randn(8, 3))).mean()
            g_opt.zero_grad()
            g_loss.backward()
            g_opt.step()
        flat = torch.cat([p.detach().flatten() for m in (generator, critic) for p in m.parameters()])
        parts = [torch.zeros_like(flat) for _ in range(2)]
        dist.all_gather(parts, flat)
        return torch.equal(parts[0], parts[1]), is_wrapped(generator), is_wrapped(critic)

    assert gan() == (True, True, True)


def test_one_optimizer_over_two_models_groups_and_a_compiled_model():
    @autoddp.distributed(nproc=2)
    def train():
        torch.manual_seed(0)
        encoder, head = nn.Linear(4, 4), nn.Linear(4, 2)
        compiled = torch.compile(nn.Linear(2, 2), backend="eager")
        opt = torch.optim.SGD(
            [
                {"params": encoder.parameters()},
                {"params": head.parameters(), "lr": 0.05},
                {"params": compiled.parameters()},
            ],
            lr=0.1,
        )
        torch.manual_seed(autoddp.rank())
        for _ in range(2):
            out = compiled(head(encoder(torch.randn(8, 4))))
            opt.zero_grad()
            out.pow(2).mean().backward()
            opt.step()
        flat = torch.cat([p.detach().flatten() for g in opt.param_groups for p in g["params"]])
        parts = [torch.zeros_like(flat) for _ in range(2)]
        dist.all_gather(parts, flat)
        wrapped = [is_wrapped(m) for m in (encoder, head, autoddp.unwrap(compiled))]
        return torch.equal(parts[0], parts[1]), wrapped

    assert train() == (True, [True, True, True])


def test_models_without_an_optimizer_are_left_alone_and_loose_parameters_warn():
    @autoddp.distributed(nproc=2)
    def train():
        import warnings

        teacher = nn.Linear(4, 2)  # inference only: no optimizer
        loose = nn.Parameter(torch.zeros(3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.optim.SGD([loose], lr=0.1)
        return is_wrapped(teacher), [str(w.message)[:60] for w in caught]

    wrapped, messages = train()
    assert wrapped is False
    assert messages == ["autoddp: 1 of this optimizer's parameters (shapes (3,)) belo"]


def test_capture_off_restores_plain_behaviour_and_prepare_wins():
    def body():
        torch.manual_seed(autoddp.rank())  # different starts and data: only DDP keeps them equal
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        parts = [torch.zeros_like(flat) for _ in range(2)]
        dist.all_gather(parts, flat)
        return torch.equal(parts[0], parts[1]), is_wrapped(model)

    @autoddp.distributed(nproc=2)
    def prepared_then_optimised():
        model = autoddp.prepare(nn.Linear(4, 2))
        ddp = model.__dict__["_autoddp_ddp"]
        torch.optim.SGD(model.parameters(), lr=0.1)
        return model.__dict__["_autoddp_ddp"] is ddp  # wrapped once

    assert autoddp.distributed(nproc=2)(body)() == (True, True)
    assert autoddp.distributed(nproc=2, capture=False)(body)() == (False, False)
    assert prepared_then_optimised()


def test_the_users_own_ddp_after_the_optimizer_takes_over():
    @autoddp.distributed(nproc=2)
    def train():
        torch.manual_seed(autoddp.rank())
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # capture wraps it here...
        ddp = nn.parallel.DistributedDataParallel(model)  # ...and the user's own DDP takes over
        ddp(torch.randn(4, 4)).sum().backward()
        opt.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        parts = [torch.zeros_like(flat) for _ in range(2)]
        dist.all_gather(parts, flat)
        return torch.equal(parts[0], parts[1]), is_wrapped(model), type(model) is nn.Linear

    assert train() == (True, False, True)


def test_per_rank_and_rank0_only_saves(tmp_path):
    @autoddp.distributed(nproc=2)
    def train(folder):
        model = nn.Linear(2, 2)
        torch.save({"rank": autoddp.rank()}, os.path.join(folder, f"rank{autoddp.rank()}.pt"))
        if autoddp.rank() == 0:
            torch.save(model.state_dict(), os.path.join(folder, "only0.pt"))  # nobody waits for it
        autoddp.barrier()
        return sorted(os.listdir(folder))

    files = train(str(tmp_path))
    assert files == ["only0.pt", "rank0.pt", "rank1.pt"]
    assert [torch.load(tmp_path / f"rank{r}.pt")["rank"] for r in (0, 1)] == [0, 1]


def test_nothing_is_said_when_nothing_was_captured(capfd):
    @autoddp.distributed(nproc=2)
    def quiet():
        teacher = nn.Linear(1, 1)  # no optimizer: left alone
        with torch.no_grad():
            return sum(teacher(x.view(1, 1)).item() * 0 + x.item() for x in DataLoader(torch.arange(4.0)))

    assert quiet() == 6.0  # the ordered loader was left whole, and that alone is not worth a word
    assert "autoddp: capture" not in capfd.readouterr().err


TORCHRUN_STYLE = """
    import os, torch, torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = list(range(8))
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=True))
    seen = [i for batch in loader for i in batch.tolist()]
    torch.save(model.module.state_dict(), f"weights{dist.get_rank()}.pt")
    print(dist.get_rank(), len(seen), hasattr(model.module, "_autoddp_replica"), type(model.module).__name__)
    dist.destroy_process_group()
"""


def test_a_torchrun_style_script_is_left_alone(tmp_path):
    script = write(tmp_path / "ddp.py", TORCHRUN_STYLE)
    result = run_python(["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = sorted(line.split("] ", 1)[1] for line in result.stdout.splitlines())
    assert lines == ["0 4 False Linear", "1 4 False Linear"]  # no double wrap, no double sharding
    assert "autoddp: capture" not in result.stderr
    assert sorted(p.name for p in tmp_path.glob("weights*.pt")) == ["weights0.pt", "weights1.pt"]


LATE_INIT = """
    import torch, torch.distributed as dist
    from torch import nn
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # autoddp makes the group here
    dist.init_process_group("gloo")
"""


def test_init_process_group_after_capture_made_the_group_is_a_clear_error(tmp_path):
    script = write(tmp_path / "late.py", LATE_INIT)
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script)])
    assert result.returncode == 1
    assert "Call init_process_group at the start of the script" in result.stderr
    assert "--no-capture" in result.stderr
    off = run_python(["-m", "autoddp.cli", "-n", "2", "--no-capture", str(script)])
    assert off.returncode == 0, off.stderr


def test_hooks_are_in_place_in_the_workers_while_the_function_runs_and_gone_at_its_end(tmp_path):
    hooked = (
        (torch.optim.Optimizer, "__init__", torch.optim.Optimizer.__init__),
        (DataLoader, "__iter__", DataLoader.__iter__),
        (torch, "save", torch.save),
    )  # the workers' too: forked from here

    def originals() -> list[bool]:
        return [getattr(owner, name) is original for owner, name, original in hooked]

    @autoddp.distributed(nproc=2, start_method="fork")
    def inside(folder):
        during = originals()
        return inspected(folder, lambda: {"during": during, "after": originals()})

    inside(str(tmp_path))
    assert reports(str(tmp_path)) == [{"during": [False] * 3, "after": [True] * 3}] * 2
