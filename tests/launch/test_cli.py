"""The autoddp command: real workers through torch.distributed.elastic."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys

import pytest

from conftest import GLOO_TIMEOUT, run_python, write

TORCHRUN_STYLE = """
    import os, sys
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    # one write per line: the ranks share the pipe, and print() writes the newline separately
    sys.stdout.write(f"rank={dist.get_rank()} world={dist.get_world_size()} local={os.environ['LOCAL_RANK']} "
                     f"sum={t.item()} args={sys.argv[1:]} path0={sys.path[0]}\\n")
    sys.stdout.flush()
    if "--fail" in sys.argv and dist.get_rank() == 1:
        raise ValueError("bad config on rank 1")
    dist.destroy_process_group()
"""


def autoddp_cli(*args: str, cwd=None, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autoddp.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_torchrun_style_script_with_arguments(tmp_path):
    script = write(tmp_path / "ddp.py", TORCHRUN_STYLE)
    proc = autoddp_cli(
        "-n", "2", "--ranks", "all", str(script), "--lr", "0.1", "-x", "--nproc", "9", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line.split("] ", 1)[1] for line in proc.stdout.splitlines() if "rank=" in line)
    expected_args = "['--lr', '0.1', '-x', '--nproc', '9']"
    assert lines == [
        f"rank=0 world=2 local=0 sum=3.0 args={expected_args} path0={tmp_path}",
        f"rank=1 world=2 local=1 sum=3.0 args={expected_args} path0={tmp_path}",
    ]


def test_failing_script_exits_nonzero_with_its_traceback(tmp_path):
    script = write(tmp_path / "ddp.py", TORCHRUN_STYLE)
    proc = autoddp_cli("--nproc-per-node=2", str(script), "--fail", cwd=tmp_path)
    assert proc.returncode == 1
    assert 'raise ValueError("bad config on rank 1")' in proc.stderr
    assert "autoddp: ValueError: [rank 1 of 2] bad config on rank 1 (its traceback is above)" in proc.stderr
    assert "autoddp/in_rank/worker/script.py" not in proc.stderr  # the runner's own frames are hidden


def test_module_mode(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(pkg / "job.py", TORCHRUN_STYLE)
    proc = autoddp_cli("-n", "2", "--ranks", "all", "-m", "pkg.job", "--flag", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("args=['--flag']") == 2


def test_decorated_function_runs_in_place_under_the_command(tmp_path):
    script = write(
        tmp_path / "deco.py",
        """
        import os, sys
        import autoddp

        @autoddp.distributed(nproc=2)
        def train():
            return autoddp.rank(), autoddp.world_size(), os.getpid()

        rank, world, pid = train()
        sys.stdout.write(f"in-place={pid == os.getpid()} rank={rank} world={world}\\n")
        """,
    )
    proc = autoddp_cli("-n", "2", "--ranks", "all", str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        "[rank 0] in-place=True rank=0 world=2",
        "[rank 1] in-place=True rank=1 world=2",
    ]


def test_console_shows_rank0_by_default_and_the_others_are_logged(tmp_path):
    script = write(tmp_path / "ddp.py", TORCHRUN_STYLE)
    logs = tmp_path / "logs"
    proc = autoddp_cli("-n", "2", "--log-dir", str(logs), str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [line[:6] for line in proc.stdout.splitlines()] == ["rank=0"]
    logged = sorted(p.read_text().strip()[:6] for p in logs.rglob("stdout.log"))
    assert logged == ["rank=0", "rank=1"]  # every rank is in the files, the shown one too


def test_missing_script_is_a_one_line_usage_error(tmp_path):
    proc = autoddp_cli("missing.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"autoddp: error: no such script: 'missing.py' (looked in {tmp_path})"
    ]


def test_bad_inputs_are_one_line_errors(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "x.py").write_text("")
    cases = [
        ((), "no script given"),
        (("folder",), "is a folder without __main__.py"),
        (("-m", "no_such_module_xyz"), "no module named 'no_such_module_xyz'"),
        (("-n", "0", "x.py"), "is not a positive whole number"),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # the runs at once
        procs = list(pool.map(lambda case: autoddp_cli(*case[0], cwd=tmp_path), cases))
    for (args, fragment), proc in zip(cases, procs, strict=True):
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], (args, proc.stderr)


def test_help_documents_every_flag_with_its_default():
    proc = autoddp_cli("--help")
    assert proc.returncode == 0
    for flag in ("--nproc-per-node", "--module", "--max-restarts", "--monitor-interval", "--standalone"):
        assert flag in proc.stdout
    assert proc.stdout.count("[default:") >= 5
    assert "autoddp env" in proc.stdout


def test_env_report(tmp_path):
    proc = autoddp_cli("env", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plain process" in proc.stdout and "torch" in proc.stdout


def test_command_inside_a_launched_run_starts_no_second_layer(tmp_path):
    script = write(
        tmp_path / "where.py",
        """
        import os, sys
        sys.stdout.write(f"{os.environ['RANK']} {os.environ['WORLD_SIZE']} {os.getpid()} {os.getppid()}\\n")
        """,
    )
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    proc = subprocess.run(
        [sys.executable, "-m", "autoddp.cli", "-n", "2", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("0 1 ")  # ran once, in place


def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "autoddp")
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "autoddp" in proc.stdout


def test_workers_compute_with_the_threads_their_environment_says_as_under_torchrun(tmp_path, monkeypatch):
    """The command forks its workers from a process whose torch read OMP_NUM_THREADS at its import,
    before the launcher set it per worker: each worker must still run with its own count."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = write(
        tmp_path / "threads.py",
        """
        import os, torch
        print("threads", os.environ["RANK"], os.environ["OMP_NUM_THREADS"], torch.get_num_threads())
        """,
    )
    launchers = [
        ["-m", "autoddp.cli", "-n", "2", "--ranks", "all"],
        ["-m", "torch.distributed.run", "--nproc-per-node", "2"],
    ]
    with concurrent.futures.ThreadPoolExecutor(len(launchers)) as pool:
        procs = list(pool.map(lambda launcher: run_python([*launcher, str(script)], cwd=tmp_path), launchers))
    seen = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr
        said = [line for line in proc.stdout.splitlines() if "threads " in line]
        lines = [line.split("threads ", 1)[1].split() for line in said]
        seen.append(sorted((int(rank), int(variable), int(used)) for rank, variable, used in lines))
    for ranks in seen:  # (the counts may differ: autoddp gives cores / processes, torchrun 1)
        assert [rank for rank, _, _ in ranks] == [0, 1]
        assert all(used == variable for _, variable, used in ranks), seen


def test_timeout_bounds_a_plain_scripts_collectives(tmp_path):
    """--timeout: the group autoddp makes for a plain script waits that long, then the run fails
    naming the rank that had not arrived."""
    script = write(
        tmp_path / "stall.py",
        """
        import os, time, torch
        from torch import nn
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # capture makes the group here
        if os.environ["RANK"] == "1":
            time.sleep(60)  # rank 1 stalls
        model(torch.ones(4, 2)).sum().backward()
        opt.step()
        """,
    )
    proc = autoddp_cli(
        "-n", "2", "--timeout", "5", str(script), cwd=tmp_path
    )  # (a loaded machine: 5 s to connect)
    assert proc.returncode == 1, proc.stderr
    assert GLOO_TIMEOUT.search(proc.stderr), proc.stderr
    assert "rank(s) 1 had not arrived" in proc.stderr and "autoddp --timeout" in proc.stderr
    bad = autoddp_cli("--timeout", "0", str(script), cwd=tmp_path)
    assert bad.returncode == 2 and "--timeout" in bad.stderr


LINES = 5000

#: Each rank prints LINES lines with print()'s pieces ("LINE", rank, i, and the newline).
MANY_LINES = """
    import os
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    for i in range(LINES):
        print("LINE", rank, i)
    dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", ["all", "0,1"])
def test_no_line_of_one_rank_is_joined_to_another_under_pythonunbuffered(tmp_path, ranks):
    # PYTHONUNBUFFERED=1 (containers set it) writes a print()'s pieces one by one; the ranks share
    # the console (and "all" prefixes lines read from each rank's file): each line stays whole
    script = write(tmp_path / "many.py", MANY_LINES.replace("LINES", str(LINES)))
    proc = subprocess.run(
        [sys.executable, "-m", "autoddp.cli", "-n", "2", "--ranks", ranks, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    prefix = "[rank {}] " if ranks == "all" else ""
    lines = [line for line in proc.stdout.splitlines() if "LINE" in line]
    expected = {prefix.format(rank) + f"LINE {rank} {i}" for rank in (0, 1) for i in range(LINES)}
    assert set(lines) == expected and len(lines) == 2 * LINES, sorted(set(lines) ^ expected)[:5]
