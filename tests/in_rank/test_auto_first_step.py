"""strategy="auto" weighs the first optimizer step, activations included, against the budget: a
step over it restarts every rank once with the next plan (on the CPU too, by the resident peak).

Real 2-process gloo runs on CPU with real memory (no out-of-memory error is raised by hand), and
the reading of ``/proc`` checked on files of our own.
"""

from __future__ import annotations

import pytest
import torch

import autoddp
from autoddp.core.memory import budget, resident
from conftest import needs_fsdp, run_python, write

MiB = 2**20

#: Sixteen blocks of 2048 x 2048 (256 MiB of parameters), each keeping three activations of its
#: own (``tanh(h) * sigmoid(h)``), trained with plain SGD on one batch an epoch. Measured on torch
#: 2.13, per process with 768 rows: the first step holds about 1.15 GiB under DDP (512 MiB of
#: state), 500 MiB under FSDP (288 MiB) and 355 MiB with the blocks checkpointed.
SCRIPT = """
    import sys, torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x):
            h = self.linear(x)
            return torch.tanh(h) * torch.sigmoid(h)


    torch.manual_seed(0)
    model = nn.Sequential(*[Block(2048) for _ in range(16)], nn.Linear(2048, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(
        torch.randn(1536, 2048, generator=rows), torch.randn(1536, 1, generator=rows)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=int(sys.argv[1]), shuffle=True)
    for epoch in range(2):
        for inputs, targets in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            opt.step()
    torch.save(model.state_dict(), sys.argv[2])
"""


@needs_fsdp
@pytest.mark.timeout(300)
def test_a_first_step_over_the_budget_on_the_cpu_restarts_every_rank_with_the_next_plan(tmp_path):
    script = write(tmp_path / "train.py", SCRIPT)
    one = run_python([str(script), "1536", str(tmp_path / "one.pt")], timeout=120)
    assert one.returncode == 0, one.stderr
    single = torch.load(tmp_path / "one.pt")
    # 700 MiB: DDP's state fits, its first step does not, FSDP's does. 400 MiB: DDP's state does
    # not fit, FSDP's does, its first step does not, the checkpointed blocks' does.
    for memory, taken, restarted in (
        ("700MiB", "ddp", "fsdp"),
        ("400MiB", "fsdp", "fsdp with activation checkpointing"),
    ):
        out = tmp_path / f"{taken}.pt"
        two = run_python(
            ["-m", "autoddp.cli", "-n", "2", "--device-memory", memory, str(script), "768", str(out)],
            timeout=240,
        )
        assert two.returncode == 0, two.stderr
        said = " ".join(two.stderr.split())
        assert said.count(f"restarting all 2 workers once with {restarted}") == 1, said
        assert f"went over its memory budget under the plan strategy='auto' took ({taken};" in said
        assert "ran out of memory" not in said  # (a script skipping a batch on that must not swallow it)
        assert "its first step held" in said and "of the process's memory (its resident peak" in said
        assert f"auto (restarted at {restarted}: the last run needed more memory)" in said
        got = torch.load(out)
        for name in single:
            torch.testing.assert_close(got[name], single[name], atol=1e-4, rtol=1e-4, msg=name)


@needs_fsdp
def test_a_first_step_within_the_budget_restarts_nothing_and_a_budget_no_plan_fits_is_not_weighed_again(
    tmp_path,
):
    small = SCRIPT.replace("2048", "256").replace("1536", "64")
    for memory, plan in (("64MiB", "DDP"), ("1KiB", "FSDP")):
        script = write(tmp_path / "train.py", small)
        command = ["-m", "autoddp.cli", "-n", "2", "--device-memory", memory, str(script), "32"]
        two = run_python([*command, str(tmp_path / "t.pt")], timeout=120)
        assert two.returncode == 0, two.stderr
        assert f"{plan} across 2 processes" in two.stderr
        assert "restarting" not in two.stderr and "MemoryPlanError" not in two.stderr, two.stderr


@needs_fsdp
def test_memory_no_plan_shrinks_costs_one_restart_then_a_warning_not_the_run(tmp_path):
    """A dataset made after the optimizer (300 MiB) counts as the first step's: over the budget
    under DDP and again under FSDP after the restart, where it is said and the run goes on."""
    held = "    dataset = torch.ones(300 * 2**20, dtype=torch.uint8)\n    rows = "
    script = write(
        tmp_path / "train.py",
        SCRIPT.replace("2048", "256").replace("1536", "64").replace("    rows = ", held),
    )
    command = ["-m", "autoddp.cli", "-n", "2", "--device-memory", "200MiB", str(script), "32"]
    two = run_python([*command, str(tmp_path / "t.pt")], timeout=180)
    assert two.returncode == 0, two.stderr
    said = " ".join(two.stderr.split())
    assert said.count("restarting all 2 workers once with fsdp") == 1, said
    assert "after a restart for memory already" in said and "going on: a real out-of-memory error" in said


#: A small script whose rank 1 asks torch's CPU allocator for a petabyte where the model is not
#: sharded (as a replicated model's step would ask for more than the machine has): a real refusal.
REFUSED = """
    import os, sys, torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        if os.environ.get("RANK") == "1" and not hasattr(model, "reshard"):  # (FSDP2's modules have it)
            torch.empty(2**50, dtype=torch.uint8)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    torch.save(model.state_dict(), sys.argv[1])
"""


@needs_fsdp
def test_the_cpu_allocator_refusing_on_one_rank_restarts_every_rank_with_the_next_plan(tmp_path):
    script = write(tmp_path / "train.py", REFUSED)
    one = run_python([str(script), str(tmp_path / "one.pt")])
    assert one.returncode == 0, one.stderr
    two = run_python(["-m", "autoddp.cli", "-n", "2", str(script), str(tmp_path / "two.pt")], timeout=180)
    assert two.returncode == 0, two.stderr
    said = " ".join(two.stderr.split())
    assert said.count("restarting all 2 workers once with fsdp") == 1, said
    assert "[rank 1 of 2] ran out of memory under the plan strategy='auto' took (ddp;" in said
    assert "DefaultCPUAllocator" in said and "FSDP across 2 processes" in said
    single, got = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for name in single:  # (every rank trains on the whole batch: the same weights as one process)
        torch.testing.assert_close(got[name], single[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.unit
def test_the_resident_set_and_its_peak_are_read_and_the_peak_reset(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n")
    assert resident.peak(str(status)) == 200 * MiB and resident.resident(str(status)) == 100 * MiB
    assert resident.peak(str(tmp_path / "absent")) is None  # (no Linux: nothing to weigh)
    assert not resident.reset_peak(str(tmp_path / "no" / "clear_refs"))
    refs = tmp_path / "clear_refs"
    assert resident.reset_peak(str(refs)) and refs.read_text() == "5"  # (Linux: "5" resets VmHWM)
    assert resident.peak() is not None and resident.resident() <= resident.peak()  # this process's


@pytest.mark.unit
def test_a_cpu_first_step_is_over_only_beyond_the_runtimes_own_growth(monkeypatch):
    from autoddp.core.state import Planned
    from autoddp.in_rank.models import _first_step

    monkeypatch.delenv("AUTODDP_PLAN_FLOOR", raising=False)
    planned = Planned(budget=100 * MiB, placed=60 * MiB, ladder=("ddp", "fsdp"), taken=["ddp"])
    within = 100 * MiB + budget.CPU_RUNTIME
    assert _first_step.first_step_exceeds(planned, within, allowance=budget.CPU_RUNTIME) is None
    error = _first_step.first_step_exceeds(planned, within + 1, where="in RAM", allowance=budget.CPU_RUNTIME)
    assert isinstance(error, autoddp.MemoryPlanError) and error.next_plan == "fsdp"
    assert "its first step held 132.0 MiB in RAM; the next plan is fsdp" in str(error)
    assert "went over its memory budget under the plan" in str(error) and "out of memory" not in str(error)
    # restarted at FSDP on the CPU (no offload there): the fix names the checkpointed blocks
    cpu = ("ddp", "fsdp", "fsdp with activation checkpointing")
    planned = Planned(budget=100 * MiB, placed=60 * MiB, ladder=cpu, taken=["fsdp"])
    monkeypatch.setenv("AUTODDP_PLAN_FLOOR", "fsdp")
    error = _first_step.first_step_exceeds(planned, 200 * MiB)
    assert error.next_plan is None and "cpu_offload" not in str(error)
    assert "force the plan that shards most here (strategy='fsdp' with torch.utils.checkpoint" in str(error)
