"""What ``gpu_check.py`` runs outside its own process: workers started by fork and by spawn, the command.

Kept apart so that each file has one job: ``gpu_check.py`` holds the checks in a group (DDP,
FSDP, step time), this one the checks of how processes start and what they put on which GPU, and
``check``, which both use. The fork probe runs ``gpu_check.py --fork-probe`` in a fresh caller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import autoddp

GPU_CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check.py")

Check = dict[str, Any]


def check(name: str, body: Callable[[], tuple[bool | None, Any]]) -> Check:
    """Run one check: its name, ok, details and seconds (an exception fails it, with its text)."""
    started = time.monotonic()
    try:
        ok, details = body()
    except Exception as error:  # a failed check is reported, the others still run
        ok, details = False, f"{type(error).__name__}: {error}"
    return {"name": name, "ok": ok, "details": details, "seconds": round(time.monotonic() - started, 2)}


def start_probe() -> dict[str, Any]:
    """In a worker: how it started, and where its CUDA memory went (the GPU it was given, only)."""
    main = sys.modules.get("__main__")
    report: dict[str, Any] = {
        "rank": autoddp.rank(),
        "forked": os.path.basename(getattr(main, "__file__", "") or "") == "gpu_check.py",
        "cuda": torch.cuda.is_available(),
    }
    if report["cuda"]:
        tensor = torch.ones(1024, device="cuda")
        report["device"] = str(tensor.device)
        report["allocated"] = {i: torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, report)
    return every


def started(method: str, cuda: bool) -> tuple[bool, Any]:
    """Two gloo workers started by ``method``: how they started, where their CUDA memory went."""
    run = autoddp.distributed(nproc=2, backend="gloo", capture=False, start_method=method)(start_probe)
    reports = run()
    ok = all(r["forked"] == (method == "fork") and r["cuda"] == cuda for r in reports)
    if cuda:  # nothing on a device other than the worker's own
        ok = ok and all(
            v == 0 for r in reports for i, v in r["allocated"].items() if f"cuda:{i}" != r["device"]
        )
    return ok, {"workers": reports, "gpu processes": _gpu_processes() if cuda else None}


def touched_checks() -> list[Check]:
    """With CUDA initialised here: workers start as fresh interpreters; fork is refused, clearly."""
    torch.cuda.init()

    def refused() -> tuple[bool, Any]:
        try:
            started("fork", cuda=True)
        except autoddp.ConfigurationError as error:
            return "CUDA" in str(error), str(error)
        return False, "fork was allowed after CUDA was initialised here"

    return [
        check("spawn, CUDA touched here", lambda: started("spawn", cuda=True)),
        check("fork refused, CUDA touched here", refused),
    ]


def untouched_check() -> Check:
    """From a fresh caller that never touched CUDA, forked workers that use it (a subprocess)."""

    def untouched() -> tuple[bool, Any]:
        probe = subprocess.run(
            [sys.executable, GPU_CHECK, "--fork-probe"], capture_output=True, text=True, timeout=180
        )
        if probe.returncode != 0:
            return False, probe.stderr[-2000:]
        reports = json.loads(probe.stdout.splitlines()[-1])
        return all(r["forked"] and r["cuda"] for r in reports), reports

    return check("fork, CUDA untouched", untouched)


def _gpu_processes() -> str:
    try:
        return torch.cuda.list_gpu_processes(0)
    except Exception as error:  # pynvml missing: say so
        return f"not available ({type(error).__name__}: {error})"


SCRIPT = """
import sys
import torch
from torch import nn

device = sys.argv[1]  # "cuda:0", as single-GPU scripts say it
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
torch.save(model.state_dict(), "model.pt")
print("DEVICE", next(model.parameters()).device, "LOSS", float(loss))
"""


def captured_script(cuda: bool) -> tuple[bool, Any]:
    """An unchanged single-GPU script under the command (``-n 1`` on a GPU, ``-n 2`` on CPU)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "train.py")
        with open(path, "w") as script:
            script.write(SCRIPT)
        device, nproc = ("cuda:0", "1") if cuda else ("cpu", "2")
        command = [sys.executable, "-m", "autoddp.cli", "-n", nproc, path, device]
        result = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=180)
        saved = os.path.exists(os.path.join(folder, "model.pt"))
        ok = result.returncode == 0 and saved and f"DEVICE {device}" in result.stdout
        output = (result.stdout + result.stderr)[-1500:]
        return ok, {"exit": result.returncode, "saved": saved, "output": output}
