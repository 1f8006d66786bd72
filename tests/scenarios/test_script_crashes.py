"""Habits of single-process scripts that crashed under autoddp: each runs unchanged in 2 processes
and gives what one process gives (issue 31, item 4)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import textwrap
import zipfile

import pytest

from autoddp.core import _compat
from conftest import run_python, write

#: Runs of 2 processes, several at once (spawned loader workers, compiles): slow on a busy machine.
pytestmark = pytest.mark.timeout(300)
COMMAND = ["-m", "autoddp.cli", "-n", "2", "--ranks", "all"]
#: The model of the scripts below, made as one process makes it.
NET = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 3), nn.Linear(3, 1)
    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))

torch.manual_seed(0)
model = Net()
"""


def _by_rank(stdout: str, tag: str) -> dict[int, object]:
    """The JSON each rank printed after ``tag`` (``[rank N] tag {...}`` lines of ``--ranks all``)."""
    found = {}
    for line in stdout.splitlines():
        head, _, rest = line.partition("] ")
        if rest.startswith(tag + " "):
            found[int(head.rsplit(" ", 1)[1])] = json.loads(rest[len(tag) + 1 :])
    return found


COMPILED = """
import json, sys, torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

graphs = []
def backend(gm, inputs):
    graphs.append(len(gm.graph.nodes))
    return gm.forward
{net}if sys.argv[1] == "before":
    model = torch.compile(model, backend=backend)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if sys.argv[1] == "after":
    model = torch.compile(model, backend=backend)
data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
for epoch in range(2):
    for x, y in DataLoader(data, batch_size=8, shuffle=True):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
weights = [round(v, 6) for p in model.parameters() for v in p.detach().flatten().tolist()]
print("result", json.dumps({"graphs": len(graphs), "weights": weights}), flush=True)
"""


def test_compiling_after_the_optimizer_trains_as_compiling_before(tmp_path):
    script = str(write(tmp_path / "compiled.py", COMPILED.replace("{net}", NET)))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        after, before = pool.map(
            lambda where: run_python([*COMMAND, script, where], timeout=280), ["after", "before"]
        )
    assert after.returncode == 0, after.stderr[-3000:]
    assert before.returncode == 0, before.stderr[-3000:]
    got, reference = _by_rank(after.stdout, "result"), _by_rank(before.stdout, "result")
    assert got[0]["weights"] == got[1]["weights"] == reference[0]["weights"]  # DDP averaged, as before
    assert got[0]["graphs"] == reference[0]["graphs"] >= 1  # the forward is compiled, once
    assert "uncompiled" not in after.stderr and "Dynamo" not in after.stderr


SAVED = """
import hashlib, json, zipfile, torch, torch.nn as nn
import torch.distributed as dist
{net}opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step():
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
step()
torch.save(model, "model.pt")
torch.serialization.add_safe_globals([Net, nn.Linear, nn.LSTM])  # (safe_globals: torch >= 2.5)
loaded = torch.load("model.pt", weights_only=True)  # (the default from torch 2.6)
with zipfile.ZipFile("model.pt") as z:
    pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
torch.manual_seed(dist.get_rank() if dist.is_initialized() else 0)
step()  # still trained as before the save (every rank its own batch, averaged)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
if dist.is_initialized():
    parts = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, weights)
    same = all(torch.equal(parts[0], part) for part in parts)
else:
    same = True
report = {"class": type(loaded).__qualname__, "plain": type(loaded) is Net, "same": same,
          "pickle": hashlib.sha256(pickled).hexdigest(), "state": list(loaded.state_dict())}
print("result", json.dumps(report), flush=True)
"""


#: word_language_model's shape: an LSTM, whose class pickles its whole ``__dict__``.
RNN_NET = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.out = nn.LSTM(4, 3), nn.Linear(3, 1)
    def forward(self, x):
        return self.out(self.rnn(x)[0])

torch.manual_seed(0)
model = Net()
"""


@pytest.mark.skipif(
    not _compat.releases.torch_at_least(_compat.releases.WEIGHTS_ONLY_SETS),
    reason="this torch's weights-only torch.load refuses the set every nn.Module pickles (torch >= 2.6)",
)
@pytest.mark.parametrize("net", [NET, RNN_NET], ids=["linear", "lstm"])
def test_a_saved_model_is_the_file_one_process_writes_and_loads_weights_only(tmp_path, net):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    script = str(write(tmp_path / "saved.py", SAVED.replace("{net}", net)))
    one = run_python([script], cwd=tmp_path / "one", timeout=140)
    two = run_python([*COMMAND, script], cwd=tmp_path / "two", timeout=140)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr[-3000:]
    alone = json.loads(one.stdout.split("result ", 1)[1])
    ranks = _by_rank(two.stdout, "result")
    assert ranks[0] == ranks[1] == alone | {"same": True}  # loaded everywhere, still averaged after
    assert alone["plain"] and alone["class"] == "Net"
    with zipfile.ZipFile(tmp_path / "two" / "model.pt") as z:  # the file itself: one process's pickle
        pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert hashlib.sha256(pickled).hexdigest() == alone["pickle"]


SPAWNED = """
import json, torch, torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return torch.tensor([float(i * i)])

def main():
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    seen = []
    for b in DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2):  # workers spawned
        seen += [int(v) for v in b.flatten()]
        opt.zero_grad()
        model(b).sum().backward()
        opt.step()
    return {"method": mp.get_start_method(), "seen": sorted(seen)}

if __name__ == "__main__":
    mp.set_start_method("spawn")
    print("result", json.dumps(main()), flush=True)
"""

SPAWNED_IN_FUNCTION = """
import json, torch.multiprocessing as mp
import autoddp
from spawned import main

@autoddp.distributed(nproc=2)
def train():
    mp.set_start_method("spawn")  # the caller chose none: as in one process, this one is taken
    return main()

if __name__ == "__main__":
    print("result", json.dumps(train()), flush=True)
"""


def test_a_script_that_sets_the_spawn_start_method_runs_with_loader_workers(tmp_path):
    write(tmp_path / "spawned.py", SPAWNED)
    write(tmp_path / "function.py", SPAWNED_IN_FUNCTION)
    runs = [[*COMMAND, "spawned.py"], ["function.py"]]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        script, function = pool.map(lambda args: run_python(args, cwd=tmp_path, timeout=280), runs)
    squares = {i * i for i in range(16)}
    assert script.returncode == 0, script.stderr[-3000:]
    ranks = _by_rank(script.stdout, "result")
    assert ranks[0]["method"] == ranks[1]["method"] == "spawn"
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == sorted(squares)  # each rank its half
    assert function.returncode == 0, function.stderr[-3000:]
    alone = json.loads(function.stdout.split("result ", 1)[1])
    assert alone["method"] == "spawn" and len(alone["seen"]) == 8 and set(alone["seen"]) <= squares


#: A model with BatchNorm layers (autoddp hints that each process normalises its own batch).
BATCHNORM_TRAINING = """\
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
"""
BATCHNORM = (
    "import warnings\nimport torch, torch.nn as nn\n{filters}\n" + BATCHNORM_TRAINING + "print('done')\n"
)
BATCHNORM_IN_FUNCTION = (
    "import warnings\nimport torch, torch.nn as nn\nimport autoddp\n\n"
    "@autoddp.distributed(nproc=2)\ndef train():\n"
    '    warnings.simplefilter("error")\n'
    + textwrap.indent(BATCHNORM_TRAINING, "    ")
    + "    return 'done'\n\n"
    + 'if __name__ == "__main__":\n    print(train(), flush=True)\n'
)


def test_warnings_turned_into_errors_never_stop_a_run_and_are_still_shown(tmp_path):
    inside = write(tmp_path / "inside.py", BATCHNORM.format(filters='warnings.simplefilter("error")'))
    plain = write(tmp_path / "plain.py", BATCHNORM.format(filters=""))
    function = write(tmp_path / "function.py", BATCHNORM_IN_FUNCTION)
    runs = [
        ["-m", "autoddp.cli", "-n", "2", str(inside)],
        ["-W", "error", "-m", "autoddp.cli", "-n", "2", str(plain)],
        [str(function)],
    ]
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        results = list(pool.map(lambda args: run_python(args, timeout=280), runs))
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.splitlines()[-1] == "done"
        assert (
            result.stderr.count("AutoDDPWarning: autoddp: Sequential has BatchNorm layers") == 1
        )  # shown, once
