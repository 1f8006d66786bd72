"""The network interface autoddp names for gloo and NCCL: real lookups on this machine, and the
readers of the kernel's tables fed with tables written here. Two real hosts: test_clusters_hosts.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from autoddp import ConfigurationError
from autoddp.core.environment import mpi, network
from conftest import run_python

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's interface tables")


@pytest.mark.unit
@linux
def test_loopback_master_uses_the_loopback_interface():
    route = network.route_to("127.0.0.1")
    assert (route.interface, route.local_address) == ("lo", "127.0.0.1")
    choice = network.choose("127.0.0.1", {})
    assert choice.variables == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert "network interface lo (127.0.0.1), the one that routes to 127.0.0.1" in choice.summary


@pytest.mark.unit
@linux
def test_an_address_of_this_machine_routes_through_its_own_interface():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("203.0.113.1", 9))
            own = probe.getsockname()[0]
    except OSError:
        pytest.skip("this machine has no default route")
    route = network.route_to(own)
    assert route.local_address == own and route.owns_address
    assert route.interface is not None and route.interface != "lo"


@pytest.mark.unit
@linux
def test_a_host_name_that_resolves_to_loopback_here_faces_the_other_machines():
    name = socket.gethostname()
    if not socket.gethostbyname(name).startswith("127."):
        pytest.skip(f"this host name ({name}) does not resolve to loopback here")
    route = network.route_to(name)
    if route.interface == "lo":
        pytest.skip("no interface other than loopback faces other machines here")
    assert f"{name} resolves to 127." in route.note and not route.owns_address


@pytest.mark.unit
def test_the_users_setting_is_left_alone():
    for name in network.IFNAME_VARIABLES:
        choice = network.choose("127.0.0.1", {name: "eth7"})
        assert choice.variables == {}
        assert f"{name}='eth7' set by you" in choice.summary


@pytest.mark.unit
def test_a_master_that_does_not_resolve_is_a_clear_error():
    with pytest.raises(ConfigurationError, match=r"'no-such-host\.invalid' does not resolve.*--master"):
        network.choose("no-such-host.invalid", {})


ROUTES = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
ib0\t000D0A0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
"""


@pytest.mark.unit
@pytest.mark.skipif(sys.byteorder != "little", reason="the table below is written in x86's byte order")
def test_route_table_longest_prefix(tmp_path):
    table = tmp_path / "route"
    table.write_text(ROUTES)
    assert network._ipv4_route_interface("10.10.13.7", str(table)) == "ib0"
    assert network._ipv4_route_interface("192.0.2.9", str(table)) == "eth0"
    assert network._ipv4_route_interface("8.8.8.8", str(table)) == "eth0"  # the default route
    assert network._ipv4_route_interface("8.8.8.8", str(tmp_path / "missing")) is None


@pytest.mark.unit
def test_ipv6_address_table(tmp_path):
    table = tmp_path / "if_inet6"
    table.write_text(
        "00000000000000000000000000000001 01 80 10 80       lo\n"
        "fd000000000000000000000000000002 04 40 00 82     eth0\n"
    )
    assert network._ipv6_interface("fd00::2", str(table)) == "eth0"
    assert network._ipv6_interface("::1", str(table)) == "lo"
    assert network._ipv6_interface("fd00::3", str(table)) is None


@pytest.mark.unit
def test_hydra_proxy_is_found_above_this_process(tmp_path):
    # MPICH gives ranks on one node no shared variable: the proxy that started them is shared.
    def stat(pid: int, name: str, parent: int) -> None:
        (tmp_path / str(pid)).mkdir()
        fields = ["S", str(parent), *["0"] * 17, "777"]  # field 22 (start time) is the 20th after the name
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) {' '.join(fields)} 0 0\n")

    stat(40, "hydra_pmi_proxy", 1)
    stat(41, "bash", 40)
    assert mpi.hydra_proxy(41, str(tmp_path)) == "40:777"
    stat(50, "python (x)", 1)
    assert mpi.hydra_proxy(50, str(tmp_path)) is None


def test_env_report_names_the_interface_towards_node0(tmp_path):
    proc = run_python(["-m", "autoddp.cli", "env", "--master", "127.0.0.1:29500"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "network to node 0 at 127.0.0.1:29500: network interface lo (127.0.0.1)" in text


def test_env_report_respects_the_users_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    proc = run_python(["-m", "autoddp.cli", "env"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "GLOO_SOCKET_IFNAME='eth7' set by you" in " ".join(proc.stdout.split())


def test_env_is_a_command_of_its_own_with_its_own_flags(tmp_path):
    for args in (["env", "--nproc", "3"], ["-n", "3", "env"]):  # after env, or before it as for a script
        proc = run_python(["-m", "autoddp.cli", *args], cwd=tmp_path)
        assert proc.returncode == 0, (args, proc.stderr)
        assert "autoddp script.py here: 3 processes (asked for)" in proc.stdout, (args, proc.stdout)
    proc = run_python(["-m", "autoddp.cli", "env", "--bogus"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "autoddp: error: no such option '--bogus' (see autoddp env --help)"
    proc = run_python(["-m", "autoddp.cli", "env", "--help"], cwd=tmp_path)
    assert (
        proc.returncode == 0 and "Usage: autoddp env [OPTIONS]" in proc.stdout and "--master" in proc.stdout
    )


@linux
def test_no_route_to_the_master_is_a_clear_error():
    if os.geteuid() != 0:
        pytest.skip("running a process in a network namespace needs root")
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    if "autoddp-h0" not in names:
        pytest.skip("network namespace autoddp-h0 does not exist: tests/clusters/setup.sh start makes it")
    probe = "from autoddp.core.environment import network; network.route_to('192.0.2.77')"
    proc = subprocess.run(
        ["ip", "netns", "exec", "autoddp-h0", sys.executable, "-c", probe], capture_output=True, text=True
    )
    assert proc.returncode == 1 and "no network route to node 0 at 192.0.2.77" in proc.stderr


def test_a_multi_node_command_with_a_master_that_does_not_resolve(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("print('never')\n")
    args = [
        "-m",
        "autoddp.cli",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master",
        "no-such-host.invalid:29500",
    ]
    proc = run_python([*args, str(script)], cwd=tmp_path)
    assert proc.returncode == 2 and "never" not in proc.stdout
    assert proc.stderr.startswith("autoddp: error: node 0's address 'no-such-host.invalid' does not resolve")
