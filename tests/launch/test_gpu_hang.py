"""The hang report on NCCL's terms, proven on CPU: a collective counts until it completes.

NCCL's collectives return to Python once queued on the GPU; gloo's asynchronous work objects
(``async_op=True``) behave alike: the call returns, the collective completes later (or never,
while a rank is late). One real 2-process gloo run checks that the report names the late rank
and the one waiting in the all_reduce it started (not in any call any more), and that a rank
aborted while it waits (``os.abort()``: NCCL's watchdog's SIGABRT) gives an error naming the late
rank and where it was. The pure parts (the record's pending slot, the verdict on it, the tokens'
bookkeeping) are checked in-process, fed the facts; the CUDA path (a CUDA event recorded after a
synchronous collective or DDP's backward on CUDA tensors) with a stand-in for torch.cuda.Event.
"""

from __future__ import annotations

import os
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist
from test_hang import Run, line_of

from autoddp.core import _backward
from autoddp.in_rank.hang import marks as hang_marks
from autoddp.in_rank.hang import pending, record
from autoddp.launch.hang import verdict
from conftest import write

pytestmark = pytest.mark.timeout(120)

ASYNC_LATE_THEN_ABORT = """
    import os, sys, time
    import torch, torch.distributed as dist
    import autoddp


    def slow(seconds):
        time.sleep(seconds)  # rank 1 is late


    def poll(work):
        while not work.is_completed():  # rank 0 waits, but in no marked collective
            time.sleep(0.05)


    def watchdog():
        time.sleep(1)  # as NCCL's watchdog after its timeout
        os.abort()


    @autoddp.distributed(nproc=2, backend="gloo", hang_report=2)
    def late():
        if autoddp.rank() == 1:
            slow(4)
        print("rank 0 starts the all_reduce", flush=True)
        t = torch.ones(1) * (autoddp.rank() + 1)
        work = dist.all_reduce(t, async_op=True)
        poll(work)
        work.wait()
        return t.item()


    @autoddp.distributed(nproc=2, backend="gloo", hang_report=60)
    def aborted():
        if autoddp.rank() == 1:
            slow(60)
        t = torch.ones(1)
        work = dist.all_reduce(t, async_op=True)  # rank 1 never comes
        watchdog()


    print("result", late(), flush=True)
    try:
        aborted()
    except autoddp.WorkerError as error:
        print("error", type(error).__name__, error.rank, error.signal, flush=True)
        print("\\n".join(getattr(error, "__notes__", [])), flush=True)
"""


def test_a_rank_waiting_for_its_queued_collective_is_seen_and_an_abort_names_the_late_rank(tmp_path):
    script = write(tmp_path / "job.py", ASYNC_LATE_THEN_ABORT)
    run = Run([str(script)], cwd=tmp_path)
    assert run.code == 0, run.stderr
    assert "result 3.0" in run.stdout, run.stdout + run.stderr
    # The run that completes: one report, rank 1 late in slow(), rank 0 in the all_reduce it started.
    reports = run.reports()
    assert len(reports) == 1, run.stderr
    call = line_of(script, "work = dist.all_reduce(t, async_op=True)")
    waits = f"rank 0 waits in all_reduce at job.py:{call} in late (called, not completed)"
    assert f"rank 1 has not arrived; {waits}" in reports[0], reports
    after = run.when(run.err, "hang report") - run.when(run.out, "rank 0 starts the all_reduce")
    assert 2 <= after < 4, after
    report = run.stderr.split("hang report", 1)[1].splitlines()
    late = next(n for n, line in enumerate(report) if "rank 1: in no collective for" in line)
    assert report[late + 1] == f"autoddp:     job.py:{line_of(script, 'time.sleep(seconds)')} in slow"
    # The aborted run: rank 0's SIGABRT, and the notes name rank 1 as late, with its stack.
    assert "error WorkerError 0 SIGABRT" in run.stdout, run.stdout
    never = line_of(script, "rank 1 never comes")
    died = f"rank 0 died while it waited in all_reduce at job.py:{never} in aborted (called, not completed)"
    assert died in run.stdout, run.stdout
    assert "rank 1 had not arrived (in no collective). NCCL's watchdog aborts a rank (SIGABRT)" in run.stdout
    where = run.stdout.split("where rank 1 was when stopped", 1)[1]
    assert f'job.py", line {line_of(script, "time.sleep(seconds)")} in slow' in where, where


class FakeWriter:
    """Records what the poller would write into the mapped record."""

    def __init__(self) -> None:
        self.written: list[tuple] = []

    def pending(self, number: int, name: int, since: float, site) -> None:
        self.written.append((number, name, since, site))


@pytest.mark.unit
def test_tokens_are_dropped_in_order_as_they_complete_and_the_oldest_pending_is_shown():
    waits = pending.Pending()
    writer = FakeWriter()
    waits.writer = writer
    works = [dist.Work() for _ in range(3)]  # not completed (a work object nobody completes)
    for index in range(3):
        waits.work(index, 10.0 + index, works[index])
    waits.work(0, 20.0, None)  # a synchronous call's None: nothing to watch
    assert [token[2] for token in waits.tokens] == [0, 1, 2]
    waits.poll()
    _, name, since, site = writer.written[-1]
    assert (name, since) == (0, 10.0) and site is not None and site[0] == __file__
    del works[0]  # let go of by the user: no longer watched, and its tensors are free
    waits.poll()
    assert writer.written[-1][1:3] == (1, 11.0)
    waits.poll()  # nothing changed: nothing written
    assert len(writer.written) == 2
    works.clear()
    waits.poll()
    assert writer.written[-1] == (0, 0, 0.0, None) and not waits.tokens
    # A CPU tensor leaves no CUDA event (only CUDA tensors follow the stream)
    waits.after_cuda(0, 1.0, (torch.ones(1),), {})
    assert not waits.tokens
    # A work object that never says it completed keeps memory bounded: the oldest tokens go
    never = dist.Work()
    for _ in range(pending.MAX_TOKENS + 10):
        waits.work(0, 1.0, never)
    assert len(waits.tokens) == pending.MAX_TOKENS


@pytest.mark.unit
def test_a_record_with_a_pending_collective_is_judged_waiting_in_it(tmp_path):
    path = record.record_path(str(tmp_path), 0)
    writer = record.Writer(path, 0, 2, 0)
    now = time.monotonic()
    record.STATE.pack_into(writer.map, record.STATE_OFFSET, 7, record.ACTIVE, record.OUTSIDE, 0, now - 1)
    writer.site("the rank0() block at /x/train.py:88")
    all_reduce = record.NAMES.index("all_reduce")
    writer.pending(3, all_reduce, now - 30, ("/x/train.py", 12, "step"))
    rec = record.read(path)
    assert rec is not None and rec.site == "the rank0() block at /x/train.py:88"
    judged = record.judged(rec)
    assert judged.kind == record.QUEUED and judged.in_collective and judged.what == "all_reduce"
    assert judged.since == now - 30 and record.pending_frame(judged) == ("/x/train.py", 12, "step")
    other = record.Record(os.getpid(), 1, 2, 1, 0, 5, record.ACTIVE, record.OUTSIDE, 0, now - 40)
    (situation,) = verdict.judge({0: rec, 1: other}, 2, now, 10)
    assert situation.kind == verdict.LATE and [r.rank for r in situation.late] == [1]
    writer.pending(0, 0, 0.0, None)  # completed: outside again, nobody waits
    assert record.judged(record.read(path)).kind == record.OUTSIDE
    assert verdict.judge({0: record.read(path), 1: other}, 2, now, 10) == []
    writer.close()


class FakeEvent:
    """Stands in for torch.cuda.Event on this CPU machine: completes when the test says so."""

    recorded = 0

    def __init__(self) -> None:
        self.done = False

    def record(self) -> None:
        FakeEvent.recorded += 1
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.mark.unit
def test_on_cuda_a_sync_collective_and_ddps_backward_wait_until_their_stream_event_completes(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    marks = hang_marks.Marks()
    path = record.record_path(str(tmp_path), 0)
    writer = record.Writer(path, 0, 2, 0)
    marks.writer, marks.map, marks.thread = writer, writer.map, threading.get_ident()
    marks.flags = record.ACTIVE | record.HAS_DDP
    marks.pending.writer, marks.pending.cuda = writer, True
    on_gpu = types.SimpleNamespace(is_cuda=True)  # a CUDA tensor, as far as the marks look
    all_reduce = marks._collective(record.NAMES.index("all_reduce"), lambda tensor: None)
    calls = _backward.BackwardCalls()  # (the one wrapper of torch.autograd.backward, marks watching)
    calls.registered = (marks,)
    calls.listen(marks, True)

    def queued(
        tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None
    ):
        return None  # (torch.autograd.backward's parameters: the wrapper takes them)

    backward = calls._wrap(queued)
    all_reduce(on_gpu)  # returned at once, as NCCL's all_reduce does once queued
    backward(on_gpu)  # as DDP's backward() returns with its all-reduce queued
    assert FakeEvent.recorded == 2 and len(marks.pending.tokens) == 2
    marks.pending.poll()
    rec = record.judged(record.read(path))
    assert rec.kind == record.QUEUED and rec.what == "all_reduce"
    assert record.pending_frame(rec)[:1] == (__file__,)
    marks.pending.tokens[0][1].done = True  # the stream passed the all_reduce
    marks.pending.poll()
    rec = record.judged(record.read(path))
    assert rec.what == "DDP's gradient all-reduce in backward()" and rec.kind == record.QUEUED
    marks.pending.tokens[0][1].done = True
    marks.pending.poll()
    assert record.judged(record.read(path)).kind == record.OUTSIDE
    assert len(marks.pending.events) == 2  # the events are reused, not made anew
    all_reduce(torch.ones(1))  # a CPU tensor (gloo) completes in its call: no event
    assert FakeEvent.recorded == 2 and not marks.pending.tokens
    writer.close()


TORCHRUN_STYLE_ABORT = """
    import os, time
    import torch, torch.distributed as dist


    def slow():
        time.sleep(60)  # rank 1 is late


    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        slow()
    work = dist.all_reduce(torch.ones(1), async_op=True)
    time.sleep(1)
    os.abort()  # as NCCL's watchdog does after its timeout
"""


def test_the_command_prints_which_rank_an_aborted_rank_waited_for(tmp_path):
    script = write(tmp_path / "job.py", TORCHRUN_STYLE_ABORT)
    run = Run(["-m", "autoddp.cli", "-n", "2", str(script)], cwd=tmp_path)
    assert run.code == 1
    said = [line for _, line in run.err if line.startswith("autoddp:")]
    assert said[0].startswith("autoddp: rank 0 of 2 (pid "), said
    assert "was killed by SIGABRT" in said[0] and "NCCL's watchdog" in said[0]
    call = line_of(script, "work = dist.all_reduce")
    assert f"autoddp: rank 0 died while it waited in all_reduce at job.py:{call} in <module>" in said[1]
    assert "rank 1 had not arrived (in no collective)" in said[1]
    assert said[2].startswith("autoddp: where rank 1 was when stopped (in no collective for ")
    assert f'job.py", line {line_of(script, "time.sleep(60)")} in slow' in run.stderr
