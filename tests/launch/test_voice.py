"""What autoddp says, and how: its warnings are its own category and name it, the notice has one
line per object, an exception keeps its ``args`` and shows its rank, and training in processes the
script starts itself is named.

Real 2-process gloo runs of unchanged scripts under the command or the decorator.
"""

from __future__ import annotations

import builtins
import errno
import sys
import traceback

import pytest

import autoddp
from conftest import run_python, write

#: A summed loss warns (at the backward); two models of one class and two loaders are made at one line.
TWO_OF_A_KIND = """
import sys, warnings
import torch, torch.nn as nn
import autoddp
if sys.argv[1] == "ignore":
    warnings.filterwarnings("ignore", category=autoddp.AutoDDPWarning)
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
g, d = nn.Linear(4, 1), nn.Linear(4, 1)
a, b = (torch.utils.data.DataLoader(data, batch_size=4, shuffle=True) for _ in range(2))
opt = torch.optim.SGD([*g.parameters(), *d.parameters()], lr=0.1)
for loader in (a, b):
    for x, y in loader:
        opt.zero_grad()
        ((g(x) - y) ** 2 + (d(x) - y) ** 2).sum().backward()
        opt.step()
print("done")
"""


def test_autoddps_warnings_are_its_own_category_and_one_notice_line_per_object(tmp_path):
    script = str(write(tmp_path / "two.py", TWO_OF_A_KIND))
    shown = run_python(["-m", "autoddp.cli", "-n", "2", script, "show"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "two.py:15: AutoDDPWarning: autoddp: this loss is summed over the batch" in shown.stderr
    assert "UserWarning" not in shown.stderr
    model = "Linear (two.py:9): DDP across 2 processes, found through the optimizer at two.py:11"
    lines = [line for line in shown.stderr.splitlines() if line.startswith(f"autoddp:   {model}")]
    assert len(lines) == 2 and lines[1].endswith(" (a 2nd one)"), shown.stderr  # (after auto's why)
    loader = "autoddp:   DataLoader (two.py:10): sharded"
    assert shown.stderr.count(loader) == 2, shown.stderr  # each loader its own line
    ignored = run_python(["-m", "autoddp.cli", "-n", "2", script, "ignore"], cwd=tmp_path)
    assert ignored.returncode == 0, ignored.stderr
    assert ignored.stdout == shown.stdout == "done\n"
    assert "Warning" not in ignored.stderr and "this loss is summed" not in ignored.stderr
    assert ignored.stderr.count(model) == 2  # the notice is not a warning: it stays


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_the_filter_silences_a_decorated_functions_warnings_on_every_rank(tmp_path, start_method):
    script = write(
        tmp_path / "deco.py",
        f"""
        import sys, warnings
        import torch.nn as nn
        import autoddp
        if sys.argv[1] == "ignore":
            warnings.filterwarnings("ignore", category=autoddp.AutoDDPWarning)

        @autoddp.distributed(nproc=2, ranks="all", start_method="{start_method}")
        def train(model):
            return autoddp.rank()

        if __name__ == "__main__":
            print(train(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))))
        """,
    )
    for said in ("ignore", "show"):
        result = run_python([str(script), said], cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().splitlines()[-1] == "0"
        hint = "deco.py:8: AutoDDPWarning: autoddp: Sequential has BatchNorm layers"
        assert result.stderr.count(hint) == (0 if said == "ignore" else 1), result.stderr  # (rank 0 says it)


def _raise(kind: str) -> None:
    """Rank 1 raises ``kind``; rank 0 waits for it in a collective."""
    if autoddp.rank() == 1:
        if kind == "KeyError":
            raise KeyError("lr")
        if kind == "OSError":
            raise OSError(errno.EACCES, "Permission denied", "/data/shard-1.pt")
        raise builtins.ExceptionGroup("two loaders failed", [ValueError("a"), KeyError("b")])
    autoddp.barrier()


@pytest.mark.parametrize(
    "kind",
    [
        "KeyError",
        "OSError",
        pytest.param("ExceptionGroup", marks=pytest.mark.skipif(sys.version_info < (3, 11), reason="3.11+")),
    ],
)
def test_an_exception_keeps_its_args_as_raised_and_shows_its_rank(kind):
    with pytest.raises(BaseException) as caught:
        autoddp.distributed(nproc=2)(_raise)(kind)
    error = caught.value
    shown = "".join(traceback.format_exception(error))
    assert "[rank 1 of 2]" in shown, shown
    if kind == "KeyError":
        assert type(error) is KeyError and error.args == ("lr",)
    elif kind == "OSError":
        assert type(error) is PermissionError and error.args == (errno.EACCES, "Permission denied")
        assert (error.errno, error.strerror, error.filename) == (*error.args, "/data/shard-1.pt")
    else:
        assert type(error) is builtins.ExceptionGroup and error.args[0] == "two loaders failed"
        assert [(type(e), e.args) for e in error.exceptions] == [(ValueError, ("a",)), (KeyError, ("b",))]
    if sys.version_info >= (3, 11):  # (3.10 shows no notes: the rank is in the worker's traceback)
        assert error.__notes__[0].startswith("autoddp: [rank 1 of 2] raised this"), error.__notes__


#: pytorch/examples' mnist_hogwild, in small: the model in shared memory, trained in processes the
#: script starts itself, then tested in the process autoddp started.
HOGWILD = """
import torch, torch.nn as nn, torch.nn.functional as F
import torch.multiprocessing as mp


def train(rank, model):
    torch.manual_seed(1 + rank)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


if __name__ == "__main__":
    mp.set_start_method("METHOD", force=True)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model.share_memory()
    processes = []
    for rank in range(2):
        p = mp.Process(target=train, args=(rank, model))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    torch.save(model.state_dict(), "hogwild.pt")
    print("trained")
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_training_in_processes_the_script_starts_itself_is_said(tmp_path, method):
    script = write(tmp_path / "hog.py", HOGWILD.replace("METHOD", method))
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script)], cwd=tmp_path, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "trained\n"  # (under fork, no DDP in the children: nothing hangs)
    said = (
        "autoddp:   not distributed: the weights of the Linear given to the process started at hog.py:25 "
        "(target train) changed there: training ran in processes the script started itself. autoddp "
        "did not distribute it: each of the 2 ranks ran it whole, 2 copies of the work for one "
        "process's result"
    )
    assert result.stderr.count(said) == 1, result.stderr
    assert "Run such a script with plain python" in result.stderr
    notice = result.stderr.split("autoddp: capture:")[1]
    assert notice.index(said) < notice.index("torch.save('hogwild.pt')")  # said at the join, first


@pytest.mark.unit
def test_a_line_is_said_again_for_another_live_object_only():
    from autoddp.in_rank.capture._notice import Notice

    class Loader:  # (any object that takes a weak reference)
        pass

    notice = Notice(rank=1, world_size=2)  # (rank 1 writes nothing: only what it would say is kept)
    for _ in range(3):  # made anew each epoch, the earlier one gone: one line
        notice.say(("loader", object()), "DataLoader (t.py:3): sharded", subject=Loader())
    assert len(notice.lines["DataLoader (t.py:3): sharded"]) == 1
    kept = [Loader(), Loader()]  # two alive at once: a line each
    for loader in kept:
        notice.say(("loader", id(loader)), "DataLoader (t.py:4): sharded", subject=loader)
    notice.say(("loader", "again"), "DataLoader (t.py:4): sharded", subject=kept[0])  # the same one
    assert len(notice.lines["DataLoader (t.py:4): sharded"]) == 2
