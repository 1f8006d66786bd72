"""strategy="auto" (the default): DDP where a model's state fits the memory a process may use
(``device_memory``), else FSDP2; every rank takes the same plan; the notice says why.

Real 2-process gloo runs on CPU, and the rules and the bytes weighed checked by hand.
"""

from __future__ import annotations

import dataclasses

import numpy
import pytest
import torch
from torch import nn

import autoddp
from autoddp import ConfigurationError
from autoddp.core.memory import budget, estimate, optimizers
from autoddp.core.memory.sizes import format_bytes
from autoddp.options import Options
from conftest import needs_fsdp, run_python, write

MiB = 2**20


@pytest.mark.unit
def test_the_cheapest_plan_that_fits_is_taken_and_none_fitting_takes_the_fewest_bytes():
    needs = {"ddp": 40, "fsdp": 25, "fsdp with CPU offload": 5}
    assert budget.choose(needs, 100).name == "ddp"  # a model that fits under DDP always gets DDP
    assert budget.choose(needs, 40).name == "ddp"
    chosen = budget.choose(needs, 30)
    assert (chosen.strategy, chosen.cpu_offload, chosen.fits) == ("fsdp", False, True)
    chosen = budget.choose(needs, 10)
    assert (chosen.strategy, chosen.cpu_offload, chosen.fits) == ("fsdp", True, True)
    chosen = budget.choose({"ddp": 40, "fsdp": 25}, 10)  # on CPU: no offload to weigh
    assert (chosen.name, chosen.fits) == ("fsdp", False)
    assert (
        chosen.describe()
        == "no plan fits the 10 B a process may use (state 40 B under ddp, 25 B under fsdp): "
        "fsdp needs the fewest"
    )
    assert budget.choose(needs, 100).describe() == "state 40 B fits the 100 B a process may use"
    assert (
        budget.choose(needs, 30).describe()
        == "state 40 B under ddp does not fit the 30 B a process may use; 25 B under fsdp does"
    )
    # a small model is larger sharded (the gathered blocks): none fitting, it keeps DDP
    assert budget.choose({"ddp": 30, "fsdp": 38}, 10).name == "ddp"
    # checkpointing saves activations, not state: never taken by weighing, only from a restart
    checkpointing = {"ddp": 40, "fsdp": 25, "fsdp with activation checkpointing": 25}
    assert budget.choose(checkpointing, 30).name == budget.choose(checkpointing, 10).name == "fsdp"
    chosen = budget.choose(checkpointing, 30, ["fsdp with activation checkpointing"])
    assert (chosen.strategy, chosen.cpu_offload, chosen.checkpoint_blocks) == ("fsdp", False, True)
    assert budget.rung("fsdp with CPU offload").checkpoint_blocks  # (the offload plan keeps it)


@pytest.mark.unit
def test_the_default_budgets():
    assert budget.cpu_default(16 * 2**30, 4) == 4 * 2**30
    # a GPU: free plus what this process's allocator reserved, less 10% of the device
    assert budget.gpu_default(free=60 * 2**30, reserved=10 * 2**30, total=80 * 2**30) == 62 * 2**30
    assert budget.gpu_default(free=1, reserved=0, total=80 * 2**30) == 0


@pytest.mark.unit
def test_device_memory_takes_sizes_and_refuses_anything_else_naming_the_forms():
    assert Options(device_memory="1200MiB").device_memory == 1200 * MiB
    assert Options(device_memory=5 * MiB).device_memory == 5 * MiB
    assert Options().strategy == "auto" and Options().device_memory is None
    for bad in ("lots", "-3GiB", "12 parsecs", True):
        with pytest.raises(ConfigurationError, match="device_memory=.*'24GiB'"):
            autoddp.distributed(device_memory=bad)
    assert Options(device_memory=numpy.int64(2**30)).device_memory == 2**30
    with pytest.raises(
        ConfigurationError, match="device_memory=0: give the memory one process may use, above 0"
    ):
        autoddp.distributed(device_memory=0)
    with pytest.raises(ConfigurationError, match="strategy='ddp' weighs nothing: leave device_memory out"):
        autoddp.distributed(strategy="ddp", device_memory="1GiB")
    with pytest.raises(ConfigurationError, match="use strategy='fsdp'"):
        autoddp.distributed(strategy="ddp", cpu_offload=True)
    with pytest.raises(ConfigurationError, match="split_batches works with DDP only"):
        autoddp.distributed(split_batches=True, mixed_precision="bf16")


@pytest.mark.unit
def test_the_state_weighed_for_each_plan():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4))
    params = sum(p.numel() * 4 for p in model.parameters())
    adam = torch.optim.Adam(model.parameters())
    ddp = estimate.state_only(model, optimizer=adam)
    assert ddp.total == params + params + 2 * params  # parameters, gradients (bucket views), m and v
    # the optimizer being made: the groups from its defaults
    defaults = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).defaults  # (what __init__ passes on)
    sgd = (torch.optim.SGD, optimizers.groups_made(model.parameters(), defaults))
    assert estimate.state_only(model, optimizer=sgd).total == 3 * params
    plain = (torch.optim.SGD, optimizers.groups_made(model.parameters(), {**defaults, "momentum": 0}))
    assert estimate.state_only(model, optimizer=plain).total == 2 * params
    units = [model[0], model[1]]
    fsdp = estimate.state_only(model, optimizer=adam, plan="fsdp", processes=2, units=units)
    block = 64 * 65 * 4
    assert fsdp.gathered == 4 * 65 * 4 + 2 * block  # the root's own head, two blocks gathered
    assert fsdp.total == fsdp.gathered + (params + params + 2 * params) // 2
    offload = estimate.state_only(model, optimizer=adam, plan="fsdp", processes=2, units=units, offload=True)
    assert offload.total == offload.gathered


SCRIPT = """
    import sys, torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)], nn.Linear(128, 2))
    opt = torch.optim.SGD(model.parameters(), 0.01, 0.9)  # momentum by position: one copy of state
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 128, generator=g), torch.randn(16, 2, generator=g)  # one batch an epoch
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=int(sys.argv[1]), shuffle=True
    )
    for _ in range(3):
        for xb, yb in loader:
            loss = (model(xb) - yb).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    torch.save(model.state_dict(), sys.argv[2])
"""

#: The script's model under SGD with momentum: parameters, gradients and momentum, 4 bytes each.
_STATE = 3 * (4 * 128 * 129 + 129 * 2) * 4


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-4, msg=name)


@needs_fsdp
@pytest.mark.smoke
def test_the_command_picks_ddp_where_the_state_fits_and_fsdp_where_only_shards_do(tmp_path):
    script = write(tmp_path / "train.py", SCRIPT)
    one = run_python([str(script), "16", str(tmp_path / "one.pt")])
    assert one.returncode == 0, one.stderr
    single = torch.load(tmp_path / "one.pt")
    for memory, plan in ((f"{2 * _STATE}B", "DDP"), (f"{int(0.75 * _STATE)}B", "FSDP")):
        out = tmp_path / f"{plan}.pt"
        two = run_python(
            ["-m", "autoddp.cli", "-n", "2", "--device-memory", memory, str(script), "8", str(out)],
            timeout=180,
        )
        assert two.returncode == 0, two.stderr
        assert f"{plan} across 2 processes" in two.stderr, two.stderr
        allowed = f"the {format_bytes(int(memory[:-1]))} a process may use"
        if plan == "DDP":
            assert f"auto: state {format_bytes(_STATE)} fits {allowed}" in two.stderr
        else:
            assert f"auto: state {format_bytes(_STATE)} under ddp does not fit {allowed}; " in two.stderr
        _close(torch.load(out), single)


def _agree(small: int, big: int) -> tuple[str, str]:
    """Each rank with its own budget (``small`` on rank 1): the strategy and the note it takes."""
    from autoddp.core.state import CURRENT
    from autoddp.in_rank import models

    options = CURRENT.options
    own = small if autoddp.rank() == 1 else big
    CURRENT.options = dataclasses.replace(options, device_memory=own)
    try:
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 2))
        prepared = autoddp.prepare(model)
        return models.strategy_name(prepared), models.plan_note(prepared)
    finally:
        CURRENT.options = options


@needs_fsdp
def test_every_rank_takes_the_plan_the_least_budget_allows():
    state = 2 * 4 * (6 * 64 * 65 + 65 * 2)  # parameters and gradients: prepare knows no optimizer
    small = int(0.8 * state)  # sharded: about 1/2 of it, and two blocks gathered
    strategy, note = autoddp.distributed(nproc=2, capture=False)(_agree)(small, 2**70)  # (no int64 holds it)
    assert strategy == "fsdp"  # rank 0 alone would take DDP: it takes rank 1's plan
    assert f"does not fit the {format_bytes(small)} a process may use" in note


#: The script above, where a replicated model does not fit rank 1's GPU: its first step raises
#: torch's out-of-memory error there (``TOO_BIG``: under any plan), as CUDA's allocator would.
OUT_OF_MEMORY = SCRIPT.replace(
    "            loss = (model(xb) - yb).pow(2).mean()",
    """            sharded = hasattr(model, "reshard")  # an FSDP2 module
            if os.environ.get("RANK") == "1" and (not sharded or TOO_BIG):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            loss = (model(xb) - yb).pow(2).mean()""",
).replace("import sys, torch", "import os, sys, torch\n    TOO_BIG = sys.argv[3] == 'always'")


@needs_fsdp
@pytest.mark.smoke
def test_out_of_memory_on_one_rank_restarts_every_rank_once_with_the_next_plan(tmp_path):
    script = write(tmp_path / "train.py", OUT_OF_MEMORY)
    one = run_python([str(script), "16", str(tmp_path / "one.pt"), "never"])
    assert one.returncode == 0, one.stderr
    two = run_python(
        ["-m", "autoddp.cli", "-n", "2", str(script), "8", str(tmp_path / "two.pt"), "once"], timeout=180
    )
    assert two.returncode == 0, two.stderr
    said = " ".join(two.stderr.split())
    assert said.count("restarting all 2 workers once with fsdp") == 1, two.stderr
    assert "[rank 1 of 2] ran out of memory under the plan strategy='auto' took (ddp;" in said
    assert "FSDP across 2 processes" in said
    assert "auto (restarted at fsdp: the last run needed more memory" in said
    _close(torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt"))


@needs_fsdp
def test_a_second_out_of_memory_is_the_users_error_with_the_numbers(tmp_path):
    script = write(tmp_path / "train.py", OUT_OF_MEMORY)
    two = run_python(
        ["-m", "autoddp.cli", "-n", "2", str(script), "8", str(tmp_path / "two.pt"), "always"], timeout=180
    )
    assert two.returncode != 0
    said = " ".join(two.stderr.split())
    assert said.count("restarting all 2 workers") == 1, two.stderr
    assert (
        "MemoryPlanError: [rank 1 of 2] ran out of memory under the plan strategy='auto' took (fsdp" in said
    )
    assert "after a restart for memory already: start more processes or train on smaller batches" in said
    assert not (tmp_path / "two.pt").exists()


def _train_out_of_memory_once(steps: int = 3) -> dict:
    """Rank 1's first step runs out of memory where the model is replicated (as a GPU would)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    for _ in range(steps):
        if autoddp.rank() == 1 and not hasattr(model, "reshard"):  # (an FSDP2 module has it)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return autoddp.unwrap(model).state_dict()


@needs_fsdp
def test_the_decorator_restarts_once_with_the_next_plan_and_returns_the_result(capfd):
    single = _train_out_of_memory_once()
    got = autoddp.distributed(nproc=2)(_train_out_of_memory_once)()
    _close(got, single)
    said = " ".join(capfd.readouterr().err.split())
    assert said.count("restarting all 2 workers once with fsdp") == 1
    assert "FSDP across 2 processes" in said


class _Block(nn.Module):
    """A block that counts its forwards in this process (a checkpointed one runs again in backward)."""

    forwards = 0

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Block.forwards += 1  # (not type(self): FSDP2 gives each block a subclass of its own)
        return torch.tanh(self.linear(x))


def _train_out_of_memory_unless_checkpointed(steps: int = 3) -> tuple[dict, list[int]]:
    """Rank 1 runs out of memory at its second step where no block's forward ran again in the
    first step's backward pass (its activations were kept). Returns the weights and, per step, the
    blocks' forwards in the backward pass. Each rank trains on its half of the batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Block() for _ in range(4)), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    x = x if autoddp.world_size() == 1 else x[autoddp.rank() :: autoddp.world_size()]
    in_backward = []
    for step in range(steps):
        if step == 1 and autoddp.rank() == 1 and in_backward[0] == 0:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        before = _Block.forwards
        loss.backward()
        in_backward.append(_Block.forwards - before)
        opt.step()
    return autoddp.unwrap(model).state_dict(), in_backward


@needs_fsdp
def test_out_of_memory_under_fsdp_restarts_with_the_blocks_checkpointed(capfd):
    """The plan after FSDP recomputes each block's forward in the backward pass (its activations
    are not kept): the same weights as one process."""
    single, alone = _train_out_of_memory_unless_checkpointed()
    assert alone == [0, 0, 0]
    run = autoddp.distributed(nproc=2, device_memory="1KiB")  # (no plan fits: FSDP needs the fewest)
    got, recomputed = run(_train_out_of_memory_unless_checkpointed)()
    _close(got, single)
    assert recomputed == [4, 4, 4]  # (four blocks: each forward again in each backward)
    said = " ".join(capfd.readouterr().err.split())
    assert said.count("restarting all 2 workers once with fsdp with activation checkpointing") == 1, said
    assert "auto (restarted at fsdp with activation checkpointing: the last run needed more memory" in said


@pytest.mark.unit
def test_a_first_step_over_the_budget_on_a_gpu_names_the_next_plan_once(monkeypatch):
    from autoddp.core.state import Planned
    from autoddp.in_rank.models import _first_step

    monkeypatch.delenv("AUTODDP_PLAN_FLOOR", raising=False)
    ladder = ("ddp", "fsdp", "fsdp with activation checkpointing", "fsdp with CPU offload")
    planned = Planned(budget=100 * MiB, placed=60 * MiB, ladder=ladder, taken=["ddp"])
    assert _first_step.first_step_exceeds(planned, 100 * MiB) is None  # activations included, it fits
    error = _first_step.first_step_exceeds(planned, 130 * MiB)
    assert isinstance(error, autoddp.MemoryPlanError) and error.next_plan == "fsdp"
    assert (
        "took (ddp; 60.0 MiB of state per process, 100.0 MiB allowed): its first step held 130.0 MiB"
        in str(error)
    )
    planned.taken.append("fsdp")  # a second model sharded: the next plan is past the largest taken
    following = _first_step.first_step_exceeds(planned, 130 * MiB).next_plan
    assert following == "fsdp with activation checkpointing"
    monkeypatch.setenv("AUTODDP_PLAN_FLOOR", "fsdp")  # restarted for memory already: no next plan
    error = _first_step.first_step_exceeds(planned, 130 * MiB)
    assert error.next_plan is None and "after a restart for memory already" in str(error)


@pytest.mark.unit
def test_models_fsdp2_cannot_shard_as_they_are_keep_ddp_and_say_why():
    from autoddp.core.state import RunOptions, World
    from autoddp.in_rank.models import _plan, fsdp

    world, options = World(world_size=2, local_world_size=2), RunOptions()

    def forced(module, training=None):
        return _plan._forced(module, world, options, training, fsdp)

    blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    assert forced(blocks) is None  # weighed
    tied = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    tied[1].weight = tied[0].weight  # one weight in two blocks: FSDP2 refuses it
    assert forced(tied)[0] == "ddp" and "shared by two of its blocks" in forced(tied)[1]
    assert forced(blocks, (torch.optim.LBFGS, []))[0] == "ddp"
    compiled = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), backend="eager")
    assert forced(compiled)[0] == "ddp" and "torch.compile" in forced(compiled)[1]
    lazy = nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 2))
    assert forced(lazy)[0] == "ddp"
    assert forced(blocks, None) is None
    assert (
        _plan._forced(blocks, world, dataclasses.replace(options, cpu_offload=True), None, fsdp)[0] == "fsdp"
    )
    assert _plan._forced(blocks, World(), options, None, fsdp) == ("ddp", None)  # one process
