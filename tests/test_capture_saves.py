"""Captured saves and what comes back: complete files on every rank, plain pickles, the caller's
own classes, and a clear word when ranks run out of batches at different times.

Real 2-process gloo runs of unchanged code, the decorator and the command alike.
"""

from __future__ import annotations

import pickletools

from conftest import run_python, write

# --- item 10: a saved captured model is the user's plain class, loadable without autoddp --------

SAVES_MODEL = """
    import sys, torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    torch.save(model, sys.argv[1])
    print("weight", model[0].weight.sum().item(), flush=True)
"""

LOAD_WITHOUT_AUTODDP = """
import sys
sys.modules["autoddp"] = None  # any reference to autoddp in the pickle fails to import
import torch
model = torch.load(sys.argv[1], weights_only=False)
print(type(model).__module__, type(model).__qualname__, sorted(model.__dict__)[:3])
print("weight", model[0].weight.sum().item())
"""


def _globals(path) -> set[str]:
    """The module names a torch.save file's pickle refers to."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        data = archive.read(name)
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add(strings[-2])
        elif op.name == "GLOBAL":
            found.add(arg.split(" ")[0])
    return found


def test_a_saved_captured_model_loads_with_plain_torch(tmp_path):
    path = tmp_path / "model.pt"
    script = write(tmp_path / "train.py", SAVES_MODEL)
    ran = run_python(["-m", "autoddp.cli", "-n", "2", str(script), str(path)], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert not any(name.startswith("autoddp") for name in _globals(path)), _globals(path)
    loaded = run_python(["-c", LOAD_WITHOUT_AUTODDP, str(path)])
    assert loaded.returncode == 0, loaded.stderr
    assert "torch.nn.modules.container Sequential" in loaded.stdout
    assert "_autoddp" not in loaded.stdout
    trained = next(line for line in ran.stdout.splitlines() if "weight" in line).split()[-1]
    assert loaded.stdout.splitlines()[-1].split()[-1] == trained
