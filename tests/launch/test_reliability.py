"""What autoddp guarantees under failure: no hang, no orphan, no lost work. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import psutil
import pytest
import torch
import torch.distributed as dist
from helpers import gone

import autoddp
from autoddp import ConfigurationError, WorkerError
from conftest import GLOO_TIMEOUT, write

# A script whose workers record their pids, say they are ready, then wait forever.
WAITING_DECORATED = """
    import os, sys, time
    import autoddp

    @autoddp.distributed(nproc=2)
    def train(folder):
        with open(os.path.join(folder, f"pid-{autoddp.rank()}"), "w") as f:
            f.write(str(os.getpid()))
        autoddp.barrier()
        time.sleep(120)

    train(sys.argv[1])
"""

WAITING_SCRIPT = """
    import os, sys, time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    with open(os.path.join(sys.argv[1], f"pid-{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()
    time.sleep(120)
"""


def _start(args, folder):
    return subprocess.Popen(
        [sys.executable, *args, str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _worker_pids(folder, count=2, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [folder / f"pid-{r}" for r in range(count)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise AssertionError("workers did not start")


@pytest.mark.parametrize(
    "how, sig, code",
    [
        ("decorator", signal.SIGINT, -signal.SIGINT),
        ("decorator", signal.SIGTERM, -signal.SIGTERM),
        ("cli", signal.SIGINT, 130),
        ("cli", signal.SIGTERM, 143),
    ],
)
def test_signal_to_the_launcher_stops_every_worker_with_one_line(tmp_path, how, sig, code):
    if how == "decorator":
        proc = _start([str(write(tmp_path / "job.py", WAITING_DECORATED))], tmp_path)
    else:
        proc = _start(
            ["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / "job.py", WAITING_SCRIPT))], tmp_path
        )
    pids = _worker_pids(tmp_path)
    started = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - started < 10
    assert proc.returncode in (code, -sig), err  # 128+N, or killed by N: what a shell shows as 128+N
    assert gone(pids, kill=True)
    assert f"autoddp: {sig.name} received: stopped all" in err
    assert "[rank" not in err  # no traceback from the workers
    if how == "cli":
        assert err.strip().count("\n") == 0, err  # exactly one line


@pytest.mark.parametrize("how", ["decorator", "cli"])
def test_workers_die_with_a_killed_launcher(tmp_path, how):
    if how == "decorator":
        proc = _start([str(write(tmp_path / "job.py", WAITING_DECORATED))], tmp_path)
    else:
        proc = _start(
            ["-m", "autoddp.cli", "-n", "2", str(write(tmp_path / "job.py", WAITING_SCRIPT))], tmp_path
        )
    pids = _worker_pids(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    assert gone(pids, kill=True), "workers outlived their launcher"


def test_segfault_is_a_worker_error():
    @autoddp.distributed(nproc=2)
    def train():
        if autoddp.rank() == 1:
            import ctypes

            ctypes.string_at(0)  # read address 0: SIGSEGV
        autoddp.barrier()

    with pytest.raises(WorkerError, match="rank 1 .*SIGSEGV") as info:
        train()
    assert info.value.signal == "SIGSEGV"


def test_several_failures_lead_with_the_first_and_list_the_rest():
    @autoddp.distributed(nproc=2)
    def train():
        def second(*_):  # rank 1 fails too, when autoddp stops it after rank 0's failure
            raise ValueError("second")

        if autoddp.rank() == 1:
            signal.signal(signal.SIGTERM, second)
        dist.barrier()  # rank 1's handler is in place before rank 0 fails (a slow start missed it)
        if autoddp.rank() == 0:
            raise KeyError("first")
        threading.Event().wait()  # (never set: only the stop ends the wait)

    with pytest.raises(KeyError, match="rank 0 of 2") as info:
        train()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "other ranks also failed: rank 1: ValueError: second" in notes, notes


def test_stuck_rank_becomes_an_error_naming_it():
    @autoddp.distributed(nproc=2, timeout=3)
    def train():
        if autoddp.rank() == 1:
            time.sleep(60)  # never reaches the collective
        dist.all_reduce(torch.ones(1))

    started = time.monotonic()
    with pytest.raises(RuntimeError, match=GLOO_TIMEOUT) as info:
        train()
    assert time.monotonic() - started < 30
    notes = "\n".join(info.value.__notes__)
    assert "rank(s) 1 had not arrived" in notes
    assert "time.sleep(60)" in notes or "in train" in notes  # where rank 1 was


def test_restart_resumes_from_the_last_checkpoint_with_the_same_weights(tmp_path):
    def run(folder, crash):
        @autoddp.distributed(nproc=2, max_restarts=1)
        def train(model, loader, epochs):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            start = 0
            state = autoddp.load(os.path.join(folder, "ckpt.pt"), default=None)
            if state is not None:  # resuming after a restart
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
                start = state["epoch"] + 1
                loader.sampler.set_epoch(start)
            for epoch in range(start, epochs):
                for x, y in loader:
                    loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                if (
                    crash
                    and epoch == 2
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
                    and autoddp.rank() == 1
                ):
                    os.kill(
                        os.getpid(), signal.SIGKILL
                    )  # dies mid-training, after epoch 2's checkpoint? no: before
                autoddp.save(
                    {"model": model, "optimizer": opt, "epoch": epoch}, os.path.join(folder, "ckpt.pt")
                )
            return model.state_dict(), os.environ["TORCHELASTIC_RESTART_COUNT"]

        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.randn(64))
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
        torch.manual_seed(1)
        return train(torch.nn.Linear(3, 1), loader, 5)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    uninterrupted, attempts_a = run(str(tmp_path / "a"), crash=False)
    resumed, attempts_b = run(str(tmp_path / "b"), crash=True)
    assert (attempts_a, attempts_b) == ("0", "1")
    for key in uninterrupted:
        assert torch.allclose(uninterrupted[key], resumed[key], atol=1e-6), key


def test_four_jobs_at_once_all_succeed(tmp_path):
    script = write(
        tmp_path / "job.py",
        """
        import sys, torch, torch.distributed as dist, autoddp

        @autoddp.distributed(nproc=2)
        def train(tag):
            t = torch.tensor([float(tag * 10 + dist.get_rank())])
            dist.all_reduce(t)  # cross-talk between jobs would mix the sums
            return t.item()

        tag = int(sys.argv[1])
        print(tag, train(tag))
        """,
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for i in range(4)
    ]
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.split() == [str(i), str(float(i * 20 + 1))]


def test_master_port_taken_is_a_clear_error(monkeypatch):
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    monkeypatch.setenv("MASTER_PORT", str(holder.getsockname()[1]))

    @autoddp.distributed(nproc=2)
    def train():
        pass

    try:
        with pytest.raises(ConfigurationError, match="MASTER_PORT=.* cannot be used.*unset MASTER_PORT"):
            train()
    finally:
        holder.close()


def test_nested_call_with_another_nproc_runs_in_place_and_warns():
    @autoddp.distributed(nproc=4)
    def inner():
        return autoddp.world_size(), os.getpid()

    @autoddp.distributed(nproc=2)
    def outer():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            world, pid = inner()
        return world, pid == os.getpid(), [str(w.message) for w in caught]

    world, same_process, messages = outer()
    assert world == 2 and same_process
    assert any("asks for nproc=4 but runs inside an existing world" in m for m in messages)


def test_store_listens_on_loopback_and_files_are_private():
    @autoddp.distributed(nproc=2, start_method="spawn")
    def train():
        port = int(os.environ["MASTER_PORT"])
        listening = [
            c.laddr.ip
            for c in psutil.net_connections(kind="tcp")
            if c.status == "LISTEN" and c.laddr.port == port
        ]
        folder = os.environ["AUTODDP_RUN_FOLDER"]  # this run's private folder
        modes = {".": oct(os.stat(folder).st_mode & 0o777)}
        for name in os.listdir(folder):  # files of ours; logs/ sits inside the 0700 folder
            if os.path.isfile(os.path.join(folder, name)):
                modes[name] = oct(os.stat(os.path.join(folder, name)).st_mode & 0o777)
        return listening, folder, modes

    listening, folder, modes = train()
    assert listening and set(listening) == {"127.0.0.1"}
    assert folder.startswith(tempfile.gettempdir())
    assert modes["."] == "0o700" and len(modes) > 1
    assert all(mode == "0o600" for name, mode in modes.items() if name != "."), modes
    assert not os.path.exists(folder)  # removed at the end


def test_cli_restarts_after_a_failure(tmp_path):
    script = write(
        tmp_path / "flaky.py",
        """
        import os, sys
        import torch.distributed as dist

        dist.init_process_group("gloo")
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        if attempt == "0" and dist.get_rank() == 1:
            raise RuntimeError("transient failure")
        dist.barrier()
        if dist.get_rank() == 0:
            sys.stdout.write(f"done on attempt {attempt}\\n")
        """,
    )
    proc = subprocess.run(
        [sys.executable, "-m", "autoddp.cli", "-n", "2", "--max-restarts", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done on attempt 1"
