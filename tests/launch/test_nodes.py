"""Several machines, simulated by two launchers on loopback forming one world (elastic rendezvous)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import free_port, speaking

from autoddp import ConfigurationError
from autoddp.launch import plan as nodes
from conftest import GLOO_TIMEOUT, LAUNCHER_NAMES, LAUNCHER_PREFIXES, run_python, write


def _both(commands, env=None):
    pipe = subprocess.PIPE
    procs = [subprocess.Popen(c, stdout=pipe, stderr=pipe, text=True, env=env) for c in commands]
    return [(p, *p.communicate(timeout=120)) for p in procs]


def test_two_command_launchers_form_one_world(tmp_path, monkeypatch):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    script = write(
        tmp_path / "job.py",
        """
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        barrier = os.environ.get("TORCH_DIST_INIT_BARRIER")
        sys.stdout.write(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item()} {barrier}\\n")
        """,
    )
    master = f"127.0.0.1:{free_port()}"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    results = _both(
        [
            [
                sys.executable,
                "-m",
                "autoddp.cli",
                "--nnodes",
                "2",
                "--node-rank",
                str(r),
                "--master",
                master,
                "-n",
                "1",
                str(script),
            ]
            for r in (0, 1)
        ],
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )
    lines = sorted(out.strip() for _, out, _ in results)
    assert all(p.returncode == 0 for p, _, _ in results), [e for _, _, e in results]
    assert lines == ["rank=0 world=2 sum=3.0 1", "rank=1 world=2 sum=3.0 1"]  # torch's init barrier: on
    for node, (_, _, err) in enumerate(results):  # the start-up line: where, and which interface
        assert f"autoddp: node {node} of 2, 1 worker(s) here, static rendezvous at {master}" in err
        assert "network interface lo (127.0.0.1), the one that routes to 127.0.0.1" in err
    # no folder stays behind: elastic's log folder was one of the run's (torch's own is never removed)
    assert not [n for n in os.listdir(tmpdir) if n.startswith(("autoddp-", "torchelastic_"))]


def test_decorated_function_on_two_nodes_returns_rank0_value_on_node0(tmp_path):
    script = write(
        tmp_path / "job.py",
        """
        import sys, torch, torch.distributed as dist, autoddp

        @autoddp.distributed(nproc=1, nnodes=2, node_rank=int(sys.argv[1]), master=sys.argv[2])
        def train():
            t = torch.ones(1) * (autoddp.rank() + 1)
            dist.all_reduce(t)
            return autoddp.rank(), autoddp.world_size(), t.item()

        sys.stdout.write(f"node {sys.argv[1]}: {train()}\\n")
        """,
    )
    master = f"127.0.0.1:{free_port()}"
    results = _both([[sys.executable, str(script), str(r), master] for r in (0, 1)])
    assert all(p.returncode == 0 for p, _, _ in results), [e for _, _, e in results]
    assert [out.strip() for _, out, _ in results] == ["node 0: (0, 2, 3.0)", "node 1: None"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nnodes": 2}, "needs the address of node 0"),
        ({"nnodes": 2, "master": "host:1", "node_rank": 2}, "node rank from 0 to 1"),
        ({"nnodes": "1:4", "master": "host:1", "node_rank": 0}, "needs the c10d rendezvous"),
        ({"nnodes": 2, "master": "nohostport", "node_rank": 0}, "is not HOST:PORT"),
        ({"nnodes": "x"}, "not a number of machines"),
        ({"node_rank": 1}, "needs nnodes > 1"),
    ],
)
def test_bad_multi_node_options_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        nodes.plan(**kwargs)


@pytest.mark.unit
def test_the_join_timeout_is_one_setting():
    base = {"nnodes": 2, "node_rank": 0, "master": "host:1"}
    assert nodes.plan(**base).join_timeout == nodes.DEFAULT_JOIN_TIMEOUT < 15 * 60
    assert nodes.plan(**base, join_timeout=30).join_timeout == 30
    given = nodes.plan(**base, rdzv_conf="join_timeout=40,read_timeout=9")
    assert (given.join_timeout, given.conf) == (40, (("read_timeout", "9"),))
    with pytest.raises(ConfigurationError, match="give the join timeout once"):
        nodes.plan(**base, rdzv_conf="join_timeout=40", join_timeout=30)
    for bad in (0, -1, "soon", True):
        with pytest.raises(ConfigurationError, match="must be a number of seconds > 0"):
            nodes.plan(**base, join_timeout=bad)


@pytest.mark.unit
def test_elastic_range_uses_c10d():
    plan = nodes.plan("1:4", rdzv_endpoint="host:29400", rdzv_id="job7")
    assert (plan.min_nodes, plan.max_nodes, plan.backend, plan.run_id) == (1, 4, "c10d", "job7")


#: Rank 3 (node 1's second) never reaches the all-reduce: everyone else times out waiting for it.
LATE = """
import sys, time, torch, torch.distributed as dist, autoddp

@autoddp.distributed(nproc=2, nnodes=2, node_rank=int(sys.argv[1]), master=sys.argv[2], timeout=3)
def train():
    dist.barrier()
    if autoddp.rank() == 3:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))

try:
    train()
except Exception as error:
    sys.stdout.write(f"{type(error).__name__}: {error}\\n" + "\\n".join(error.__notes__) + "\\n")
"""


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two two-node runs on loopback at once (2 workers a node), each launcher's (status, out, err).

    ``output``: the command, node 0 with ``--ranks all --log-dir D``, node 1 with ``--log-dir D``
    (the default ``--ranks 0``); ``late``: a decorated function whose rank 3 never arrives.
    """
    folder = tmp_path_factory.mktemp("nodes")
    env = {
        n: v for n, v in os.environ.items() if not n.startswith(LAUNCHER_PREFIXES) and n not in LAUNCHER_NAMES
    }
    env = {n: v for n, v in env.items() if n not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    (speaks, _), late, logs = speaking(folder), write(folder / "late.py", LATE), folder / "D"
    command = [sys.executable, "-m", "autoddp.cli", "--nnodes", "2", "-n", "2", "--log-dir", str(logs)]
    master, other = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    commands = {
        ("output", 0): [*command, "--node-rank", "0", "--master", master, "--ranks", "all", str(speaks)],
        ("output", 1): [*command, "--node-rank", "1", "--master", master, str(speaks)],
        ("late", 0): [sys.executable, str(late), "0", other],
        ("late", 1): [sys.executable, str(late), "1", other],
    }
    pipe = subprocess.PIPE
    started = {
        k: subprocess.Popen(c, stdout=pipe, stderr=pipe, text=True, env=env) for k, c in commands.items()
    }
    try:
        runs = {key: (p, *p.communicate(timeout=120)) for key, p in started.items()}
    finally:
        for p in started.values():  # (their workers die with them)
            p.kill()
            p.communicate()
    return {key: (p.returncode, out, err) for key, (p, out, err) in runs.items()}, logs


@pytest.mark.timeout(150)
def test_ranks_and_log_dir_mean_on_two_nodes_what_they_mean_on_one(two_runs):
    runs, logs = two_runs
    (code0, out0, err0), (code1, out1, err1) = runs["output", 0], runs["output", 1]
    assert code0 == code1 == 0, err0 + err1
    # --ranks all: every local rank's lines, prefixed with its global rank
    assert sorted(out0.splitlines()) == ["[rank 0] out of rank 0", "[rank 1] out of rank 1"]
    assert "[rank 0] err of rank 0" in err0 and "[rank 1] err of rank 1" in err0
    # --ranks 0 on node 1: its local rank 0 (global rank 2), as written, and no other
    assert out1.splitlines() == ["out of rank 2"]
    assert "err of rank 2" in err1 and "rank 3" not in err1
    # every rank's files, in a folder named by its global rank: the two nodes share D
    for rank in range(4):
        for stream in ("out", "err"):
            (found,) = logs.glob(f"*/attempt_0/{rank}/std{stream}.log")
            assert f"{stream} of rank {rank}" in found.read_text().splitlines()


@pytest.mark.unit
@pytest.mark.timeout(150)
def test_a_timeout_on_two_nodes_is_triaged_as_on_one(two_runs):
    runs, _ = two_runs
    (code0, out0, err0), (code1, out1, err1) = runs["late", 0], runs["late", 1]
    assert code0 == code1 == 0, err0 + err1
    # node 1: its rank 2 timed out waiting; rank 3 had not arrived, and where it was is shown
    assert out1.startswith("RuntimeError: ") and GLOO_TIMEOUT.search(out1), out1
    assert "\nautoddp: [rank 2 of 4] raised this" in out1, out1  # its args as raised, the rank in a note
    assert "rank(s) 3 had not arrived" in out1 and "where rank 3 was when stopped" in out1, out1
    assert re.search(r"late.py\", line 8 in train", out1), out1
    # node 0: its ranks waited for a rank of another machine, which the note says
    assert out0.startswith("RuntimeError: ") and GLOO_TIMEOUT.search(out0), out0
    assert re.search(r"\nautoddp: \[rank [01] of 4\] raised this", out0), out0
    assert "the failure began there" in out0, out0


def test_a_store_call_given_up_on_does_not_abort_the_launcher_at_its_exit(tmp_path):
    """The heartbeat gives up on a store call after its timeout, but the call goes on in its thread;
    one that came back from C++ while Python was shutting down aborted the launcher (SIGABRT,
    "terminate called without an active exception", seen on node 1 after its Ctrl-C). Here the
    call comes back during the interpreter's shutdown on purpose: the launcher must wait for it."""
    script = write(
        tmp_path / "exits.py",
        """
        import datetime, time
        from torch.distributed import TCPStore
        from autoddp.launch.heartbeat import Beat

        server = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
        beat = Beat("127.0.0.1", server.port, "x/", 0, 1)
        try:
            beat.call(lambda store: store.wait(["never"], datetime.timedelta(seconds=1)), timeout=0.2)
        except TimeoutError:
            print("given up", flush=True)


        class Late:
            def __del__(self):  # deleted with the module's globals, when Python is shutting down
                time.sleep(2)


        late = Late()
        """,
    )
    done = run_python([str(script)], timeout=60)
    assert (done.returncode, done.stdout) == (0, "given up\n"), done.stderr[-2000:]
