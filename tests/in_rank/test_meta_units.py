"""Issue 42, item 3: a model built on the meta device is made on rank 0 a piece at a time, never whole.

Real multi-process gloo runs on CPU. The memory is each process's own (``/proc/self/status``): a
script run by the command reads its resident set at its first line and its peak at its end, and
no rank's growth may pass the budget that the whole model's parameters would not fit.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoddp
from conftest import FSDP_MISSING, needs_fsdp, run_python, write

if FSDP_MISSING:  # (a function below is decorated with strategy="fsdp" as the module loads)
    pytest.skip(FSDP_MISSING, allow_module_level=True)

MiB = 2**20

#: Thirty-two 2048-wide blocks (512 MiB of float32 parameters), built on the meta device where
#: argv[3] says so, trained with plain SGD on one batch an epoch (argv[1] rows a process), saved
#: sharded (a full checkpoint is written by rank 0, which then holds the whole model: not a build's
#: memory). Each rank writes its resident set at the first line and its peak at the end. autoddp
#: resets the peak (``clear_refs``) when it wraps the model (``strategy="auto"`` weighs the first
#: step from there): the peak before each reset is kept, so the peak counts from the first line.
#: Measured on torch 2.13 with 4 processes: every rank's peak 352 MiB above its first line (its
#: first step); before the build went piece by piece, rank 0's was 668 MiB (its whole host copy).
SCRIPT = """
    import torch


    def _status(field):
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field))


    first = _status("VmRSS:")
    peaks = []
    import json, os, sys  # noqa: E402
    from torch import nn  # noqa: E402
    import autoddp  # noqa: E402
    from autoddp.core.memory import resident  # noqa: E402

    reset_peak = resident.reset_peak
    resident.reset_peak = lambda *args: (peaks.append(_status("VmHWM:")), reset_peak(*args))[1]


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x):
            return torch.tanh(self.linear(x))


    torch.manual_seed(0)
    with torch.device(sys.argv[3]):
        model = nn.Sequential(*[Block(2048) for _ in range(32)], nn.Linear(2048, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 2048, generator=rows), torch.randn(32, 1, generator=rows)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=int(sys.argv[1]), shuffle=True)
    for epoch in range(2):
        for inputs, targets in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            opt.step()
    autoddp.save({"model": model}, sys.argv[2], sharded=True)
    peak = max([*peaks, _status("VmHWM:")])
    with open(os.path.join(sys.argv[2], "..", f"rank{os.environ.get('RANK', '0')}.json"), "w") as out:
        json.dump({"first": first, "peak": peak}, out)
"""

WHOLE = 32 * (2048 * 2048 + 2048) * 4 + (2048 + 1) * 4  # the model's parameter bytes


@needs_fsdp
@pytest.mark.timeout(240)
def test_a_meta_built_model_the_budget_cannot_hold_whole_is_sharded_and_no_rank_ever_holds_it(tmp_path):
    script = write(tmp_path / "train.py", SCRIPT)
    (tmp_path / "one").mkdir(), (tmp_path / "four").mkdir()
    one = run_python([str(script), "32", str(tmp_path / "one" / "ckpt"), "cpu"], timeout=120)
    assert one.returncode == 0, one.stderr
    budget = 448 * MiB  # DDP's state (1 GiB) does not fit; FSDP's over 4 processes (288 MiB) does
    assert budget < WHOLE  # a rank holding the whole model at once would be over it
    command = ["-m", "autoddp.cli", "-n", "4", "--device-memory", "448MiB", str(script), "8"]
    four = run_python([*command, str(tmp_path / "four" / "ckpt"), "meta"], timeout=200)
    assert four.returncode == 0, four.stderr
    said = " ".join(four.stderr.split())
    assert "FSDP across 4 processes" in said and "under ddp does not fit the 448.0 MiB" in said, said
    for rank in range(4):
        measured = json.loads((tmp_path / "four" / f"rank{rank}.json").read_text())
        grown = measured["peak"] - measured["first"]
        assert grown <= budget, f"rank {rank} grew {grown / MiB:.0f} MiB, over the budget"
    single = autoddp.load(str(tmp_path / "one" / "ckpt"))["model"]
    got = autoddp.load(str(tmp_path / "four" / "ckpt"))["model"]
    assert list(got) == list(single)
    for name in single:  # one process's weights, trained on the global batch
        torch.testing.assert_close(got[name], single[name], atol=1e-4, rtol=1e-4, msg=name)


class Gate(nn.Module):
    """A parent with a parameter of its own whose reset writes its child's tensors (as
    ``MultiheadAttention`` zeroes ``out_proj.bias``), and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.empty(8))
        self.register_buffer("table", torch.empty(3, 8), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.scale)
        nn.init.normal_(self.table)
        with torch.no_grad():
            self.inner.weight.mul_(self.scale)
            self.inner.bias.zero_()


class Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.BatchNorm1d(8)
        self.after = nn.Linear(8, 8)


class Tricky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.units = nn.ModuleList([Unit() for _ in range(3)])
        self.head = nn.Linear(8, 2)


@autoddp.distributed(nproc=2, strategy="fsdp")
def _built_on_meta() -> tuple:
    torch.manual_seed(4)
    with torch.device("meta"):
        model = autoddp.prepare(Tricky())
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    tables = [unit.gate.table.clone() for unit in model.units]
    gathered = [None, None]
    dist.all_gather_object(gathered, tables)  # every rank's non-persistent buffers: rank 0's
    return state, gathered


@needs_fsdp
@pytest.mark.timeout(120)
def test_a_meta_built_model_made_piece_by_piece_has_one_processes_weights_bit_for_bit():
    state, gathered = _built_on_meta()
    torch.manual_seed(4)
    reference = Tricky()
    assert list(state) == list(reference.state_dict())
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    for tables in gathered:
        for table, unit in zip(tables, reference.units, strict=True):
            assert torch.equal(table, unit.gate.table)


#: A small model built on the meta device: strategy "auto" (the default) takes DDP for it.
SMALL = """
    import sys, torch
    from torch import nn

    torch.manual_seed(0)
    with torch.device(sys.argv[2]):
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(4))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=int(sys.argv[3]), shuffle=True
    )
    for epoch in range(3):
        for inputs, targets in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            opt.step()
    torch.save(model.state_dict(), sys.argv[1])
"""


@pytest.mark.timeout(120)
def test_auto_taking_ddp_for_a_meta_built_model_gives_it_one_processes_weights(tmp_path):
    script = write(tmp_path / "train.py", SMALL)
    one = run_python([str(script), str(tmp_path / "one.pt"), "cpu", "8"])
    assert one.returncode == 0, one.stderr
    two = run_python(["-m", "autoddp.cli", "-n", "2", str(script), str(tmp_path / "two.pt"), "meta", "4"])
    assert two.returncode == 0, two.stderr
    assert "DDP across 2 processes" in two.stderr and "fits the" in two.stderr, two.stderr
    single, got = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for name in single:
        torch.testing.assert_close(got[name], single[name], atol=1e-4, rtol=1e-4, msg=name)
