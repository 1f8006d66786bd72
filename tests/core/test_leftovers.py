"""Folders a SIGKILLed run leaves (run folder, hang records) are removed by the next start, and
only those: a live run's, one without a marker, another user's or another machine's stay."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import gone

from autoddp.core import _leftovers
from conftest import write

pytestmark = pytest.mark.xdist_group("leftovers")  # sweeps /dev/shm and the temporary folder: one worker

SLEEPER = """
    import os, pathlib, sys, time
    pathlib.Path(sys.argv[1], f"ready-{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(120)
"""


def _start(tmp_path, tmpdir, nproc: int, *args: str) -> subprocess.Popen:
    """``autoddp -n NPROC ARGS`` in a process group of its own, with ``tmpdir`` as its TMPDIR."""
    return subprocess.Popen(
        [sys.executable, "-m", "autoddp.cli", "-n", str(nproc), *args],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmpdir)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _ready(folder, nproc: int, timeout: float = 60) -> list[int]:
    """The pids of the ranks of a sleeper run, once all are running."""
    deadline = time.monotonic() + timeout
    files = [folder / f"ready-{rank}" for rank in range(nproc)]
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)
    return [int(f.read_text()) for f in files]


def _owned_by(pid: int, *bases: str) -> list[str]:
    """The autoddp folders in ``bases`` whose marker names process ``pid``."""
    found = []
    for base in bases:
        for name in os.listdir(base) if os.path.isdir(base) else ():
            marker = os.path.join(base, name, _leftovers.MARKER)
            with contextlib.suppress(OSError, ValueError), open(marker) as handle:
                if name.startswith(_leftovers.PREFIX) and json.load(handle)["pid"] == pid:
                    found.append(os.path.join(base, name))
    return found


@pytest.mark.timeout(120)
def test_the_next_start_removes_a_killed_runs_folders_and_keeps_a_live_runs(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    (tmpdir / "autoddp-no-marker").mkdir()  # not made by this autoddp: never removed
    script = write(tmp_path / "sleeper.py", SLEEPER)
    quick = write(tmp_path / "quick.py", "print('done')\n")
    (tmp_path / "killed").mkdir()
    (tmp_path / "live").mkdir()
    killed = _start(tmp_path, tmpdir, 2, str(script), str(tmp_path / "killed"))
    live = _start(tmp_path, tmpdir, 1, str(script), str(tmp_path / "live"))
    bases, second = (str(tmpdir), "/dev/shm"), None
    try:
        killed_workers, _ = _ready(tmp_path / "killed", 2), _ready(tmp_path / "live", 1)
        os.killpg(killed.pid, signal.SIGKILL)  # the command and its workers: no cleanup runs
        killed.communicate(timeout=30)
        assert gone(killed_workers)
        left = _owned_by(killed.pid, *bases)
        assert len(left) == 2, left  # its run folder and its hang records stayed
        live_folders = _owned_by(live.pid, *bases)
        assert len(live_folders) == 2, live_folders

        second = _start(tmp_path, tmpdir, 1, str(quick))
        out, err = second.communicate(timeout=60)
        assert second.returncode == 0, err
        assert "done" in out

        assert not any(os.path.exists(path) for path in left), left
        assert all(os.path.isdir(path) for path in live_folders)  # the live run keeps its folders
        assert (tmpdir / "autoddp-no-marker").is_dir()
        live.send_signal(signal.SIGINT)  # a clean stop: the run removes its own folders
        live.communicate(timeout=30)
        assert not any(os.path.exists(path) for path in live_folders)  # removed by the run itself
    finally:
        for process in (p for p in (killed, live, second) if p is not None):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            for path in _owned_by(process.pid, *bases):
                shutil.rmtree(path, ignore_errors=True)


def _folder(base, **owner) -> str:
    """A folder of this process's, its marker then changed to name ``owner``'s fields."""
    path = _leftovers.make(_leftovers.PREFIX, str(base))
    marker = os.path.join(path, _leftovers.MARKER)
    with open(marker) as handle:
        fields = json.load(handle)
    with open(marker, "w") as handle:
        json.dump({**fields, **owner}, handle)
    return path


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.timeout(30)
def test_only_folders_whose_owner_is_certainly_gone_are_reaped(tmp_path):
    own_start = _leftovers._stat(os.getpid())[1]
    dead = [
        _folder(tmp_path, pid=_dead_pid()),  # exited
        _folder(tmp_path, start=own_start - 1),  # its pid is another process's now
        _folder(tmp_path, boot="an-earlier-boot"),
    ]
    with open(os.path.join(dead[0], "result.pkl"), "wb") as handle:
        handle.write(b"x" * 1000)
    os.mkdir(os.path.join(dead[0], "logs"))
    kept = [
        _folder(tmp_path),  # this process: alive
        _folder(tmp_path, pid=_dead_pid(), host="another-machine"),
        _folder(tmp_path, pid=_dead_pid(), pidns="pid:[1]"),  # another container's
        _folder(tmp_path, pid="not a pid"),
    ]
    (tmp_path / "autoddp-no-marker").mkdir()
    garbage = _folder(tmp_path)
    with open(os.path.join(garbage, _leftovers.MARKER), "w") as handle:
        handle.write("{not json")
    kept.append(garbage)
    (tmp_path / "autoddp-a-file").write_text("")
    os.symlink(dead[1], tmp_path / "autoddp-a-link")
    if os.geteuid() == 0:  # another user's folder, its owner gone
        other = _folder(tmp_path, pid=_dead_pid())
        os.chown(other, 12345, 12345)
        kept.append(other)
    before = set(os.listdir(tmp_path))

    assert _leftovers.reap(str(tmp_path)) == len(dead)
    assert set(os.listdir(tmp_path)) == before - {os.path.basename(p) for p in dead}
    assert _leftovers.reap(str(tmp_path / "missing")) == 0  # never raises


@pytest.mark.timeout(30)
def test_a_process_reaps_a_place_once_not_at_every_folder(tmp_path):
    first = _leftovers.make(_leftovers.PREFIX, str(tmp_path))  # reaps tmp_path
    dead = _folder(tmp_path, pid=_dead_pid())
    second = _leftovers.make(_leftovers.PREFIX, str(tmp_path))
    assert os.path.isdir(dead)  # a decorated call in a loop does not scan the folder each time
    assert all(os.path.isfile(os.path.join(p, _leftovers.MARKER)) for p in (first, second))


@pytest.mark.timeout(120)
def test_sigterm_and_sighup_leave_no_folder(tmp_path):
    # What scancel, a SLURM time limit and docker stop send: the run's folders go with it, as after Ctrl-C.
    script = write(tmp_path / "sleeper.py", SLEEPER)
    runs = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        tmpdir, ready = tmp_path / f"tmp-{sig.name}", tmp_path / f"ready-{sig.name}"
        tmpdir.mkdir()
        ready.mkdir()
        runs[sig] = (tmpdir, ready, _start(tmp_path, tmpdir, 2, str(script), str(ready)))
    for sig, (_tmpdir, ready, process) in runs.items():
        _ready(ready, 2)
        process.send_signal(sig)
    for sig, (tmpdir, _ready_folder, process) in runs.items():
        process.communicate(timeout=60)
        assert process.returncode == -sig, process.returncode  # it died of the signal, as the caller would
        hang = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmpdir)
        assert _owned_by(process.pid, str(tmpdir), hang) == []
        assert [n for n in os.listdir(tmpdir) if n.startswith(_leftovers.PREFIX)] == []
