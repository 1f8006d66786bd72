"""The command as a drop-in for torchrun: the workers' environment, torchrun's flags, honest lines.

Every run here is real: torchrun and ``autoddp`` start the same script side by side on this
machine and the test compares what their workers saw, name by name.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from click.testing import CliRunner
from helpers import free_port

from autoddp.cli import main
from autoddp.command import torchrun_flags
from autoddp.core import _compat
from autoddp.launch import contract
from conftest import run_python, write

pytestmark = [pytest.mark.timeout(240), pytest.mark.smoke]  # smoke: CI's -m smoke

#: Values that differ by nature between two runs: where the store is, the run's id, the error file.
PER_RUN = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}

#: Set by the shell or the terminal's size, not by a launcher.
TERMINAL = {"_", "COLUMNS", "LINES"}

SCRIPT = """
import json, os, sys, torch
sys.stdout.write("ENV " + json.dumps({"env": dict(os.environ), "threads": torch.get_num_threads(),
                                      "argv": sys.orig_argv}) + "\\n")
"""


def _seen(done: subprocess.CompletedProcess) -> dict[int, dict]:
    """What each rank printed, by global rank; the variables it got beyond this test's own."""
    assert done.returncode == 0, done.stderr[-3000:]
    found = {}
    for line in done.stdout.splitlines():
        match = re.match(r"(?:\[rank \d+\] )?ENV (.*)", line)
        if match:
            report = json.loads(match.group(1))
            report["given"] = {
                k: v for k, v in report["env"].items() if os.environ.get(k) != v and k not in TERMINAL
            }
            found[int(report["env"]["RANK"])] = report
    return found


def _together(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: run_python(args, timeout=180), commands))


def _same_contract(torchrun: dict[int, dict], autoddp: dict[int, dict], per_run: set[str] = PER_RUN) -> None:
    assert sorted(torchrun) == sorted(autoddp)
    for rank, theirs in torchrun.items():
        ours = autoddp[rank]
        missing = set(theirs["given"]) - set(ours["given"])
        assert not missing, f"rank {rank}: torchrun gives {sorted(missing)}, autoddp does not"
        differ = {
            name: (value, ours["given"][name])
            for name, value in theirs["given"].items()
            if name not in per_run and ours["given"][name] != value
        }
        assert not differ, f"rank {rank}: (torchrun's, autoddp's) values differ: {differ}"
        assert ours["threads"] == theirs["threads"]


def test_workers_get_every_variable_torchrun_gives_with_its_values(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # as a user's shell has it
    script = str(write(tmp_path / "env.py", SCRIPT))
    flags = ["--role", "trainer", "--max-restarts", "1"]
    one = ["-m", "torch.distributed.run", "--nproc-per-node", "2", *flags, script]
    ours = ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", *flags, script]
    port_a, port_b = free_port(), free_port()

    def node(port: int) -> list[str]:
        return ["--master-port", str(port), "--nproc-per-node", "1", script]

    two_nodes = [
        ["-m", launcher, "--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1", *node(p)]
        for launcher, p in (("torch.distributed.run", port_a), ("autoddp.cli", port_b))
        for r in (0, 1)
    ]
    runs = _together(one, ours, *two_nodes)
    torchrun, autoddp = _seen(runs[0]), _seen(runs[1])
    # torch's own list: if torchrun changes it, this fails loudly and contract.py needs the change.
    expected = set(contract.TORCHRUN_VARIABLES)
    if not _compat.releases.torch_at_least(
        _compat.releases.TORCHRUN_SIGNALS
    ):  # (autoddp gives it all the same)
        expected.remove("TORCHELASTIC_SIGNALS_TO_HANDLE")
    assert set(torchrun[0]["given"]) == expected
    _same_contract(torchrun, autoddp)
    assert (
        autoddp[1]["given"]["ROLE_NAME"] == "trainer"
        and autoddp[1]["given"]["TORCHELASTIC_MAX_RESTARTS"] == "1"
    )
    # Two nodes (two launchers on loopback, one worker each): elastic's agent under both.
    torchrun_nodes = {**_seen(runs[2]), **_seen(runs[3])}
    autoddp_nodes = {**_seen(runs[4]), **_seen(runs[5])}
    _same_contract(torchrun_nodes, autoddp_nodes, PER_RUN - {"TORCHELASTIC_RUN_ID"})  # both "none"
    assert (
        autoddp_nodes[1]["given"]["ROLE_NAME"] == "default" and autoddp_nodes[1]["given"]["GROUP_RANK"] == "1"
    )


def test_master_port_start_method_and_the_lines_that_stop_a_run(tmp_path):
    script = str(write(tmp_path / "env.py", SCRIPT))
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    try:
        runs = _together(
            ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", "--master-port", str(port), script],
            ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", "--start-method", "spawn", script],
            ["-m", "autoddp.cli", "-n", "2", "--master-port", str(taken), script],
            ["-m", "autoddp.cli", "-n", "2", "--master-addr", "192.0.2.1", script],
            ["-m", "autoddp.cli", "-n", "2", "--log-dir", "/proc/no-such-folder", script],
        )
    finally:
        holder.close()
    seen = _seen(runs[0])
    assert {r["env"]["MASTER_PORT"] for r in seen.values()} == {str(port)}  # a port opened in a firewall
    runner = "autoddp.in_rank.worker.script"
    assert all(runner in r["argv"] for r in _seen(runs[1]).values())  # fresh interpreters
    assert all(runner not in r["argv"] for r in seen.values())  # forked by default
    lines_say = [f"--master-port {taken}: port {taken} .* cannot be used", "192.0.2.1", "/proc"]
    for done, says in zip(runs[2:], lines_say, strict=True):
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stderr
        assert re.search(says, lines[0]) and "traceback" not in lines[0], lines[0]


def test_every_torchrun_flag_is_taken_or_refused_in_one_line():
    from torch.distributed.run import get_args_parser

    ours = {opt for param in main.params for opt in param.opts + param.secondary_opts}
    page = pathlib.Path(__file__).resolve().parents[2].joinpath("docs", "command.md").read_text()
    table = page.partition("| torchrun flag | under `autoddp` |")[2].partition("\n\n")[0]
    assert table, "docs/command.md has no torchrun table"
    runner = CliRunner()
    for action in get_args_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = torchrun_flags.canonical(action.option_strings[-1])
        assert f"`{name}`" in table, f"docs/command.md's torchrun table lacks {name}"
        if name in torchrun_flags.TAKEN:
            assert set(action.option_strings) <= ours, f"{action.option_strings} not all taken"
            continue
        assert name in torchrun_flags.REFUSED, f"torchrun's {name} is neither taken nor refused"
        for spelling in action.option_strings:
            done = runner.invoke(main, [spelling, *(["1"] if action.nargs != 0 else []), "train.py"])
            assert done.exit_code == 2
            assert done.output.count("\n") == 1 and f"{name} is a torchrun flag" in done.output, done.output
    for args, says in [
        (["--rdzv-backend", "etcd", "x.py"], "--rdzv-backend etcd is torchrun's"),
        (["--start-method", "forkserver", "x.py"], "use fork or spawn"),
        (["--max-restarts", "x", "x.py"], "invalid value for '--max-restarts'"),
        (["--log_line_prefix_template", "${rank}", "x.py"], "--log-line-prefix-template is a torchrun"),
        (["--print-completion", "tcsh", "x.py"], "completion scripts (click's) are for bash, zsh, fish"),
        (["--max-restarts", "-1", "x.py"], "-1 is not in the range"),
        (["--rdzv-conf", "join_timeout=5", __file__], "--rdzv-conf is for a run on several machines"),
        (["--local-addr", "10.0.0.1", __file__], "--local-addr is for a run on several machines"),
    ]:
        done = runner.invoke(main, args)
        assert done.exit_code == 2 and done.output.count("\n") == 1 and says in done.output, done.output
    for shell in ("bash", "zsh", "fish"):  # torchrun's --print-completion: a script to source, then exit
        done = runner.invoke(main, ["--print_completion", shell, "never-run.py"])
        assert done.exit_code == 0 and f"_AUTODDP_COMPLETE={shell}_" in done.output, done.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the one-process line is about a machine without GPUs")
def test_one_process_is_said_unless_quiet_and_rdzv_conf_reaches_the_rendezvous(tmp_path):
    script = str(write(tmp_path / "env.py", SCRIPT))
    endpoint = f"127.0.0.1:{free_port()}"
    alone = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "-n", "1"]
    started = time.monotonic()
    plain, quiet, misplaced, waited = _together(
        ["-m", "autoddp.cli", script],
        ["-m", "autoddp.cli", "-q", script],
        ["-m", "autoddp.cli", script, "-n", "2"],
        ["-m", "autoddp.cli", *alone, "--rdzv-conf", "join_timeout=3", script],
    )
    assert plain.returncode == 0 and plain.stderr.splitlines() == [
        "autoddp: 1 process, no GPU found: pass -n N before the script for N processes on the CPU"
    ]
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert "'-n 2' after the script is the script's own argument" in misplaced.stderr
    assert json.loads(misplaced.stdout[4:])["argv"][-2:] == ["-n", "2"]  # the script still got them
    # join_timeout=3 honoured: the lone node gives up in seconds (torch's default is 600 s)
    assert waited.returncode == 1 and time.monotonic() - started < 60
    assert "did not all join the rendezvous" in waited.stderr.splitlines()[-1] and "(3 s)" in waited.stderr


#: A script whose ranks make the group and work on their own: nothing collective follows.
ON_ITS_OWN = """
import os, sys, torch.distributed as dist
dist.init_process_group("gloo")
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as f:
    f.write(str(os.environ.get("TORCH_DIST_INIT_BARRIER")))
"""


def test_a_group_made_and_left_at_once_ends_well_with_torchs_init_barrier(tmp_path, monkeypatch):
    """Without torch's barrier at the end of ``init_process_group`` a rank can end and close its
    sockets while another still connects (gloo's "Connection closed by peer", rarely); the
    workers get it unless the user set it."""
    script = write(tmp_path / "own.py", ON_ITS_OWN)
    monkeypatch.delenv("TORCH_DIST_INIT_BARRIER", raising=False)

    def seen(*flags: str) -> list[str]:
        for name in ("rank0", "rank1"):
            (tmp_path / name).unlink(missing_ok=True)
        done = run_python(["-m", "autoddp.cli", "-n", "2", *flags, str(script), str(tmp_path)])
        assert done.returncode == 0, done.stderr
        return [(tmp_path / name).read_text() for name in ("rank0", "rank1")]

    for _ in range(3):
        assert seen("--no-capture") == ["1", "1"]
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "0")
    assert seen() == ["0", "0"]


def test_env_describes_what_the_command_would_do_here(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    done = CliRunner().invoke(main, ["-n", "2", "env"])
    assert done.exit_code == 0, done.output
    command = done.output[done.output.index("\ncommand ") :]
    assert "autoddp script.py here: 2 processes (asked for)" in command
    for row in ("threads ", "backend ", "start method ", "network ", "strategy "):
        assert f"\n  {row}" in command
    said = " ".join(command.split())  # (the available memory moves: its figure is not compared)
    assert re.search(
        r"auto: DDP where a model's state fits [0-9.]+ \w+ per process "
        r"\(the available memory over 2 processes\)",
        said,
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "3 per process (OMP_NUM_THREADS, yours)" in CliRunner().invoke(main, ["-n", "2", "env"]).output


def test_pet_variables_nproc_keywords_and_rdzv_endpoint_as_torchrun(tmp_path, monkeypatch):
    from autoddp.command import arguments
    from autoddp.core.environment import hardware

    script = str(write(tmp_path / "env.py", SCRIPT))
    port = free_port()
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")  # Kubeflow's PyTorchJob runs a bare `torchrun train.py`
    pet, endpoint = _together(
        ["-m", "autoddp.cli", "--ranks", "all", script],
        ["-m", "autoddp.cli", "--ranks", "all", "--rdzv-endpoint", f"localhost:{port}", script],
    )
    assert sorted(_seen(pet)) == [0, 1]
    assert {r["env"]["MASTER_PORT"] for r in _seen(endpoint).values()} == {str(port)}
    monkeypatch.delenv("PET_NPROC_PER_NODE")
    assert arguments.process_count("cpu") == hardware.cpu_count()  # torchrun: one per core
    if not torch.cuda.is_available():
        assert arguments.process_count("auto") == hardware.cpu_count()
    monkeypatch.setenv("PET_TEE", "3")
    done = CliRunner().invoke(main, [script])
    assert (
        done.exit_code == 2 and done.output.count("\n") == 1 and "PET_TEE is torchrun's --tee" in done.output
    )
