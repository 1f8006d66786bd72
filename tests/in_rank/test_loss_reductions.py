"""A weighted mean or summed loss in the default (DDP) mode is said at the user's line: DDP averages
the ranks' own weighted means, which is not the global batch's weighted mean (issue 31 item 7), and
the ranks' sums, 1/N of the global batch's sum (pytorch/examples' vae)."""

from __future__ import annotations

import pytest

from conftest import run_python, write

SCRIPT = """
import sys, torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
labels = (torch.arange(32) % 4 != 0).long() * 2  # 3/4 of them class 2
data = torch.utils.data.TensorDataset(torch.randn(32, 4), labels)
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
if sys.argv[1] == "weights":
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 5.0]))
elif sys.argv[1] == "ignore":
    loss_fn = nn.CrossEntropyLoss(ignore_index=2)
elif sys.argv[1] == "sum":
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
else:
    loss_fn = nn.CrossEntropyLoss()
for x, y in loader:
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
print("done")
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loss", ["weights", "ignore", "mean", "sum"])
def test_a_weighted_mean_loss_is_said_at_its_backward_line(tmp_path, loss):
    script = write(tmp_path / "train.py", SCRIPT)
    proc = run_python(["-m", "autoddp.cli", "-n", "2", str(script), loss], cwd=tmp_path, timeout=150)
    assert proc.returncode == 0, proc.stderr
    said = "this loss is a weighted mean over the batch"
    summed = "this loss is summed over the batch (reduction='sum' or .sum()): DDP averages"
    if loss in ("mean", "sum"):
        assert said not in proc.stderr, proc.stderr
        assert (summed in proc.stderr) is (loss == "sum"), proc.stderr
        assert "multiply the loss by the number of processes" in proc.stderr or loss == "mean"
        return
    assert proc.stderr.count(said) == 1, proc.stderr  # once, on rank 0
    assert (
        f"train.py:{SCRIPT.splitlines().index('    loss.backward()') + 1}: AutoDDPWarning: autoddp: "
        in proc.stderr
    )
    assert "reduction='sum' divided by the global batch's total weight" in proc.stderr
