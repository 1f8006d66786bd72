"""@distributed in a live interpreter: real 2-process gloo worlds, nothing mocked."""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from helpers import gather

import autoddp
from autoddp import ConfigurationError, SerializationError, WorkerError
from conftest import run_python

pytestmark = pytest.mark.smoke  # CI runs these on the lowest and the newest torch too (-m smoke)

METHODS = [pytest.param("fork", marks=pytest.mark.forks_here), "spawn"]


class CustomError(Exception):
    pass


def _report(tag):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "tag": tag,
        "rank": autoddp.rank(),
        "world": autoddp.world_size(),
        "sum": t,
        "pid": os.getpid(),
        "env": {
            k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        },
        "ranks": gather(autoddp.rank()),
    }


@pytest.mark.parametrize("method", METHODS)
def test_rank0_result_reaches_the_caller(method):
    @autoddp.distributed(nproc=2, start_method=method)
    def train(tag, *, scale):
        return _report(tag) | {"scaled": torch.ones(2, requires_grad=True) * scale}

    out = train("hello", scale=3)
    assert out["tag"] == "hello"
    assert out["rank"] == 0 and out["world"] == 2
    assert out["ranks"] == [0, 1]
    assert out["sum"].item() == 3.0  # 1 + 2: both ranks took part
    assert out["pid"] != os.getpid()
    assert out["env"] == {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert torch.equal(out["scaled"], torch.full((2,), 3.0))
    assert not out["scaled"].requires_grad


def test_worker_environment_and_threads():
    @autoddp.distributed(nproc=2)
    def probe():
        return gather(
            (
                os.environ["MASTER_PORT"],
                os.environ.get("OMP_NUM_THREADS"),
                torch.get_num_threads(),
                str(autoddp.device()),
            )
        )

    seen = probe()
    ports = {s[0] for s in seen}
    assert len(ports) == 1 and int(ports.pop()) > 0
    expected = os.environ.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert all(s[1] == expected and s[2] == int(expected) and s[3] == "cpu" for s in seen)


def test_closure_and_bare_decorator():
    factor = 7

    @autoddp.distributed
    def single():
        return os.getpid(), autoddp.world_size() * factor

    # Bare decorator, no GPU: one process, run in place with no launch.
    assert single() == (os.getpid(), 7)

    @autoddp.distributed(nproc=2, start_method="spawn")
    def closure():
        return autoddp.world_size() * factor

    assert closure() == 14


@pytest.mark.unit
def test_signature_and_docstring_are_kept():
    def train(model, lr: float = 0.1, *, epochs: int = 3) -> float:
        """Train it."""
        return lr

    wrapped = autoddp.distributed(nproc=2)(train)
    assert inspect.signature(wrapped) == inspect.signature(train)
    assert wrapped.__doc__ == "Train it."
    assert wrapped.__name__ == "train"


@pytest.mark.unit
def test_single_process_runs_in_place_unchanged():
    marker = object()

    @autoddp.distributed(nproc=1)
    def train(x):
        return x, os.getpid(), dist.is_initialized()

    assert train(marker) == (marker, os.getpid(), False)


@pytest.mark.parametrize("method", METHODS)
def test_exception_on_one_rank_is_reraised_with_its_type_and_rank(method):
    @autoddp.distributed(nproc=2, start_method=method)
    def train():
        if autoddp.rank() == 1:
            raise CustomError("bad batch")
        dist.barrier()  # rank 0 waits in a collective that rank 1 never joins

    start = time.monotonic()
    with pytest.raises(CustomError, match=r"bad batch\nautoddp: \[rank 1 of 2\] raised this") as info:
        train()
    assert time.monotonic() - start < 20
    assert info.value.autoddp_rank == 1 and info.value.args == ("bad batch",)  # as raised
    assert "raise CustomError" in str(info.value.__cause__)  # the worker's own traceback


def test_builtin_exception_type():
    @autoddp.distributed(nproc=2)
    def train():
        if autoddp.rank() == 1:
            raise ValueError("only rank 1")
        t = torch.zeros(1)
        dist.all_reduce(t)

    with pytest.raises(ValueError, match="rank 1"):
        train()


@pytest.mark.parametrize("method", METHODS)
def test_worker_exit_without_exception_is_a_worker_error(method):
    @autoddp.distributed(nproc=2, start_method=method)
    def train():
        if autoddp.rank() == 1:
            os._exit(3)
        dist.barrier()

    with pytest.raises(WorkerError, match="rank 1 .*exited with code 3") as info:
        train()
    assert info.value.rank == 1 and info.value.exitcode == 3


def test_killed_worker_is_a_worker_error_naming_the_signal():
    @autoddp.distributed(nproc=2)
    def train():
        if autoddp.rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    with pytest.raises(WorkerError, match="rank 0 .*SIGKILL") as info:
        train()
    assert info.value.signal == "SIGKILL"


def test_nested_decorated_call_runs_in_place():
    @autoddp.distributed(nproc=2)
    def inner():
        return os.getpid(), autoddp.rank(), autoddp.world_size()

    @autoddp.distributed(nproc=2)
    def outer():
        return os.getpid(), inner()

    outer_pid, (inner_pid, rank, world) = outer()
    assert outer_pid == inner_pid and (rank, world) == (0, 2)


def test_a_nested_call_in_place_keeps_the_outer_calls_sample_order():
    # The nested call used to wipe the outer call's seeds: a loader made after it shuffled in
    # another order than one made without the nested call (a silently different run).
    @autoddp.distributed(nproc=2)
    def inner():
        return autoddp.rank()

    def order(nested: bool):
        if nested:
            inner()
        loader = autoddp.prepare(torch.utils.data.DataLoader(torch.arange(16), batch_size=4, shuffle=True))
        return [int(i) for batch in loader for i in batch]

    @autoddp.distributed(nproc=2)
    def outer(nested):
        return order(nested)

    torch.manual_seed(3)
    plain = outer(False)
    torch.manual_seed(3)
    assert outer(True) == plain


@pytest.mark.unit
@pytest.mark.parametrize(
    "options, message",
    [
        ({"nproc": 0}, "nproc=0"),
        ({"nproc": -1}, "nproc=-1"),
        ({"nproc": "2"}, "nproc='2'"),
        ({"nproc": 1.5}, "nproc=1.5"),
        ({"backend": "mpi2"}, "unknown backend"),
        ({"start_method": "forkserver"}, "unknown start_method"),
        ({"timeout": -3}, "timeout=-3"),
    ],
)
def test_bad_options_fail_at_decoration(options, message):
    with pytest.raises(ConfigurationError, match=message):
        autoddp.distributed(**options)


@pytest.mark.unit
def test_generators_and_coroutines_are_refused_at_decoration():
    def gen():
        yield 1

    async def coro():
        return 1

    with pytest.raises(ConfigurationError, match="generator"):
        autoddp.distributed(gen)
    with pytest.raises(ConfigurationError, match="async"):
        autoddp.distributed(nproc=2)(coro)


@pytest.mark.unit
def test_nccl_without_gpu_is_a_clear_error():
    @autoddp.distributed(nproc=2, backend="nccl")
    def train():
        pass

    with pytest.raises(ConfigurationError, match="needs CUDA GPUs"):
        train()


def test_unpicklable_argument_is_named():
    @autoddp.distributed(nproc=2, start_method="spawn")
    def train(data, lock):
        pass

    with pytest.raises(SerializationError, match="argument 'lock'"):
        train([1, 2], lock=threading.Lock())


@pytest.mark.forks_here
def test_unpicklable_argument_works_with_fork():
    lock = threading.Lock()

    @autoddp.distributed(nproc=2, start_method="fork")
    def train(lock):
        return type(lock).__name__

    assert train(lock) == "lock"


def test_unpicklable_return_value_is_a_clear_error():
    @autoddp.distributed(nproc=2)
    def train():
        return threading.Lock()

    with pytest.raises(SerializationError, match="return value of .*train"):
        train()


@pytest.mark.unit
def test_half_launched_environment_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "1")

    @autoddp.distributed(nproc=2)
    def train():
        pass

    with pytest.raises(ConfigurationError, match="RANK is set but WORLD_SIZE is not"):
        train()


@pytest.mark.unit
def test_helpers_outside_workers():
    assert autoddp.rank() == 0
    assert autoddp.local_rank() == 0
    assert autoddp.world_size() == 1
    assert autoddp.is_main()
    assert autoddp.device() == torch.device("cpu")
    autoddp.barrier()  # no process group: returns at once


def test_decorated_method():
    class Trainer:
        def __init__(self, base):
            self.base = base

        @autoddp.distributed(nproc=2)
        def fit(self, extra):
            return self.base + extra + autoddp.world_size()

    assert Trainer(10).fit(5) == 17


def test_works_while_stdout_is_captured():
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):  # no real file behind sys.stdout (capsys, notebooks)

        @autoddp.distributed(nproc=2)
        def train():
            return autoddp.world_size()

        assert train() == 2


AFTER_COMPILE_AND_BACKWARD = """
import torch
import torch.distributed as dist
import autoddp
from torch._dynamo.testing import CompileCounter

# a notebook's earlier cells: a compiled layer, then training in this process. On a CUDA build of
# torch this starts autograd's device threads, and torch refuses every backward in a later fork.
torch.compile(torch.nn.Linear(3, 2), backend=CompileCounter())(torch.randn(4, 3))
model = torch.nn.Linear(2, 1)
model(torch.ones(3, 2)).sum().backward()

@autoddp.distributed(nproc=2)
def train():
    layer = torch.nn.Linear(2, 1)
    layer(torch.ones(3, 2)).sum().backward()
    grad = layer.weight.grad.clone()
    dist.all_reduce(grad)
    return grad.tolist()

print(train())
"""


def test_a_call_after_training_in_this_process_runs_whatever_autograd_started(tmp_path):
    """Fork where a forked backward works; where torch forbids it, fresh interpreters, not a
    RuntimeError from every rank's first backward."""
    script = tmp_path / "after.py"
    script.write_text(AFTER_COMPILE_AND_BACKWARD)
    done = run_python([str(script)], timeout=150)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[[6.0, 6.0]]"
