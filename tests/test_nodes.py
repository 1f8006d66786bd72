"""Several machines, simulated by two launchers on loopback forming one world (elastic rendezvous)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from autoddp import ConfigurationError
from autoddp.launch import plan as nodes
from conftest import write


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        import sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        sys.stdout.write(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item()}\\n")
        """,
    )
    master = f"127.0.0.1:{_free_port()}"
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
    assert lines == ["rank=0 world=2 sum=3.0", "rank=1 world=2 sum=3.0"]
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
    master = f"127.0.0.1:{_free_port()}"
    results = _both([[sys.executable, str(script), str(r), master] for r in (0, 1)])
    assert all(p.returncode == 0 for p, _, _ in results), [e for _, _, e in results]
    assert [out.strip() for _, out, _ in results] == ["node 0: (0, 2, 3.0)", "node 1: None"]


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


def test_elastic_range_uses_c10d():
    plan = nodes.plan("1:4", rdzv_endpoint="host:29400", rdzv_id="job7")
    assert (plan.min_nodes, plan.max_nodes, plan.backend, plan.run_id) == (1, 4, "c10d", "job7")
