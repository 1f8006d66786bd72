"""The hang report: real 2-process gloo runs (nothing in torch.distributed mocked).

What is asserted is what a user sees on the console: the report names the late rank and shows
its stack (its own function), names the collective the others wait in with its line, says how
long, comes within seconds of ``hang_report``, and the run still ends well with the right result.
And no report where nobody is late (ranks computing, rank 0 busy in a ``rank0()`` block).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import free_port

from autoddp import ConfigurationError, distributed
from autoddp.in_rank.hang import record
from autoddp.launch.hang import message, stacks, verdict
from autoddp.launch.hang.watch import Watch
from conftest import write

pytestmark = pytest.mark.timeout(120)


class Run:
    """A finished process with the moment each line of its output arrived.

    ``release``: when a line of its stderr contains this text, ``released`` is written in ``cwd``.
    The late rank of these scripts waits for that file (``while not os.path.exists("released")
    ...``, one line, so its stack names that line), not for a fixed time, so that no test sleeps
    longer than the report takes.
    """

    def __init__(self, args: list[str], cwd, timeout: float = 90, release: str = "hang report") -> None:
        self.started = time.monotonic()
        self.release, self.released = release, pathlib.Path(cwd) / "released"
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        readers = [
            threading.Thread(target=self._read, args=(proc.stdout, self.out)),
            threading.Thread(target=self._read, args=(proc.stderr, self.err, self._release)),
        ]
        for reader in readers:
            reader.start()
        try:
            self.code = proc.wait(timeout=timeout)
        finally:
            proc.kill()
            for reader in readers:
                reader.join()

    @staticmethod
    def _read(stream, lines: list[tuple[float, str]], seen=None) -> None:
        for line in stream:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if seen is not None:
                seen(line)

    def _release(self, line: str) -> None:
        if self.release in line:
            self.released.touch()

    @property
    def stdout(self) -> str:
        return "\n".join(line for _, line in self.out)

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.err)

    def when(self, lines: list[tuple[float, str]], text: str) -> float:
        """When the first line containing ``text`` arrived."""
        return next(t for t, line in lines if text in line)

    def reports(self) -> list[str]:
        return [line for _, line in self.err if "hang report" in line]


def line_of(path, text: str) -> int:
    """The line number of the first line of ``path`` containing ``text``."""
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


DECORATED_LATE_RANK = """
    import os, time
    import torch, torch.distributed as dist
    import autoddp


    def slow():  # rank 1 is late
        deadline = time.monotonic() + 30
        while not os.path.exists("released") and time.monotonic() < deadline: time.sleep(0.1)


    @autoddp.distributed(nproc=2, backend="gloo", hang_report=4)
    def train():
        if autoddp.rank() == 1:
            slow()
        print("rank 0 enters the all_reduce", flush=True)
        t = torch.ones(1) * (autoddp.rank() + 1)
        dist.all_reduce(t)
        return t.item()


    print("result", train())
"""

TORCHRUN_STYLE_LATE_RANK = """
    import os, time
    import torch, torch.distributed as dist


    def slow():  # rank 1 is late
        deadline = time.monotonic() + 30
        while not os.path.exists("released") and time.monotonic() < deadline: time.sleep(0.1)


    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        slow()
    print(f"rank {dist.get_rank()} enters the all_reduce", flush=True)
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print("result", t.item(), flush=True)
    dist.destroy_process_group()
"""


def _check_late_rank_report(run: Run, script) -> None:
    assert run.code == 0, run.stderr
    assert "result 3.0" in run.stdout
    reports = run.reports()
    assert len(reports) == 1, run.stderr  # once: it repeats only minutes later
    all_reduce = line_of(script, "dist.all_reduce(t)")
    assert f"rank 1 has not arrived; rank 0 waits in all_reduce at job.py:{all_reduce}" in reports[0]
    after = run.when(run.err, "hang report") - run.when(run.out, "rank 0 enters the all_reduce")
    assert 4 <= after < 10, after  # not before hang_report, well within ~10 s
    report = run.stderr.split("hang report", 1)[1].splitlines()
    late = next(n for n, line in enumerate(report) if "rank 1: in no collective for" in line)
    assert "its stack, your code first" in report[late]
    sleeping = f"autoddp:     job.py:{line_of(script, 'time.sleep(0.1)')} in slow"
    assert report[late + 1] == sleeping  # the sleeping function, first
    assert any("nothing is stopped" in line for line in report)


def test_a_late_rank_is_named_with_its_stack_and_the_run_completes(tmp_path):
    script = write(tmp_path / "job.py", DECORATED_LATE_RANK)
    run = Run([str(script)], cwd=tmp_path)
    _check_late_rank_report(run, script)
    assert "autoddp/" not in run.stderr  # autoddp's own frames are not the user's business


def test_the_command_reports_a_late_rank_of_a_torchrun_style_script(tmp_path):
    script = write(tmp_path / "job.py", TORCHRUN_STYLE_LATE_RANK)
    run = Run(["-m", "autoddp.cli", "-n", "2", "--hang-report", "4", str(script)], cwd=tmp_path)
    _check_late_rank_report(run, script)


def test_ranks_that_all_compute_get_no_report(tmp_path):
    script = write(
        tmp_path / "job.py",
        """
        import time
        import torch, autoddp

        @autoddp.distributed(nproc=2, backend="gloo", hang_report=3)
        def train():
            autoddp.barrier()
            x, deadline = torch.randn(64, 64), time.monotonic() + 7
            while time.monotonic() < deadline:  # 7 s of work on every rank, no collective
                x = torch.tanh(x @ x)
            autoddp.barrier()
            return "done"

        print("result", train())
        """,
    )
    run = Run([str(script)], cwd=tmp_path)
    assert run.code == 0, run.stderr
    assert "result done" in run.stdout
    assert run.reports() == [] and "wait" not in run.stderr, run.stderr


def test_ranks_waiting_for_rank0s_block_are_told_so_not_reported_lost(tmp_path):
    script = write(
        tmp_path / "job.py",
        """
        import os, time
        import torch, torch.distributed as dist
        import autoddp

        def evaluate():  # a long evaluation on rank 0
            deadline = time.monotonic() + 8
            while not os.path.exists("released") and time.monotonic() < deadline: time.sleep(0.1)

        @autoddp.distributed(nproc=2, backend="gloo", hang_report=3)
        def train():
            with autoddp.rank0():
                evaluate()
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()

        print("result", train())
        """,
    )
    run = Run([str(script)], cwd=tmp_path, release="waits for rank 0's rank0() block")
    assert run.code == 0, run.stderr
    assert "result 2.0" in run.stdout
    block = line_of(script, "with autoddp.rank0():")
    said = [line for _, line in run.err if "wait" in line]
    assert len(said) == 1, run.stderr
    expected = f"autoddp: rank 1 waits for rank 0's rank0() block at job.py:{block} (rank 0 has been running"
    assert said[0].startswith(expected), said
    assert run.reports() == [] and "not arrived" not in run.stderr


def test_a_rank_late_for_ddps_gradient_all_reduce_is_named(tmp_path):
    script = write(
        tmp_path / "job.py",
        """
        import os, time
        import torch, autoddp

        def late():
            deadline = time.monotonic() + 10
            while not os.path.exists("released") and time.monotonic() < deadline: time.sleep(0.1)

        @autoddp.distributed(nproc=2, backend="gloo", hang_report=3)
        def train():
            model = autoddp.prepare(torch.nn.Linear(4, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                loss = model(torch.ones(8, 4)).sum()
                if step == 1 and autoddp.rank() == 1:
                    late()
                opt.zero_grad()
                loss.backward()
                opt.step()
            return [p.detach().sum().item() for p in model.parameters()]

        print("result", train())
        """,
    )
    run = Run([str(script)], cwd=tmp_path)
    assert run.code == 0, run.stderr
    assert "result [" in run.stdout
    backward = line_of(script, "loss.backward()")
    (report,) = run.reports()
    waits = f"rank 0 waits in DDP's gradient all-reduce in backward() at job.py:{backward}"
    assert f"rank 1 has not arrived; {waits}" in report
    assert f"job.py:{line_of(script, 'time.sleep(0.1)')} in late" in run.stderr


def test_hang_report_0_turns_it_off_and_bad_values_are_clear_errors(tmp_path):
    script = write(tmp_path / "job.py", DECORATED_LATE_RANK.replace("hang_report=4", "hang_report=0"))
    write(script, script.read_text().replace("+ 30", "+ 6"))  # no report to wait for: 6 s
    run = Run([str(script)], cwd=tmp_path)
    assert run.code == 0 and "result 3.0" in run.stdout, run.stderr
    assert run.reports() == []
    for bad in (-1, "60", True, float("nan")):
        with pytest.raises(ConfigurationError, match="hang_report=.* must be a number of seconds >= 0"):
            distributed(hang_report=bad)
    cli = subprocess.run(
        [sys.executable, "-m", "autoddp.cli", "--hang-report", "-1", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2 and "--hang-report" in cli.stderr


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_across_nodes_node0_names_the_late_rank_or_each_node_reports_its_own(
    tmp_path, monkeypatch, rendezvous
):
    """static: node 0 combines every node's records (through the rendezvous store) and names rank
    1, on node 1, with its stack; c10d: each node reports its own ranks."""
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    script = write(tmp_path / "job.py", TORCHRUN_STYLE_LATE_RANK)
    endpoint = f"127.0.0.1:{free_port()}"
    runs: list[Run] = []

    def node(rank: int) -> None:
        if rendezvous == "static":
            where = ["--node-rank", str(rank), "--master", endpoint]
        else:
            where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        args = ["-m", "autoddp.cli", "--nnodes", "2", *where, "-n", "1", "--hang-report", "3", str(script)]
        runs.append(Run(args, cwd=tmp_path))

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(run.code == 0 for run in runs), [run.stderr for run in runs]
    assert all("result 3.0" in run.stdout for run in runs)
    node0 = next(run for run in runs if "rank 0 enters the all_reduce" in run.stdout)
    node1 = next(run for run in runs if run is not node0)
    (report,) = node0.reports()
    all_reduce = line_of(script, "dist.all_reduce(t)")
    if rendezvous == "static":
        waits = f"rank 0 waits in all_reduce at job.py:{all_reduce}"
        assert f"hang report (all nodes): rank 1 has not arrived; {waits}" in report
        assert f"job.py:{line_of(script, 'time.sleep(0.1)')} in slow" in node0.stderr  # from node 1
    else:
        assert f"hang report (this node): rank 0 waits in all_reduce at job.py:{all_reduce}" in report
        assert "every rank of this node waits, for ranks that run on other nodes" in report
    assert node1.reports() == []  # rank 1, alone on node 1, waits for nobody; node 0 reports


# --- the pieces, without processes: the dump's parsing, the verdict, the repeat policy -----------


@pytest.mark.unit
def test_the_main_threads_frames_are_read_from_a_real_faulthandler_dump(tmp_path):
    import faulthandler

    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)  # another thread, whose stack must not be taken
    helper.start()
    try:
        with open(tmp_path / "dump", "w") as dump:
            faulthandler.dump_traceback(dump, all_threads=True)
    finally:
        stop.set()
        helper.join()
    frames = stacks.main_thread((tmp_path / "dump").read_text(), threading.main_thread().ident)
    assert frames[0].function == "test_the_main_threads_frames_are_read_from_a_real_faulthandler_dump"
    assert frames[0].shown().startswith("test_hang.py:")
    assert all(f.function != "wait" for f in frames)  # the helper thread's frames are not there
    user, inner = stacks.users_first(frames)
    assert user[0] == frames[0] and inner == []
    assert not any(f.user for f in frames if "/_pytest/" in f.path or "/pluggy/" in f.path)


def _rec(rank, kind=record.OUTSIDE, since=0.0, name="all_reduce", site="", world=2, local=None, sequence=1):
    return record.Record(
        pid=0,
        rank=rank,
        world_size=world,
        local_rank=rank if local is None else local,
        thread=0,
        sequence=sequence,
        flags=record.ACTIVE,
        kind=kind,
        name=record.NAMES.index(name),
        since=since,
        site=site,
    )


@pytest.mark.unit
def test_the_verdict_on_what_the_records_say():
    judge = verdict.judge
    block = "the rank0() block at /home/me/train.py:88"
    # everybody computes, or waits less than hang_report: nothing
    assert judge({0: _rec(0), 1: _rec(1)}, 2, now=100, seconds=60) == []
    assert judge({0: _rec(0, record.COLLECTIVE, since=50), 1: _rec(1)}, 2, now=100, seconds=60) == []
    # rank 0 waits, rank 1 is elsewhere: rank 1 is late
    (late,) = judge({0: _rec(0, record.COLLECTIVE, since=30), 1: _rec(1)}, 2, now=100, seconds=60)
    assert late.kind == verdict.LATE and [r.rank for r in late.late] == [1]
    # a rank that is not running the user's code is late too
    (gone,) = judge({0: _rec(0, record.COLLECTIVE, since=30), 1: None}, 2, now=100, seconds=60)
    assert gone.kind == verdict.LATE and gone.absent == (1,)
    # rank 0 runs the block the others wait for: rank 0 is busy, not lost
    busy = {0: _rec(0, record.RUNS_RANK0, 10, site=block), 1: _rec(1, record.WAITS_FOR_RANK0, 10, site=block)}
    (situation,) = judge(busy, 2, now=100, seconds=60)
    assert situation.kind == verdict.RANK0_BUSY
    assert message.lines(situation, {}, 100, 60, 180) == [
        "rank 1 waits for rank 0's rank0() block at train.py:88 "
        "(rank 0 has been running it for 90.0 s: not a hang)"
    ]
    # ... but a rank 0 elsewhere while they wait for its block is late (and here each waits for the other)
    stuck, other = judge({**busy, 0: _rec(0, record.COLLECTIVE, 10)}, 2, now=100, seconds=60)
    assert stuck.kind == verdict.LATE and stuck.late[0].rank == 0
    assert other.kind == verdict.LATE and other.late[0].rank == 1
    # everybody in a collective: of different names, they do not match; of the same, the stacks tell
    (mismatch,) = judge(
        {0: _rec(0, record.COLLECTIVE, 10), 1: _rec(1, record.COLLECTIVE, 10, name="barrier")}, 2, 100, 60
    )
    assert mismatch.kind == verdict.MISMATCH
    frames = {0: [stacks.Frame("/me/a.py", 3, "f")], 1: [stacks.Frame("/me/a.py", 9, "g")]}
    assert message.lines(mismatch, frames, 100, 60, 180)[0] == (
        "hang report: the ranks wait in collectives that do not match: rank 0 waits in all_reduce at "
        "a.py:3 in f, for 90.0 s; rank 1 waits in barrier at a.py:9 in g, for 90.0 s. Every rank must "
        "call the same collectives in the same order"
    )
    together = {0: _rec(0, record.COLLECTIVE, 10), 1: _rec(1, record.COLLECTIVE, 10)}
    assert [s.kind for s in judge(together, 2, 100, 60)] == [verdict.TOGETHER]


@pytest.mark.unit
def test_the_ranks_of_an_unreachable_node_are_named_as_lost_not_by_their_last_record():
    # node 0's view of every node: rank 1's node is lost, so its record is dropped (absent)
    (gone,) = verdict.judge({0: _rec(0, record.COLLECTIVE, since=30), 1: None}, 2, now=100, seconds=60)
    lost = message.Lost(ranks={1: "node 1 of 2 unreachable since 18:20:34 (12 s)"})
    said = message.lines(gone, {}, 100, 60, 180, "all nodes", lost)
    assert said[1:] == [
        "  rank 1: node 1 of 2 unreachable since 18:20:34 (12 s), so what it does is not known "
        "(a network partition, or that machine stalls)",
        "  nothing is stopped: the run goes on if the unreachable nodes answer again before the "
        "collective's timeout; this report repeats at most every 3 minutes while this lasts "
        "(hang_report=60 s; 0 turns it off)",
    ]
    assert "not running your code" not in " ".join(said)
    # another node's own view: every rank of it waits, and node 0 cannot be heard from
    (together,) = verdict.judge({0: _rec(1, record.COLLECTIVE, 10, local=0)}, 1, 100, 60)
    lost = message.Lost(nodes=("node 0 of 2 unreachable since 18:20:33 (13 s)",))
    said = message.lines(together, {}, 100, 60, 180, "node 1 of 2", lost)
    assert said[1] == (
        "  node 0 of 2 unreachable since 18:20:33 (13 s): its ranks cannot reach this node's "
        "(a network partition, or that machine stalls)"
    )


@pytest.mark.unit
def test_ranks_are_written_as_ranges():
    assert message._ranks([1]) == "rank 1"
    assert message._ranks([3, 1, 2, 7, 5, 6, 9, 10]) == "ranks 1..3, 5..7, 9, 10"


@pytest.mark.unit
def test_a_situation_is_reported_once_then_at_most_every_repeat_and_anew_when_it_changes(tmp_path):
    """The watch's policy, on real record files (the workers' side written by hand)."""
    said: list[str] = []
    writers = [record.Writer(record.record_path(str(tmp_path), r), r, 2, r) for r in range(2)]

    def state(rank, kind, since, sequence):
        at, active = record.STATE_OFFSET, record.ACTIVE
        record.STATE.pack_into(writers[rank].map, at, sequence, active, kind, 4, since)

    watch = Watch(str(tmp_path), 2, seconds=5, repeat=100, emit=said.append)
    now = time.monotonic()
    state(0, record.COLLECTIVE, now - 6, 1)
    state(1, record.OUTSIDE, now - 6, 1)
    watch.tick(now)
    assert sum("hang report" in line for line in said) == 1
    assert "  rank 1: in no collective for 6.0 s; its stack could not be read" in said
    watch.tick(now + 50)
    assert sum("hang report" in line for line in said) == 1  # the same situation: not again so soon
    watch.tick(now + 101)
    assert sum("hang report" in line for line in said) == 2  # it lasts: again after `repeat`
    state(0, record.COLLECTIVE, now + 95, 3)  # a new collective (the late rank came, then late again)
    watch.tick(now + 101)
    assert sum("hang report" in line for line in said) == 3
    for writer in writers:
        writer.close()


DUMPS_ON_SIGNAL = """
import faulthandler, signal, sys, threading, time
dump = open(sys.argv[1], "w")
faulthandler.register(signal.SIGUSR2, file=dump, all_threads=True, chain=False)
for _ in range(40):  # a long dump: 41 threads' stacks
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
blocker = threading.Thread(target=lambda: (signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2}),
                                           time.sleep(600)), daemon=True)
blocker.start()  # a thread that always blocks the signal must not make the wait endless
print("ready", flush=True)
time.sleep(600)
"""


def test_a_dump_is_read_once_the_handler_has_run_not_when_the_file_looks_still(tmp_path):
    """The launcher's wait for a worker's stacks ends when the signal was handled: the whole
    dump is there, every thread's stack, however slowly the handler wrote it."""
    dump = tmp_path / "dump"
    child = subprocess.Popen(
        [sys.executable, "-c", DUMPS_ON_SIGNAL, str(dump)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        before = stacks._signal_state(child.pid, signal.SIGUSR2)[1]
        assert len(before) == 1  # the blocker
        os.kill(child.pid, signal.SIGUSR2)
        while not stacks._handled(child.pid, signal.SIGUSR2, before) or not dump.read_text():
            time.sleep(0.001)
        text = dump.read_text()
        assert text.count("Thread 0x") + text.count("Current thread 0x") == 42, text
        assert text.endswith("\n")
    finally:
        child.kill()
        child.wait()


@pytest.mark.unit
def test_a_ranks_stack_dump_leaves_out_the_hang_pollers_thread(tmp_path):
    """The caller drops the poller's thread from a rank's dump by the function the record names
    (``record.POLLER``), without importing the rank's poller: a real faulthandler dump of a
    process whose poller runs keeps the main thread and loses the poller's."""
    import faulthandler

    from autoddp.in_rank.hang import pending, record
    from autoddp.launch.failures import _without_our_threads

    poller = pending.Pending()
    poller.start(writer=None)
    try:
        time.sleep(0.05)
        with open(tmp_path / "dump", "w+") as dump:
            faulthandler.dump_traceback(dump, all_threads=True)
            dump.seek(0)
            text = dump.read()
    finally:
        poller.stop()
    assert f" in {record.POLLER}\n" in text  # the dump holds the poller's thread
    kept = _without_our_threads(text)
    assert record.POLLER not in kept and "test_a_ranks_stack_dump_leaves_out_the_hang_pollers_thread" in kept
