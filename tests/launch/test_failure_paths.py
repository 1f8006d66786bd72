"""Failure paths and promises: fast, clean, and saying what happened. Real processes throughout."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import autoddp
from autoddp import ConfigurationError
from conftest import run_python, write


def _record_worker_pid(folder: str) -> None:
    with open(os.path.join(folder, f"loader-worker-{os.getpid()}"), "w"):
        pass


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_failure_with_persistent_loader_workers_is_fast_and_leaves_nothing(tmp_path, start_method):
    @autoddp.distributed(nproc=2, start_method=start_method)
    def train(folder):
        def init(_):
            _record_worker_pid(folder)

        loader = autoddp.prepare(
            DataLoader(
                list(range(64)), batch_size=4, num_workers=2, persistent_workers=True, worker_init_fn=init
            )
        )
        for epoch in range(3):
            for step, _ in enumerate(loader):
                if autoddp.rank() == 1 and epoch == 1 and step == 2:
                    with open(os.path.join(folder, "raised-at"), "w") as handle:
                        handle.write(repr(time.time()))
                    raise ValueError("bad batch")
                autoddp.barrier()

    with pytest.raises(ValueError, match=r"bad batch\nautoddp: \[rank 1 of 2\] raised this"):
        train(str(tmp_path))
    # From the raise to the caller's exception: no wait for the loader workers' own exit checks
    # (5 s each) nor for rank 0's collective to time out. (Measured from the raise, not the start,
    # so that the imports of a loaded machine do not count.)
    assert time.time() - float((tmp_path / "raised-at").read_text()) < 3.0
    pids = [int(p.name.rsplit("-", 1)[1]) for p in tmp_path.glob("loader-worker-*")]
    assert len(pids) == 4  # two loader workers on each rank
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert [pid for pid in pids if _alive(pid)] == []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


PRINTS_ITS_RANK = """
    import sys
    import autoddp

    @autoddp.distributed(nproc=2, log_dir=sys.argv[1])
    def train():
        print(f"hello from rank {autoddp.rank()}", flush=True)

    train()
"""


def test_log_dir_keeps_every_ranks_output_the_shown_one_too(tmp_path):
    script = write(tmp_path / "train.py", PRINTS_ITS_RANK)
    logs = tmp_path / "logs"
    result = run_python([str(script), str(logs)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["hello from rank 0"]  # the console shows rank 0
    kept = sorted(p.read_text().strip() for p in logs.rglob("stdout.log"))
    assert kept == ["hello from rank 0", "hello from rank 1"]


EXITS_ON_RANK_1 = """
    import sys
    import autoddp

    @autoddp.distributed(nproc=2)
    def train():
        if autoddp.rank() == 1:
            sys.exit(3)
        autoddp.barrier()

    train()
"""

SCRIPT_EXITS_ON_RANK_1 = """
    import sys
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        sys.exit(3)
    dist.barrier()
"""


def test_sys_exit_on_one_rank_exits_with_its_code_and_says_so(tmp_path):
    decorated = run_python([str(write(tmp_path / "decorated.py", EXITS_ON_RANK_1))])
    assert decorated.returncode == 3
    assert "autoddp: rank 1 of 2 called sys.exit(3)" in decorated.stderr
    script = write(tmp_path / "script.py", SCRIPT_EXITS_ON_RANK_1)
    command = run_python(["-m", "autoddp.cli", "-n", "2", str(script)])
    assert command.returncode == 3
    assert "autoddp: rank 1 of 2 called sys.exit(3)" in command.stderr
    assert "its traceback is above" not in command.stderr


class Diverged(Exception):
    """An exception whose constructor takes more than a message."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"diverged at step {step}")
        self.step = step
        self.loss = loss


def test_exceptions_with_their_own_constructor_come_back_as_themselves():
    @autoddp.distributed(nproc=2)
    def train():
        if autoddp.rank() == 1:
            raise Diverged(7, float("inf"))
        autoddp.barrier()

    with pytest.raises(Diverged) as caught:
        train()
    assert (caught.value.step, caught.value.loss) == (7, float("inf"))
    assert caught.value.args == ("diverged at step 7",)  # as raised
    assert caught.value.__notes__[0].startswith("autoddp: [rank 1 of 2] raised this")


DIVERGES_IN_MAIN = """
    import autoddp

    class Diverged(Exception):
        def __init__(self, step, loss):
            super().__init__(f"diverged at step {step}")
            self.step, self.loss = step, loss

    @autoddp.distributed(nproc=2, start_method=START)
    def train():
        if autoddp.rank() == 1:
            raise Diverged(7, 1.5)
        autoddp.barrier()

    try:
        train()
    except Diverged as error:  # the script's own class, also when it travelled by value
        print("caught", error.step, error.loss)
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_an_exception_class_of_the_script_is_caught_as_itself(tmp_path, start_method):
    text = DIVERGES_IN_MAIN.replace("START", repr(start_method))
    result = run_python([str(write(tmp_path / "train.py", text))])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "caught 7 1.5"


WARNS = """
    import warnings
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, IterableDataset
    import autoddp

    class BN(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(2)

        def forward(self, x):
            return self.bn(x)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    class RankAware(IterableDataset):
        def __iter__(self):
            return iter(range(autoddp.rank(), 8, autoddp.world_size()))

    class OptedOut(IterableDataset):
        autoddp_sharded = True

        def __iter__(self):
            return iter(range(4))

    @autoddp.distributed(nproc=2)
    def train(passed):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autoddp.prepare(BN())  # LINE_BN
            autoddp.prepare(DataLoader(Stream()))  # LINE_STREAM
            autoddp.prepare(DataLoader(RankAware()))
            autoddp.prepare(DataLoader(OptedOut()))
        return [(w.filename, w.lineno, str(w.message)[:40]) for w in caught]

    print(train(BN()))
"""


def test_warnings_point_at_the_users_line_and_rank_aware_datasets_stay_quiet(tmp_path):
    script = write(tmp_path / "train.py", WARNS)
    lines = script.read_text().splitlines()
    bn_line = next(i for i, line in enumerate(lines, 1) if "LINE_BN" in line)
    stream_line = next(i for i, line in enumerate(lines, 1) if "LINE_STREAM" in line)
    result = run_python([str(script)])
    assert result.returncode == 0, result.stderr
    warned = eval(result.stdout.strip().splitlines()[-1])
    assert [(os.path.basename(f), n) for f, n, _ in warned] == [
        ("train.py", bn_line),
        ("train.py", stream_line),
    ]
    assert warned[0][2].startswith("autoddp: BN has") and "cannot shard a DataLoader" in warned[1][2]
    # the BatchNorm hint for the argument (prepared before the function runs) names the function
    decorated = next(i for i, line in enumerate(lines, 1) if line.strip().startswith("def train(")) - 1
    assert f"train.py:{decorated}: AutoDDPWarning: autoddp: BN has BatchNorm layers" in result.stderr
    assert "sys:1" not in result.stderr and "autoddp/" not in result.stderr


class _Counted(IterableDataset):
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def __iter__(self):
        return iter(range(4))


@pytest.mark.unit
def test_a_dataset_holding_the_world_size_counts_as_sharding_itself():
    from autoddp.in_rank.data.loaders import shards_itself

    assert shards_itself(_Counted(2))
    assert not shards_itself(type("Plain", (IterableDataset,), {"__iter__": lambda self: iter(())})())


@pytest.mark.unit
@pytest.mark.parametrize(
    "options, message",
    [
        ({"ranks": "x"}, "comma-separated local ranks"),
        ({"ranks": "5", "nproc": 2}, r"outside 0..1"),
        ({"ranks": 0}, "use '0', 'all'"),
        ({"log_dir": 5}, "not a folder path"),
    ],
)
def test_output_options_are_checked_when_decorating(options, message):
    with pytest.raises(ConfigurationError, match=message):
        autoddp.distributed(**options)


def test_a_large_tensor_result_travels_intact():
    @autoddp.distributed(nproc=2, start_method="spawn")
    def make():
        return {"big": torch.arange(16 * 2**20, dtype=torch.float32), "rank": autoddp.rank()}

    out = make()
    assert out["rank"] == 0 and torch.equal(out["big"], torch.arange(16 * 2**20, dtype=torch.float32))


@pytest.mark.unit
def test_an_unknown_option_names_the_closest_one():
    with pytest.raises(ConfigurationError, match=r"no option 'nprocs'; did you mean nproc=\?"):
        autoddp.distributed(nprocs=2)


@pytest.mark.unit
@pytest.mark.parametrize(
    "message",
    [
        "[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms for send operation to complete",
        "Application timeout caused pair closure",  # another wait of the rank whose wait ran out
    ],
)
def test_both_of_gloos_words_for_a_timeout_are_triaged_as_a_timeout(message):
    """Which of the two a rank raises depends on which of its waits ran out first (seen in CI):
    both must lead to "rank(s) N had not arrived", not to a failure of the waiting rank."""
    from autoddp.in_rank.run_folder.transport import ErrorReport

    report = ErrorReport(
        rank=0, time=0.0, type_name="RuntimeError", message=message, traceback="", pickled=None
    )
    assert report.is_timeout and not report.is_consequence
