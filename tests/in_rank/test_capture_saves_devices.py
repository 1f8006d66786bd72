"""Saves onto a path that is not a regular file (issue 38, item 0): a device, a FIFO, a link to one.

``torch.save(sd, os.devnull)`` is a common way to time a save. autoddp's atomic write (a temporary
file renamed over the path) once replaced such a path by a regular file: the machine's
``/dev/null`` became a file. Such a path is written as one process writes it, once (by rank 0),
in place, and stays what it was. Tested on a null device and a FIFO made in a temporary folder,
never on the machine's own ``/dev/null``; real 2-process gloo runs under the command.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import select
import stat
import subprocess
import sys
import threading

import psutil
import pytest
import torch

from conftest import run_python, write

SAVES_TO_SPECIAL_FILES = """
    import os, sys, torch, torch.distributed as dist
    import autoddp
    from torch import nn
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for name in sys.argv[1:]:
        torch.save(model.state_dict(), name)
        autoddp.save(model, name)  # autoddp's own save: the same rule
        print("SAVED", dist.get_rank(), name, flush=True)
    torch.save({"after": 1}, "best.pt")  # the ranks still pair their saves of regular files
    print("LOADED", dist.get_rank(), torch.load("best.pt")["after"], flush=True)
"""


def _tagged(output: str, tag: str) -> list[list[str]]:
    return sorted(line.split(tag, 1)[1].split() for line in output.splitlines() if tag in line)


def _null_device(path) -> None:
    """A null device (major 1, minor 3) at ``path``: skipped where this user may not make one."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    except OSError as error:
        if error.errno in (errno.EPERM, errno.EACCES):
            pytest.skip(f"cannot make a device node here: {error}")
        raise


class _Reader:
    """Everything written to a FIFO while the run lasts (the read end open from the start, so no
    writer blocks, and nothing blocks this test if the FIFO is replaced)."""

    def __init__(self, path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.data, self.stopping = bytearray(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            stopping = self.stopping.is_set()
            select.select([self.fd], [], [], 0.05)
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(self.fd, 1 << 16):
                    self.data += chunk
            if stopping:
                return

    def close(self) -> bytes:
        self.stopping.set()
        self.thread.join(timeout=30)
        os.close(self.fd)
        return bytes(self.data)


def test_saves_onto_a_device_a_fifo_and_a_link_leave_them_as_they_were(tmp_path):
    _null_device(tmp_path / "null")
    (tmp_path / "null-link").symlink_to(tmp_path / "null")
    os.mkfifo(tmp_path / "pipe")
    reader = _Reader(tmp_path / "pipe")
    script = write(tmp_path / "saves.py", SAVES_TO_SPECIAL_FILES)
    names = ["null", "null-link", "pipe"]
    try:
        command = ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script), *names]
        ran = run_python(command, cwd=tmp_path)
    finally:
        data = reader.close()
    assert ran.returncode == 0, ran.stderr
    null = os.stat(tmp_path / "null")
    assert stat.S_ISCHR(null.st_mode) and null.st_rdev == os.makedev(1, 3)  # a regular file before
    assert (tmp_path / "null-link").is_symlink()
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)
    assert _tagged(ran.stdout, "SAVED") == sorted([str(rank), name] for rank in "01" for name in names)
    assert _tagged(ran.stdout, "LOADED") == [["0", "1"], ["1", "1"]]
    # The FIFO's reader got each save once, from one rank: the torch.save, then autoddp.save.
    assert data.count(b"PK\x05\x06") == 2, len(data)  # (two zip archives: two ends of a directory)
    first = data[: data.index(b"PK\x05\x06") + 22]
    assert set(torch.load(io.BytesIO(first))) == {"weight", "bias"}
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "null", "null-link", "pipe", "saves.py"]


SAVES_TO_STDOUT = """
    import torch
    print("before", flush=True)
    torch.save({"a": 1}, "/dev/stdout")
    print("after", flush=True)
"""


def test_a_save_to_dev_stdout_sent_to_a_file_keeps_that_file(tmp_path):
    script = write(tmp_path / "to_stdout.py", SAVES_TO_STDOUT)
    out = tmp_path / "out.bin"
    with open(out, "wb") as file:
        inode = os.fstat(file.fileno()).st_ino
        ran = subprocess.run(
            [sys.executable, "-m", "autoddp.cli", "-n", "2", str(script)],
            cwd=tmp_path,
            stdout=file,
            stderr=subprocess.PIPE,
            text=True,
            timeout=90,
        )
    assert ran.returncode == 0, ran.stderr
    assert os.stat(out).st_ino == inode  # a file renamed over it before: "after" went nowhere
    assert b"after" in out.read_bytes()
    assert "torch.save('/dev/stdout'): written once, by rank 0, in place" in ran.stderr
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "to_stdout.py"]


@pytest.mark.unit
def test_atomic_write_writes_a_device_or_a_fifo_in_place_and_replaces_only_regular_files(tmp_path):
    from autoddp.in_rank.checkpoint.files import atomic_write, special

    _null_device(tmp_path / "null")
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "plain.pt").write_bytes(b"old")
    assert [special(tmp_path / name) for name in ("null", "pipe", "plain.pt", "absent.pt")] == [
        True,
        True,
        False,
        False,
    ]
    assert special("/dev/stdout") and special("/dev/fd/1") and special("/proc/self/fd/1")
    reader = _Reader(tmp_path / "pipe")
    try:
        for name in ("null", "pipe", "plain.pt", "absent.pt"):
            atomic_write(str(tmp_path / name), lambda file: torch.save({"a": 1}, file))
    finally:
        data = reader.close()
    assert stat.S_ISCHR(os.stat(tmp_path / "null").st_mode)  # a regular file renamed over it before
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)
    assert torch.load(io.BytesIO(data)) == {"a": 1}
    assert torch.load(tmp_path / "plain.pt") == torch.load(tmp_path / "absent.pt") == {"a": 1}
    assert sorted(os.listdir(tmp_path)) == ["absent.pt", "null", "pipe", "plain.pt"]


@pytest.mark.unit
def test_only_a_plain_open_for_writing_bytes_is_taken():
    from autoddp.in_rank.capture.opens import plain

    assert plain((), {}) and plain((-1, None, None, None), {})  # (pathlib's Path.open)
    assert plain((), {"buffering": -1, "closefd": True})
    assert not plain((0,), {}) and not plain((), {"opener": os.open}) and not plain((), {"closefd": False})
    assert not plain((), {"buffering": True}) and not plain((), {"unknown": 1})


SAVES_TO_A_FIFO_NOBODY_READS_YET = """
    import os, torch
    torch.save({"a": 1}, "pipe")  # rank 0 blocks here, as one process does, until a reader comes
    print("PAST", os.environ["RANK"], flush=True)
"""


def test_a_fifo_with_no_reader_blocks_rank0_alone_and_only_until_it_is_read(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    script = write(tmp_path / "fifo.py", SAVES_TO_A_FIFO_NOBODY_READS_YET)
    command = [sys.executable, "-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script)]
    run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = " "
        while first and "PAST" not in first:  # rank 1 neither waits for rank 0 nor writes the FIFO
            first = run.stdout.readline()
        assert "PAST 1" in first, (first, run.stderr.read() if run.poll() is not None else "")
        with open(tmp_path / "pipe", "rb") as reader:  # rank 0's write goes through now
            data = reader.read()
        out, err = run.communicate(timeout=60)
    finally:
        for process in psutil.Process(run.pid).children(recursive=True) if run.poll() is None else []:
            process.kill()
        run.kill()
        run.wait()
    assert run.returncode == 0, err
    assert "PAST 0" in out
    assert torch.load(io.BytesIO(data)) == {"a": 1} and data.count(b"PK\x05\x06") == 1
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)
