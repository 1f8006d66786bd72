"""Two hosts for real: network namespaces autoddp-h0/-h1 joined by a veth pair (tests/clusters/setup.sh).

The host name is shared and resolves to 127.0.0.1, as on many cluster nodes and containers: gloo
alone would pick loopback (``Gloo connectFullMesh failed ... remote=[127.0.0.1]``, torchrun too).
No test sets GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME unless it says so.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import time

import pytest
from helpers import HOSTS, SETUP, child_env, need_root, results, scripts, speaking

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def hosts():
    need_root("running processes in network namespaces")
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    missing = [ns for ns, _, _ in HOSTS if ns not in names]
    if missing:
        pytest.skip(f"network namespaces {', '.join(missing)} do not exist: {SETUP} makes them")


@pytest.fixture
def job(hosts, tmp_path):
    return scripts(tmp_path)


def _port() -> int:
    return random.randrange(30000, 32000)


def _start(node: int, command: list[str], **extra: str) -> subprocess.Popen:
    env = child_env(**extra)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name not in extra:
            env.pop(name, None)
    return subprocess.Popen(
        ["ip", "netns", "exec", HOSTS[node][0], *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _both(command, timeout: float = 120, **extra: str) -> list[tuple[int, str, str]]:
    """Run ``command(node)`` on both hosts at once: (exit status, stdout, stderr) of each."""
    started = [_start(node, command(node), **extra) for node in (0, 1)]
    try:
        return [(p, *p.communicate(timeout=timeout)) for p in started]
    finally:
        for p in started:
            p.kill()
            p.wait()


def _ok(runs) -> None:
    assert all(p.returncode == 0 for p, _, _ in runs), [err[-3000:] for _, _, err in runs]


def _command(*options: str):
    return lambda node: ["autoddp", *(o.format(node=node) for o in options)]


PLAIN = """
import datetime, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
"""


def test_without_autoddp_gloo_picks_loopback(tmp_path, hosts):
    # The set-up reproduces the defect: plain torch.distributed, launcher variables by hand.
    # Whichever rank dials the other is sent to 127.0.0.1 and refused; the other times out.
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    master = dict(MASTER_ADDR=HOSTS[0][1], MASTER_PORT=str(_port()), WORLD_SIZE="2")
    started = [_start(node, ["python", str(script)], RANK=str(node), **master) for node in (0, 1)]
    try:
        runs = [(p, *p.communicate(timeout=90)) for p in started]
    finally:
        for p in started:
            p.kill()
            p.communicate()
    assert [p.returncode for p, _, _ in runs] == [1, 1]
    errors = runs[0][2] + runs[1][2]
    assert "Gloo connectFullMesh failed" in errors and "remote=[127.0.0.1]" in errors


def test_command_static_rendezvous_torchrun_script(job):
    master = f"{HOSTS[0][1]}:{_port()}"
    script = str(job["torchrun_style"])
    where = ("--nnodes", "2", "--node-rank", "{node}", "--master", master)
    runs = _both(_command(*where, "-n", "2", "--ranks", "all", script))  # (default: local rank 0 only)
    _ok(runs)
    found = [r for _, out, _ in runs for r in results(out)]
    assert sorted((r["rank"], r["world"], r["sum"]) for r in found) == [(rank, 4, 10.0) for rank in range(4)]
    for node, (_, _, err) in enumerate(runs):
        interface, address = f"autoddp-v{node}", HOSTS[node][1]
        assert f"network interface {interface} ({address}), the one that routes to {HOSTS[0][1]}" in err
    assert sorted(r["ifname"] for r in found) == ["autoddp-v0"] * 2 + ["autoddp-v1"] * 2


def test_command_c10d_rendezvous_decorated_script(job):
    endpoint = f"{HOSTS[0][1]}:{_port()}"
    command = _command("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "-n", "1")
    runs = _both(lambda node: [*command(node), str(job["decorated"])])
    _ok(runs)
    found = [r for _, out, _ in runs for r in results(out)]
    assert sorted(r["result"]["rank"] for r in found) == [0, 1]
    for r in found:  # in place inside the agent's workers
        assert r["env"] == "torchrun (torch.distributed.elastic)"
        assert r["result"]["world"] == 2 and r["result"]["sum"] == 3.0


DECORATOR = """
import json, sys, torch, torch.distributed as dist, autoddp

node, master, backend = int(sys.argv[1]), sys.argv[2], sys.argv[3]

@autoddp.distributed(nproc=1, nnodes=2, node_rank=node, master=master, rdzv_backend=backend)
def train(steps):
    t = torch.ones(1) * (autoddp.rank() + 1)
    for step in range(steps):
        dist.all_reduce(t)
        if step == 0:
            sys.stdout.write("training\\n")
            sys.stdout.flush()
    return {"rank": autoddp.rank(), "world": autoddp.world_size()}

sys.stdout.write("RESULT " + json.dumps(train(int(sys.argv[4]))) + "\\n")
"""


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_decorator_returns_rank0_result_on_node0(tmp_path, hosts, backend):
    script = tmp_path / "decorated_nodes.py"
    script.write_text(DECORATOR)
    master = f"{HOSTS[0][1]}:{_port()}"
    runs = _both(lambda node: ["python", str(script), str(node), master, backend, "1"])
    _ok(runs)
    found = [results(out) for _, out, _ in runs]
    if backend == "static":
        assert found == [[{"rank": 0, "world": 2}], [None]]
    else:  # c10d assigns the ranks: the machine that got rank 0 gets its result
        assert sorted(found, key=str) == sorted([[{"rank": 0, "world": 2}], [None]], key=str)


def test_debian_style_host_names(job):
    # Each host's /etc/hosts names itself 127.0.1.1: node 0 must not offer loopback to node 1.
    master = f"{HOSTS[0][2]}:{_port()}"
    script = str(job["torchrun_style"])
    runs = _both(_command("--nnodes", "2", "--node-rank", "{node}", "--master", master, "-n", "1", script))
    _ok(runs)
    assert sorted(r["rank"] for _, out, _ in runs for r in results(out)) == [0, 1]
    assert f"{HOSTS[0][2]} resolves to 127.0.1.1 here" in runs[0][2]


def test_launched_in_place_across_hosts(job):
    # A launcher that sets RANK/WORLD_SIZE (a Kubernetes operator, a script): no autoddp launch.
    port = _port()

    def variables(node: int) -> dict[str, str]:
        return dict(
            RANK=str(node), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(port)
        )

    for script, command in ((job["decorated"], ["python"]), (job["torchrun_style"], ["autoddp"])):
        started = [
            _start(node, [*command, str(script)], MASTER_ADDR=HOSTS[0][1], **variables(node))
            for node in (0, 1)
        ]
        runs = [(p, *p.communicate(timeout=120)) for p in started]
        _ok(runs)
        found = [r.get("result", r) for _, out, _ in runs for r in results(out)]
        assert sorted((r["rank"], r["world"], r["sum"]) for r in found) == [(0, 2, 3.0), (1, 2, 3.0)]
        assert "network interface autoddp-v1 (10.213.13.2)" in runs[1][2]
        port += 1


def test_the_users_interface_setting_is_left_alone(job):
    master = f"{HOSTS[0][1]}:{_port()}"
    script = str(job["torchrun_style"])
    command = _command("--nnodes", "2", "--node-rank", "{node}", "--master", master, "-n", "1", script)
    started = [_start(node, command(node), GLOO_SOCKET_IFNAME=f"autoddp-v{node}") for node in (0, 1)]
    runs = [(p, *p.communicate(timeout=120)) for p in started]
    _ok(runs)
    for node, (_, out, err) in enumerate(runs):
        assert f"GLOO_SOCKET_IFNAME='autoddp-v{node}' set by you" in err
        assert [r["ifname"] for r in results(out)] == [f"autoddp-v{node}"]


LONG = """
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for step in range(3000):
    dist.all_reduce(torch.ones(1))
    if step == 0:
        sys.stdout.write("training\\n")
        sys.stdout.flush()
    time.sleep(0.05)
"""


@pytest.mark.parametrize("front", ["command", "decorator"])
def test_node1_killed_mid_run_ends_node0_with_a_clear_error(tmp_path, hosts, front):
    master = f"{HOSTS[0][1]}:{_port()}"
    if front == "command":
        script = tmp_path / "long.py"
        script.write_text(LONG)
        argv = [
            "autoddp",
            "--nnodes",
            "2",
            "--node-rank",
            "{node}",
            "--master",
            master,
            "-n",
            "1",
            str(script),
        ]
    else:
        script = tmp_path / "decorated_nodes.py"
        script.write_text(DECORATOR)
        argv = ["python", str(script), "{node}", master, "static", "100000"]
    started = [_start(node, [a.format(node=node) for a in argv]) for node in (0, 1)]
    try:
        for p in started:  # both are past the rendezvous and inside collectives
            assert p.stdout.readline() == "training\n"
        started[1].send_signal(signal.SIGKILL)  # the whole machine's launcher; its workers die with it
        killed = time.monotonic()
        _, err = started[0].communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        for p in started:
            p.kill()
            p.communicate()
    assert started[0].returncode == 1 and took < 30, err[-3000:]
    # the rank that saw it, and gloo's words for a peer that went away (two forms), naming its address
    assert "rank 0 of 2" in err and "[10.213.13.2]" in err, err
    assert re.search(r"Connection (closed|reset) by peer", err), err


def _speakers(folder, *extra: str):
    """The command and the decorator on both hosts at once, each with --ranks all and its own log
    folder (shared by its two hosts): {front: [(process, stdout, stderr) of node 0, of node 1]}."""
    plain, decorated = speaking(folder)
    command_master, decorator_master = f"{HOSTS[0][1]}:{_port()}", f"{HOSTS[0][1]}:{_port() + 2000}"
    commands = {
        "command": _command(
            *("--nnodes", "2", "--node-rank", "{node}", "--master", command_master, "-n", "2"),
            *("--ranks", "all", "--log-dir", str(folder / "command"), str(plain), *extra),
        ),
        "decorator": lambda node: [
            *("python", str(decorated), str(node), decorator_master),
            *(str(folder / "decorator"), *extra),
        ],
    }
    started = {front: [_start(node, command(node)) for node in (0, 1)] for front, command in commands.items()}
    try:
        return {front: [(p, *p.communicate(timeout=120)) for p in pair] for front, pair in started.items()}
    finally:
        for pair in started.values():
            for p in pair:
                p.kill()
                p.wait()


def test_every_ranks_output_shown_and_kept_on_two_hosts(tmp_path, hosts):
    runs = _speakers(tmp_path)
    for front, pair in runs.items():
        _ok(pair)
        for node, (_, out, err) in enumerate(pair):
            ranks = (2 * node, 2 * node + 1)  # prefixed with the global rank, on the node that runs it
            assert sorted(out.splitlines()) == [f"[rank {r}] out of rank {r}" for r in ranks], (front, out)
            assert all(f"[rank {r}] err of rank {r}\n" in err for r in ranks), (front, err)
        for rank in range(4):  # every rank's files, named by global rank: the hosts share the folder
            for stream in ("out", "err"):
                (found,) = (tmp_path / front).glob(f"*/attempt_0/{rank}/std{stream}.log")
                assert f"{stream} of rank {rank}" in found.read_text().splitlines(), front


def test_a_failure_on_node1_has_the_root_cause_rules_of_one_node(tmp_path, hosts):
    runs = _speakers(tmp_path, "fail")
    (p0, _, err0), (p1, _, err1) = runs["command"]
    assert p0.returncode == p1.returncode == 1, err0[-3000:] + err1[-3000:]
    (_, out0, _), (_, out1, _) = runs["decorator"]
    decorated = [_failure(out) for out in (out0, out1)]
    ends = (r"\(on node 1\)", r"\(its traceback is above\)")
    command = [
        {"first": _line(rf"autoddp: (\w+: .*) {end}", e), "notes": e}
        for end, e in zip(ends, (err0, err1), strict=True)
    ]
    for front, (node0, node1) in (("command", command), ("decorator", decorated)):
        # node 1: the first ValueError by time names its rank; the other rank's is listed after it
        lead = re.fullmatch(r"(?:ValueError: )?\[rank ([23]) of 4\] bad batch on rank \1", node1["first"])
        assert lead, (front, node1)
        other = 5 - int(lead[1])
        assert (
            f"other ranks also failed: rank {other}: ValueError: bad batch on rank {other}" in node1["notes"]
        )
        # node 0 (its ranks only lost their peers): the same root cause, where it ran, its traceback
        assert node0["first"] == node1["first"], (front, node0)
        assert f"rank {lead[1]} runs on node 1 of 2: the failure began there" in node0["notes"], (
            front,
            node0,
        )
        if front == "command":  # node 0 shows the traceback that only node 1's console had
            assert f"Traceback of rank {lead[1]} of 4 (the worker that raised)" in err0, err0
    assert decorated[0]["type"] == "ValueError"
    assert decorated[1]["type"] == "ValueError"


def _line(pattern: str, text: str) -> str:
    """The first group of the one line of ``text`` that matches ``pattern``."""
    (match,) = [m for m in (re.fullmatch(pattern, line) for line in text.splitlines()) if m]
    return match[1]


def _failure(output: str) -> dict:
    """What the decorated script's caller got: its ``FAILED {...}`` line, the notes joined."""
    (line,) = [line for line in output.splitlines() if line.startswith("FAILED ")]
    found = json.loads(line[len("FAILED ") :])
    return {**found, "notes": "\n".join(found["notes"])}
