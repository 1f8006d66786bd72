"""Captured saves and what comes back: complete files on every rank, plain pickles, the caller's
own classes, and a clear word when ranks run out of batches at different times.

Real 2-process gloo runs of unchanged code, the decorator and the command alike.
"""

from __future__ import annotations

import os
import pickletools
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoddp
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
import pytest
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


# --- item 2: a captured torch.save returns on every rank once the file is complete --------------

SAVE_THEN_LOAD = """
    import os, sys, torch, torch.distributed as dist
    from torch import nn
    folder, kind = sys.argv[1], sys.argv[2]
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = os.path.join(folder, "state.pt")
    stale = 0
    for i in range(20):  # every rank saves, reads the file back, trains a step
        state = {"i": i, "w": torch.full((20000,), float(i))}
        if kind == "path":
            torch.save(state, path)
        else:  # a file object every rank opened on the same path
            with open(path, "wb") as f:
                torch.save(state, f)
        back = torch.load(path)
        stale += back["i"] != i or not bool((back["w"] == i).all())
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    print("STALE", dist.get_rank(), stale, flush=True)
"""


def _stale_loads(tmp_path, kind: str) -> list[list[str]]:
    script = write(tmp_path / "reload.py", SAVE_THEN_LOAD)
    command = ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script), str(tmp_path), kind]
    ran = run_python(command)
    assert ran.returncode == 0, ran.stderr
    assert sorted(os.listdir(tmp_path)) == ["reload.py", "state.pt"]  # no temporary file left
    return sorted(line.split("STALE", 1)[1].split() for line in ran.stdout.splitlines() if "STALE" in line)


def test_the_command_returns_every_save_once_the_file_is_complete(tmp_path):
    assert _stale_loads(tmp_path, "path") == [["0", "0"], ["1", "0"]]  # 19 of 20 stale before


@autoddp.distributed(nproc=2)
def _restore_best_then_fine_tune(folder: str):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    stale = 0
    for _ in range(10):
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.save(model.state_dict(), os.path.join(folder, "best.pt"))  # every epoch: repeated saves
        stale += int(not torch.equal(torch.load(os.path.join(folder, "best.pt"))["weight"], model.weight))
    model.load_state_dict(torch.load(os.path.join(folder, "best.pt")))  # restore, then fine-tune
    for _ in range(3):
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    everyone = [None, None]
    dist.all_gather_object(everyone, (stale, model.weight.detach().clone()))
    return everyone


def test_the_decorator_returns_every_save_once_the_file_is_complete(tmp_path):
    (stale0, w0), (stale1, w1) = _restore_best_then_fine_tune(str(tmp_path))
    assert (stale0, stale1) == (0, 0)
    torch.testing.assert_close(w0, w1, rtol=1e-5, atol=1e-5)  # the replicas stay equal


RANK_DEPENDENT_WHILE_TRAINING = """
    import torch, torch.distributed as dist
    from torch import nn
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(4):
        loss = model(torch.ones(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # DDP's all-reduce: rank 0 waits here while rank 1 saves
        opt.step()
        if epoch == 0 or dist.get_rank() == 1:  # rank 1 alone saves after epoch 0
            torch.save({"epoch": epoch, "rank": dist.get_rank()}, "best.pt")
    print("done", dist.get_rank(), flush=True)
"""


def test_a_rank_dependent_save_while_training_keeps_rank0s_file_promptly(tmp_path):
    script = write(tmp_path / "best.py", RANK_DEPENDENT_WHILE_TRAINING)
    start = time.monotonic()
    ran = run_python(["-m", "autoddp.cli", "-n", "2", str(script)], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert time.monotonic() - start < 20  # rank 1 sees rank 0 has gone on: no long wait, no deadlock
    assert torch.load(tmp_path / "best.pt") == {"epoch": 0, "rank": 0}


def test_a_file_object_every_rank_opened_is_written_once_and_complete(tmp_path):
    assert _stale_loads(tmp_path, "file") == [["0", "0"], ["1", "0"]]  # torn or stale before


@autoddp.distributed(nproc=2)
def _rank0_only_file_saves(folder: str):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        model(torch.ones(2, 4)).sum().backward()  # rank 1 waits for rank 0 here
        opt.step()
        if dist.get_rank() == 0:  # as written: nobody else opens the file
            with open(os.path.join(folder, "last.pt"), "wb") as f:
                torch.save({"epoch": epoch}, f)
    return torch.load(os.path.join(folder, "last.pt")) if dist.get_rank() == 0 else None


def test_a_rank0_only_file_object_save_does_not_wait_long(tmp_path):
    start = time.monotonic()
    assert _rank0_only_file_saves(str(tmp_path)) == {"epoch": 2}
    assert time.monotonic() - start < 15  # rank 0 sees rank 1 has gone on, at each save


# --- item 9: what comes back is an instance of the caller's own classes --------------------------

RETURNS_OWN_CLASSES = """
    import dataclasses, io, pickle, sys, torch, autoddp
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 1)

        def forward(self, x):
            return self.layer(x)

    @dataclasses.dataclass
    class Summary:
        loss: float
        net: Net

    @autoddp.distributed(nproc=2, start_method=sys.argv[1])
    def train():
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net(torch.ones(2, 3)).sum().backward()
        opt.step()
        return net, Summary(1.5, net)

    net, summary = train()
    print("CLASSES", type(net) is Net, type(summary) is Summary, type(summary.net) is Net, summary.net is net)
    pickle.loads(pickle.dumps(net))
    torch.save(net, io.BytesIO())
    print("PICKLED", isinstance(pickle.loads(pickle.dumps(summary)), Summary))
"""


def test_the_caller_gets_instances_of_its_own_script_classes(tmp_path):
    script = write(tmp_path / "own.py", RETURNS_OWN_CLASSES)
    for start_method in ("fork", "spawn"):
        ran = run_python([str(script), start_method])
        assert ran.returncode == 0, (start_method, ran.stderr)
        assert "CLASSES True True True True" in ran.stdout, (start_method, ran.stdout)
        assert "PICKLED True" in ran.stdout, (start_method, ran.stdout)


# --- item 15: a rank that runs out of batches first is named -------------------------------------

UNEVEN = """
    import os, torch
    from torch import nn
    from torch.utils.data import DataLoader, IterableDataset


    class Shard(IterableDataset):  # the user's own sharding: rank 0 has 10 samples, rank 1 has 12
        def __iter__(self):
            for i in range(10 if os.environ["RANK"] == "0" else 12):
                yield torch.full((4,), float(i))


    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x in DataLoader(Shard(), batch_size=2):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
"""

EARLY = "rank 0 finished its DataLoader ({}) after 5 batches while rank 1 went on to batch 6: every rank"


def test_the_command_names_the_rank_that_ran_out_of_batches_first(tmp_path):
    script = write(tmp_path / "uneven.py", UNEVEN)
    start = time.monotonic()
    ran = run_python(["-m", "autoddp.cli", "-n", "2", str(script)])
    assert ran.returncode == 1 and time.monotonic() - start < 30  # promptly, no timeout-long hang
    last = ran.stderr.strip().splitlines()[-1]
    assert last.startswith("autoddp: UnevenBatchesError: " + EARLY.format("uneven.py:15")), last
    assert "shard the iterabledataset evenly" in last.lower()


class _Shard(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(10 if os.environ["RANK"] == "0" else 12):
            yield torch.full((4,), float(i))


@autoddp.distributed(nproc=2)
def _train_on_uneven_shards():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):  # the second pass is uneven too; the first is named
        for x in torch.utils.data.DataLoader(_Shard(), batch_size=2):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_the_decorator_names_the_rank_that_ran_out_of_batches_first():
    from autoddp.core.errors import UnevenBatchesError

    line = _train_on_uneven_shards.__wrapped__.__code__.co_firstlineno + 5  # (from the decorator's line)
    start = time.monotonic()
    with pytest.raises(UnevenBatchesError) as raised:
        _train_on_uneven_shards()
    assert time.monotonic() - start < 30
    assert str(raised.value).startswith(EARLY.format(f"test_capture_saves.py:{line}"))
    # gloo's error, kept as the cause (closed or reset, as the peer's exit and the read race)
    assert re.search(r"Connection (closed|reset) by peer", str(raised.value.__cause__))
