"""strategy="fsdp": FSDP2 shards, the same results as one process with the global batch.

Real 2-process gloo runs on CPU: training, checkpoints full and sharded, capture and the command.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoddp
from autoddp import ConfigurationError
from autoddp.in_rank.models.fsdp import units
from conftest import FSDP_MISSING, run_python, write

pytestmark = pytest.mark.smoke  # CI runs these on the lowest and the newest torch too (-m smoke)

if FSDP_MISSING:  # (module-level runs below shard models as the module loads)
    pytest.skip(FSDP_MISSING, allow_module_level=True)

LR = 0.01


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).argmax(1)


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank + 7)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 2, generator=generator)


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    (x0, y0), (x1, y1) = _batch(0), _batch(1)
    return torch.cat([x0, x1]), torch.cat([y0, y1])


def _steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, n: int) -> None:
    for _ in range(n):
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _reference(start: dict, steps: int) -> dict:
    model = Net()
    model.load_state_dict(start)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    _steps(model, opt, *_global_batch(), steps)
    return model.state_dict()


def _close(state: dict, reference: dict) -> None:
    assert list(state) == list(reference)
    for name, value in state.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_units_are_the_repeated_blocks():
    model = Net()
    assert units(model) == list(model.blocks)
    assert units(model, ("Linear",)) == [b.fc for b in model.blocks] + [model.head]
    lone = nn.Sequential(nn.Linear(4, 400), nn.ReLU(), nn.Conv1d(1, 1, 1))
    assert units(lone) == [lone[0]]  # nothing repeats: the child holding most of the parameters


def test_a_sharded_model_trains_like_one_process_with_the_global_batch():
    @autoddp.distributed(nproc=2, strategy="fsdp")
    def train(model):
        local = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        _steps(model, opt, *_batch(autoddp.rank()), 3)
        with torch.no_grad():
            predicted = model.predict(torch.ones(2, 8)).tolist()  # a method calling self(x)
        return model, local / total, isinstance(model, Net), sorted(model.state_dict())[:2], predicted

    torch.manual_seed(0)
    start = Net()
    initial = {k: v.clone() for k, v in start.state_dict().items()}
    model, share, is_net, keys, predicted = train(start)
    assert type(model) is Net  # the caller gets the plain, unsharded model
    assert is_net and keys == ["blocks.0.fc.bias", "blocks.0.fc.weight"]
    assert share == pytest.approx(0.5, abs=0.02)  # each rank holds half of every parameter
    _close(model.state_dict(), _reference(initial, 3))
    assert predicted == model.predict(torch.ones(2, 8)).tolist()


@autoddp.distributed(nproc=2, strategy="fsdp")
def _train_and_save(model, path, steps):
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    _steps(model, opt, *_batch(autoddp.rank()), steps)
    autoddp.save({"model": model, "optimizer": opt, "step": steps}, path)


@autoddp.distributed(nproc=2, strategy="fsdp")
def _resume(model, path, steps):
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    state = autoddp.load(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    _steps(model, opt, *_batch(autoddp.rank()), steps)
    return model, state["step"]


@pytest.mark.parametrize("sharded", [False, True])
def test_save_load_and_continue_equals_an_uninterrupted_run(tmp_path, sharded):
    torch.manual_seed(0)
    start = Net()
    initial = {k: v.clone() for k, v in start.state_dict().items()}
    path = str(tmp_path / "ckpt") + os.sep if sharded else str(tmp_path / "ckpt.pt")
    _train_and_save(start, path, 2)
    if not sharded:
        saved = torch.load(path)
        assert list(saved["model"]) == list(Net().state_dict())  # the user's keys
        assert all(type(v) is torch.Tensor for v in saved["model"].values())  # plain tensors
        plain = Net()
        plain.load_state_dict(saved["model"])  # loads into an unsharded model
        plain_opt = torch.optim.Adam(plain.parameters(), lr=LR)
        plain_opt.load_state_dict(saved["optimizer"])  # and so does the optimizer state
    else:
        assert os.path.isfile(tmp_path / "ckpt" / ".metadata")
        alone = autoddp.load(path)  # a world of one process: plain full tensors
        plain = Net()
        plain.load_state_dict(alone["model"])
        torch.optim.Adam(plain.parameters(), lr=LR).load_state_dict(alone["optimizer"])
        assert alone["step"] == 2
    model, step = _resume(Net(), path, 2)
    assert step == 2
    _close(model.state_dict(), _reference(initial, 4))


def test_capture_with_fsdp_binds_the_optimizer_to_the_shards():
    @autoddp.distributed(nproc=2, strategy="fsdp")
    def train(start):
        model = Net()
        model.load_state_dict(start)
        opt = torch.optim.Adam(model.parameters(), lr=LR)  # made before sharding: capture rebinds it
        _steps(model, opt, *_batch(autoddp.rank()), 3)
        bound = all(type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"])
        return model, bound

    torch.manual_seed(0)
    start = Net().state_dict()
    model, bound = train(start)
    assert bound
    _close(model.state_dict(), _reference(start, 3))


PLAIN_SCRIPT = """
    import json, sys, torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(data, batch_size=int(sys.argv[1]), shuffle=True)
    for _ in range(3):
        for xb, yb in loader:
            loss = (model(xb) - yb).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    torch.save(model.state_dict(), sys.argv[2])
"""


def test_the_command_with_fsdp_on_an_unmodified_script(tmp_path):
    script = write(tmp_path / "train.py", PLAIN_SCRIPT)
    one = run_python([str(script), "16", str(tmp_path / "one.pt")])
    assert one.returncode == 0, one.stderr
    two = run_python(
        ["-m", "autoddp.cli", "-n", "2", "--strategy", "fsdp", str(script), "8", str(tmp_path / "two.pt")]
    )
    assert two.returncode == 0, two.stderr
    assert "FSDP across 2 processes" in two.stderr
    single, sharded = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert all(type(v) is torch.Tensor for v in sharded.values())  # torch.save gathered it whole
    _close(sharded, single)


@pytest.mark.unit
def test_fsdp_options_are_checked():
    with pytest.raises(ConfigurationError, match="strategy"):
        autoddp.distributed(strategy="zero3")
    with pytest.raises(ConfigurationError, match="mixed_precision='fp8'"):
        autoddp.distributed(strategy="fsdp", mixed_precision="fp8")
    with pytest.raises(ConfigurationError, match="use strategy='fsdp'"):
        autoddp.distributed(strategy="ddp", mixed_precision="bf16")
    with pytest.raises(ConfigurationError, match="fsdp_blocks"):
        autoddp.distributed(strategy="fsdp", fsdp_blocks="Block")


@pytest.mark.unit
def test_one_process_runs_unsharded_with_a_note():
    @autoddp.distributed(nproc=1, strategy="fsdp")
    def train(model):
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepared = autoddp.prepare(model)
        return type(prepared).__name__, [str(w.message)[:40] for w in caught]

    with pytest.warns(
        autoddp.AutoDDPWarning, match="strategy='fsdp' with one process"
    ):  # preparing the argument
        name, notes = train(Net())
    assert name == "Net" and notes == ["autoddp: strategy='fsdp' with one proces"]


def test_mixed_precision_and_offload_map_onto_fsdp2_policies():
    @autoddp.distributed(nproc=2, strategy="fsdp", mixed_precision="bf16", cpu_offload=True)
    def train():
        model = autoddp.prepare(Net())
        out = model(torch.ones(2, 8))
        flags = [out.dtype == torch.bfloat16, str(next(model.parameters()).dtype)]
        gathered = [None, None]
        dist.all_gather_object(gathered, flags)
        return gathered

    # computed in bf16; the sharded parameters themselves stay float32
    assert train() == [[True, "torch.float32"], [True, "torch.float32"]]


PREPARED = """
    import torch, autoddp
    from torch import nn
    from autoddp.core.state import CURRENT
    model = autoddp.prepare(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)))
    if autoddp.rank() == 0:
        print("PREPARED", type(model).__name__, CURRENT.options.strategy, CURRENT.options.mixed_precision)
"""


def test_the_commands_options_reach_the_code_of_a_plain_script(tmp_path):
    """``autoddp --strategy fsdp --mixed-precision bf16 script.py``: what the script's ranks read as
    the run's options (``autoddp.prepare``'s strategy; whether FSDP's accumulation may defer) is what
    the command was given, with capture and without (it was the defaults: prepare made a DDP)."""
    given = ["--strategy", "fsdp", "--mixed-precision", "bf16"]
    script = write(tmp_path / "prepared.py", PREPARED)
    done = run_python(["-m", "autoddp.cli", "-n", "2", *given, str(script)])
    assert done.returncode == 0, done.stderr
    assert "PREPARED FSDPSequential fsdp bf16" in done.stdout, done.stdout
    own_group = 'import torch.distributed as dist; dist.init_process_group("gloo")\n'
    script = write(tmp_path / "own_group.py", own_group + textwrap.dedent(PREPARED))
    done = run_python(["-m", "autoddp.cli", "-n", "2", "--no-capture", *given, str(script)])
    assert done.returncode == 0, done.stderr
    assert "PREPARED FSDPSequential fsdp bf16" in done.stdout, done.stdout
