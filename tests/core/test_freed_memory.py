"""CPU DDP workers keep a step's freed memory for the next step (``hardware.keep_freed_memory``),
never over the user's own malloc settings."""

from __future__ import annotations

import json
import os
import statistics
import sys

import pytest

from autoddp.core.environment import hardware
from conftest import run_python, write

pytestmark = pytest.mark.timeout(240)

# A plain single-GPU-style script: rank 0's minor page faults per step of its last epoch.
TRAIN = """
import json, resource, torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10),
)
data = TensorDataset(torch.randn(1024, 3, 32, 32), torch.randint(0, 10, (1024,)))
loader = DataLoader(data, batch_size=32, shuffle=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
faults = []
for epoch in range(3):
    for x, y in loader:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if epoch == 2:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print("FAULTS", json.dumps(faults))
"""


@pytest.mark.unit
@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_ARENA_MAX": "2"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    ],
)
def test_the_users_own_malloc_settings_win(environ):
    assert hardware.keep_freed_memory(environ) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_cpu_workers_steps_do_not_fault_their_memory_in_again(tmp_path, monkeypatch):
    """Left adaptive, glibc gives a step's freed activations back and the next step faults them
    in again (40-1,800 faults a step here, from run to run); kept, a step faults next to none."""
    for name in [n for n in os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    script = write(tmp_path / "train.py", TRAIN)
    proc = run_python(["-m", "autoddp.cli", "-q", "-n", "2", str(script)], cwd=tmp_path, timeout=200)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("FAULTS "))
    faults = json.loads(line.split(" ", 1)[1])
    assert len(faults) == 16  # 1024 samples, 32 a batch, 2 ranks
    assert statistics.median(faults) <= 20, faults
