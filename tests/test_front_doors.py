"""The front doors' edges (issue 38): a worker that exits without a result, Ctrl-C twice on the
command, options that are no number of seconds, the script's ``__file__``, functions of modules
loaded under another name, standard input, and integer options of other types. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import gone

import autoddp
from autoddp import WorkerError
from conftest import write

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
