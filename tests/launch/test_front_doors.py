"""The front doors' edges (issue 38): a worker that exits without a result, Ctrl-C twice on the
command, options that are no number of seconds, the script's ``__file__``, functions of modules
loaded under another name, standard input, and integer options of other types. Real processes."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import cloudpickle
import numpy
import pytest
from click.testing import CliRunner
from helpers import free_port, gone

import autoddp
from autoddp import ConfigurationError, WorkerError, cli
from autoddp.core import backends
from autoddp.options import Options
from conftest import run_python, write

# --- a worker that ends without its function's result ----------------------------------------


def _exits_on(ranks: str) -> None:
    import torch.distributed as dist

    if ranks == "all" or dist.get_rank() == int(ranks):
        os._exit(0)
    dist.barrier()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("ranks", ["all", "1", "0"])
def test_a_worker_that_exits_with_status_0_before_returning_is_a_worker_error(start_method, ranks):
    call = autoddp.distributed(nproc=2, start_method=start_method)(_exits_on)
    with pytest.raises(WorkerError, match="exited with status 0 before your function returned") as raised:
        call(ranks)
    said = str(raised.value)
    if ranks != "all":
        assert said.startswith(f"rank {ranks} of 2"), said
    assert raised.value.exitcode == 0
    assert "ended well" not in "\n".join(getattr(raised.value, "__notes__", []))


# --- Ctrl-C twice on the command ------------------------------------------------------------

WAITING = """
    import os, sys, time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    with open(os.path.join(sys.argv[1], f"pid-{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()
    time.sleep(120)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gap", [0.01, 0.3])
@pytest.mark.parametrize("to", ["group", "command"])
def test_ctrl_c_twice_on_the_command_exits_130_with_one_line_and_no_worker_left(tmp_path, to, gap):
    script = write(tmp_path / "job.py", WAITING)
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoddp.cli", "-n", "2", str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        pids = _worker_pids(tmp_path)
        for _ in range(2):  # a terminal sends Ctrl-C to the foreground process group
            os.killpg(proc.pid, signal.SIGINT) if to == "group" else proc.send_signal(signal.SIGINT)
            time.sleep(gap)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    assert err.strip() == "autoddp: SIGINT received: stopped all workers", err
    assert gone(pids, kill=True), "workers outlived the command"


def _worker_pids(folder, count: int = 2, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [folder / f"pid-{r}" for r in range(count)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError("workers did not start")


# --- seconds that are no number of seconds ----------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "options, says",
    [
        ({"timeout": float("nan")}, "timeout=nan is not a positive number of seconds"),
        ({"timeout": 1e300}, "longer than torch's process groups can wait"),
        ({"timeout": datetime.timedelta(days=10**6)}, "longer than torch's process groups can wait"),
        ({"hang_report": float("nan")}, "hang_report=nan must be a number of seconds"),
        ({"join_timeout": float("inf"), "nnodes": 2, "node_rank": 0, "master": "127.0.0.1:29500"}, "at most"),
    ],
)
def test_seconds_that_are_no_number_of_seconds_are_a_configuration_error(options, says):
    with pytest.raises(ConfigurationError, match=re.escape(says)):
        autoddp.distributed(**options)


@pytest.mark.unit
@pytest.mark.parametrize(
    "args, says",
    [
        (["--timeout", "nan"], "'nan' is not a number of seconds"),
        (["--timeout", "1e300"], "--timeout 1e+300 is longer than torch's process groups can wait"),
        (["--hang-report", "nan"], "'nan' is not a number of seconds"),
        (["--monitor-interval", "inf"], "'inf' is not a finite number of seconds"),
        (["--monitor-interval", "nan"], "'nan' is not a finite number of seconds"),
        (["--join-timeout", "inf"], "--join-timeout inf must be a number of seconds > 0"),
    ],
)
def test_the_command_says_a_bad_number_of_seconds_in_one_line(tmp_path, args, says):
    script = write(tmp_path / "s.py", "")
    done = CliRunner().invoke(cli.main, ["-n", "2", *args, str(script)])
    assert done.exit_code == 2 and done.output.count("\n") == 1 and says in done.output, done.output


@pytest.mark.unit
def test_an_infinite_hang_report_is_off():
    assert Options(hang_report=float("inf")).hang_report == 0


def _timeout_given() -> float:
    import torch.distributed as dist

    from autoddp.core.state import CURRENT

    if dist.get_rank() == 1:
        time.sleep(1)  # a late rank: the others wait for it, as with any timeout
    dist.barrier()
    return CURRENT.timeout.total_seconds()


@pytest.mark.timeout(90)
def test_an_infinite_timeout_is_no_timeout():
    call = autoddp.distributed(nproc=2, timeout=float("inf"))(_timeout_given)
    assert call() == backends.LONGEST_TIMEOUT.total_seconds() == 10 * 365 * 24 * 3600


BARRIER = """
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    print("through", dist.get_rank())
"""


@pytest.mark.timeout(90)
def test_the_commands_timeout_inf_runs_with_no_timeout(tmp_path):
    script = write(tmp_path / "barrier.py", BARRIER)
    proc = run_python(["-m", "autoddp.cli", "-n", "2", "--timeout", "inf", str(script)], cwd=tmp_path)
    assert proc.returncode == 0 and "through 0" in proc.stdout, proc.stderr


# --- the script's __file__ and __package__, as python sets them --------------------------------

SHOWS_ITS_NAMES = """
    import json, os, sys
    os.chdir(os.path.dirname(os.path.abspath(sys.argv[0])))  # (the script's own folder)
    here = os.path.dirname(__file__)  # after a chdir: only an absolute __file__ still finds the data
    with open(os.path.join(here, "data.txt")) as f:
        data = f.read()
    names = {"file": __file__, "package": __package__, "spec": __spec__ and __spec__.name, "data": data}
    if os.environ.get("RANK", "0") == "0":
        print("NAMES", json.dumps(names))
"""


def _names(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("NAMES"))[6:])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_the_scripts_file_and_package_are_pythons(tmp_path, start_method):
    (tmp_path / "job").mkdir()
    write(tmp_path / "job" / "show.py", SHOWS_ITS_NAMES)
    write(tmp_path / "job" / "data.txt", "beside the script")
    write(tmp_path / "job" / "__init__.py", "")
    plain = _names(run_python([os.path.join("job", "show.py")], cwd=tmp_path))
    assert plain["file"] == str(tmp_path / "job" / "show.py") and plain["package"] is None  # (python 3.9+)
    command = ["-m", "autoddp.cli", "-n", "2", "--start-method", start_method]
    assert _names(run_python([*command, os.path.join("job", "show.py")], cwd=tmp_path)) == plain
    as_module = _names(run_python(["-m", "job.show"], cwd=tmp_path))
    assert as_module["package"] == "job" and as_module["spec"] == "job.show"
    assert _names(run_python([*command, "-m", "job.show"], cwd=tmp_path)) == as_module


# --- a function of a module loaded under another name ----------------------------------------

ELSEWHERE = """
    import torch
    import autoddp

    class Scale:
        def __init__(self, by):
            self.by = by

    def helper(x):
        return x * Scale(2.0).by

    @autoddp.distributed(nproc=2, start_method="spawn")
    def train(x):
        out = torch.tensor([helper(x)])
        autoddp.barrier()
        return out, Scale(3.0).by
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("registered", [True, False])
def test_a_function_of_a_module_loaded_under_another_name_runs_in_fresh_interpreters(tmp_path, registered):
    path = write(tmp_path / "file_name.py", ELSEWHERE)
    name = f"loaded_as_another_name_{registered}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if registered:  # (as importlib's recipe does)
        sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        out, by = module.train(1.5)
    finally:
        sys.modules.pop(name, None)
    assert out.tolist() == [3.0] and by == 3.0
    assert name not in cloudpickle.list_registry_pickle_by_value()  # (given back)


# --- master= on one machine; whole numbers of other types ----------------------------------------


def _store_address() -> tuple[str, str, int]:
    return os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], int(os.environ["WORLD_SIZE"])


@pytest.mark.timeout(90)
def test_master_on_one_machine_is_where_its_store_listens_and_nproc_takes_numpy_integers():
    port = free_port()
    call = autoddp.distributed(nproc=numpy.int64(2), max_restarts=numpy.int32(0), master=f"127.0.0.1:{port}")(
        _store_address
    )
    assert call() == ("127.0.0.1", str(port), 2)


@pytest.mark.unit
@pytest.mark.parametrize(
    "options, says",
    [
        ({"master": "nohostport"}, "master='nohostport' is not HOST:PORT"),
        ({"nproc": True}, "nproc=True is not a positive whole number"),
        ({"nproc": 2.0}, "nproc=2.0 is not a positive whole number"),
        ({"nproc": numpy.int64(0)}, "nproc=0 is not a positive whole number"),
    ],
)
def test_a_bad_master_or_process_count_is_a_configuration_error(options, says):
    with pytest.raises(ConfigurationError, match=re.escape(says)):
        autoddp.distributed(**options)


# --- standard input -----------------------------------------------------------------------

READS_ON = """
    import sys
    import autoddp

    first = sys.stdin.readline()

    @autoddp.distributed(nproc=2, start_method=sys.argv[1])
    def rest(read):
        return sys.stdin.read() if read and autoddp.rank() == 0 else None

    print("RANK0", repr(rest(sys.argv[2] == "read")))
    print("CALLER", repr(first), repr(sys.stdin.read()))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_rank_0_reads_on_where_the_caller_stopped_and_the_caller_keeps_what_it_read_ahead(
    tmp_path, start_method
):
    script = write(tmp_path / "reads_on.py", READS_ON)
    (tmp_path / "input.txt").write_text("a\nb\nc\n")
    with open(tmp_path / "input.txt") as file:  # a file: rank 0 reads on after the caller's line
        done = subprocess.run(
            [sys.executable, str(script), start_method, "read"], stdin=file, capture_output=True, text=True
        )
    assert done.returncode == 0, done.stderr
    assert "RANK0 'b\\nc\\n'" in done.stdout and "CALLER 'a\\n' ''" in done.stdout, done.stdout
    # a pipe: what the caller read ahead is not lost; it stays the caller's
    piped = run_python([str(script), start_method, "leave"], stdin="a\nb\nc\n")
    assert piped.returncode == 0, piped.stderr
    assert "RANK0 None" in piped.stdout and "CALLER 'a\\n' 'b\\nc\\n'" in piped.stdout, piped.stdout


ASKS = """
    answer = input()
    print("ANSWER", answer)
"""


@pytest.mark.timeout(120)
def test_a_script_that_reads_standard_input_on_every_rank_is_told_it_goes_to_rank_0(tmp_path):
    script = write(tmp_path / "asks.py", ASKS)
    proc = run_python(["-m", "autoddp.cli", "-n", "2", str(script)], stdin="yes\n", cwd=tmp_path)
    assert proc.returncode == 1
    assert "EOFError" in proc.stderr
    assert "standard input goes to rank 0 only, as under torchrun; rank 1 reads an empty one" in proc.stderr


def _asks() -> str:
    return "rank 0 (whose input is pytest's)" if autoddp.rank() == 0 else input()


@pytest.mark.timeout(120)
def test_a_function_that_reads_standard_input_on_rank_1_is_told_it_goes_to_rank_0():
    with pytest.raises(EOFError) as raised:
        autoddp.distributed(nproc=2, start_method="fork")(_asks)()
    assert any("standard input goes to rank 0 only" in note for note in raised.value.__notes__)
