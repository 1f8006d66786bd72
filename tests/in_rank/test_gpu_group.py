"""Issue 20, the process group before the first GPU: several decorated calls in place, the
timeout and NCCL diagnostics a GPU run gets, and a gloo group that connects only when used.

One unchanged script runs under the ``autoddp`` command and under torchrun; each rank writes what
it saw to a file. The decisions (timeout, variables) are pure functions, tested with the facts.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys

import pytest
from torch.distributed import constants

from autoddp.core import _compat
from autoddp.core.backends import Backend
from autoddp.core.state import World
from autoddp.in_rank.world.process_group import group_arguments
from autoddp.launch.diagnostics import nccl_variables
from autoddp.launch.side_gloo import side_gloo_variables
from conftest import run_python, write

GPUS = Backend("cpu:gloo,cuda:nccl", use_cuda=True)

SCRIPT = """
    import glob, json, os, sys, time
    import torch, torch.distributed as dist
    import autoddp

    def sockets():  # the sockets this process holds: gloo's connections, the store's
        fds = os.listdir("/proc/self/fd")
        return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in fds if fd.isdigit()
                   and os.path.exists(f"/proc/self/fd/{fd}"))

    @autoddp.distributed
    def train(scale):
        held = [sockets()]  # the group exists: made for this call
        ready = os.path.join(sys.argv[1], f"ready-{scale}-")  # every rank counted before any connects
        open(ready + str(dist.get_rank()), "w").close()
        while len(glob.glob(ready + "*")) < dist.get_world_size():
            time.sleep(0.01)
        t = torch.tensor([float(dist.get_rank() + 1) * scale])
        dist.all_reduce(t)  # a CPU tensor: the group's gloo
        held.append(sockets())
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, dist.get_rank())  # an object collective on the group's gloo
        held.append(sockets())
        return t.item(), ranks, held

    @autoddp.distributed
    def evaluate():
        t = torch.tensor([10.0 * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    def late(call, *args):  # rank 0 arrives last, as a GPU rank still saving would
        if os.environ["RANK"] == "0":
            time.sleep(0.5)
        return call(*args)

    seen = {"first": train(1.0), "evaluate": late(evaluate), "again": late(train, 2.0)}
    seen["open_after"] = dist.is_initialized()
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as out:
        json.dump(seen, out)
"""


def _ran(tmp_path, launcher: list[str], nproc: int) -> dict[int, dict]:
    script = write(tmp_path / "three_calls.py", SCRIPT)
    result = run_python([*launcher, str(script), str(tmp_path)], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)}


@pytest.mark.parametrize(
    ("launcher", "nproc", "lazy"),
    [
        # 3 ranks, gloo lazy as a GPU run's workers get it (side_gloo): its connections come with use
        (["-m", "autoddp.cli", "-n", "3"], 3, True),
        (["-m", "torch.distributed.run", "--nproc-per-node", "2"], 2, False),
    ],
    ids=["autoddp-lazy-gloo", "torchrun"],
)
def test_three_decorated_calls_in_a_row_each_get_a_group_of_their_own(
    tmp_path, monkeypatch, launcher, nproc, lazy
):
    if lazy:
        monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", side_gloo_variables({}, gpus=8)["TORCH_GLOO_LAZY_INIT"])
    seen = _ran(tmp_path, launcher, nproc)
    total = sum(range(1, nproc + 1))
    for rank in range(nproc):
        value, ranks, held = seen[rank]["first"]
        assert (value, ranks) == (total, list(range(nproc)))
        assert seen[rank]["evaluate"] == 10.0 * total
        assert seen[rank]["again"][:2] == [2.0 * total, list(range(nproc))]
        assert seen[rank]["open_after"] is False  # each call's group ended with the call
        if lazy and _compat.releases.torch_at_least(
            _compat.releases.GLOO_LAZY_INIT
        ):  # (before: the variable is unread)
            # no connection to a peer before the first collective; made and working after it
            assert held[0] < held[1] <= held[2], held
        else:  # eager: every peer connected at init already
            assert held[0] == held[1] == held[2], held


#: Imitates a machine with two GPUs on the CPU build: torch counts them, and a worker's pinning
#: (``torch.cuda.set_device``) is recorded instead of reaching a CUDA driver that is not there.
FAKE_GPUS = """
    import os
    if os.environ.get("FAKE_GPUS"):
        import torch
        torch.backends.cuda.is_built = lambda: True
        torch.cuda.device_count = lambda: int(os.environ["FAKE_GPUS"])
        torch.cuda.set_device = lambda device: os.environ.__setitem__("PINNED", str(device))
"""

#: Each rank writes, where NCCL's flight recorder would dump it, the environment it got; rank 1
#: fails once rank 0's dump is whole (else the launcher may stop rank 0 before it has dumped).
DUMPING = """
    import json, os, time
    rank, prefix = os.environ["RANK"], os.environ["TORCH_FR_DUMP_TEMP_FILE"]
    with open(prefix + rank + ".part", "w") as dump:
        json.dump(dict(os.environ), dump)
    os.replace(prefix + rank + ".part", prefix + rank)
    if rank == "1":
        deadline = time.monotonic() + 60
        while not os.path.exists(prefix + "0") and time.monotonic() < deadline:
            time.sleep(0.01)
        raise SystemExit(3)
"""


def test_gpu_workers_get_nccl_diagnostics_and_their_dumps_outlive_the_run(tmp_path, monkeypatch):
    (tmp_path / "site").mkdir()
    write(tmp_path / "site" / "sitecustomize.py", FAKE_GPUS)
    script = write(tmp_path / "dumping.py", DUMPING)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_GPUS", "2")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the user's own: kept
    logs = tmp_path / "logs"
    result = run_python(["-m", "autoddp.cli", "-n", "2", "--log-dir", str(logs), str(script)], cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-3000:]
    assert f"NCCL's flight recorder wrote the ranks' last collectives to {logs};" in result.stderr
    assert f"torchfrtrace {logs} -p nccl_trace_rank_" in result.stderr
    for rank in range(2):
        env = json.loads((logs / f"nccl_trace_rank_{rank}").read_text())
        assert env["PINNED"] == str(rank)  # the worker was on its "GPU"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
        assert "TORCH_NCCL_DESYNC_DEBUG" not in env
        assert env["TORCH_GLOO_LAZY_INIT"] == "1"


@pytest.mark.unit
def test_a_gpu_group_waits_nccl_s_ten_minutes_unless_told_otherwise():
    world = World(rank=1, local_rank=1, world_size=2, local_world_size=2, device="cuda:1")
    arguments = group_arguments(world, GPUS, "cuda:1", None)
    # torch gives "cpu:gloo,cuda:nccl" its gloo default (30 minutes); NCCL's is 10
    assert constants.default_pg_timeout == datetime.timedelta(minutes=30)
    assert arguments["timeout"] == datetime.timedelta(minutes=10)
    assert arguments["backend"] == "cpu:gloo,cuda:nccl"
    assert str(arguments["device_id"]) == "cuda:1"
    assert (arguments["rank"], arguments["world_size"]) == (1, 2)
    given = datetime.timedelta(seconds=42)
    assert group_arguments(world, GPUS, "cuda:1", given)["timeout"] == given
    cpu = group_arguments(world, Backend("gloo", use_cuda=False), "cpu", None)
    assert cpu["timeout"] == constants.default_pg_timeout and "device_id" not in cpu


@pytest.mark.unit
def test_nccl_diagnostics_are_for_gpu_runs_and_keep_what_the_user_set():
    assert nccl_variables({}, "/run", gpus=0) == {}
    assert nccl_variables({}, "/run", gpus=2) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": "/run/nccl_trace_rank_",
    }
    users = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/mine/r",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    }
    assert nccl_variables(users, "/run", gpus=2) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


@pytest.mark.unit
def test_the_gloo_group_beside_nccl_is_lazy_unless_the_user_chose():
    assert side_gloo_variables({}, gpus=0) == {}
    assert side_gloo_variables({}, gpus=4) == {"TORCH_GLOO_LAZY_INIT": "1"}
    assert side_gloo_variables({"TORCH_GLOO_LAZY_INIT": "0"}, gpus=4) == {}


def test_calls_in_place_where_rank_0_serves_the_store_itself(tmp_path):
    """A launcher that only sets the variables (srun, mpirun, an operator): no agent store, rank 0
    hosts it. A faster rank reaching the next call must not knock on the store of rank 0's
    previous group, which goes with that group."""
    script = write(
        tmp_path / "calls.py",
        """
        import os, time, torch, autoddp, torch.distributed as dist

        @autoddp.distributed
        def step(k):
            t = torch.ones(1) * k
            dist.all_reduce(t)
            if autoddp.rank() == 0:
                time.sleep(0.5)  # rank 0 leaves its group last
            return t.item()

        print("results", step(1), step(2), step(3), flush=True)
        """,
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=tmp_path,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    try:
        outputs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
        assert "results 2.0 4.0 6.0" in out
