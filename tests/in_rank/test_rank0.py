"""rank0(): real 2-process gloo runs (nothing in torch.distributed mocked), coverage, other Pythons."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from helpers import gather

import autoddp
from autoddp.core.errors import CollectiveInRank0Error, ConfigurationError, Rank0Error
from autoddp.in_rank.rank_zero.block import _KEY_PREFIX, rank0
from conftest import run_python, write

HERE = os.path.dirname(os.path.abspath(__file__))


class CustomError(Exception):
    pass


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text + "\n")


def _rank0_keys(store) -> list[str]:
    """The rank0() outcome keys left in ``store`` (blocks 0-999 and their read counts), by name:
    the store is the launcher's, where other parts of the run (its heartbeat) add keys of their own."""
    names = [f"{_KEY_PREFIX}{n}{suffix}" for n in range(1000) for suffix in ("", "/read")]
    return [name for name in names if store.check([name])]


def _lines(path) -> list[str]:
    return pathlib.Path(path).read_text().splitlines() if os.path.exists(path) else []


def test_body_runs_once_and_every_rank_waits_for_it(tmp_path):
    log, marker = str(tmp_path / "body.log"), str(tmp_path / "marker")

    @autoddp.distributed(nproc=2)
    def train():
        rank = autoddp.rank()
        seen = []
        with rank0():
            _append(log, f"multi-line {rank}")
            seen.append("multi-line")
        with rank0(): seen.append("one-line")  # noqa: E701  # fmt: skip
        dist.barrier()  # both ranks reach the next block together
        start = time.monotonic()
        with rank0():
            time.sleep(0.5)
            _append(marker, f"written by {rank}")
        waited = time.monotonic() - start
        marker_after_block = _lines(marker)

        @rank0
        def decorated(x):
            _append(log, f"decorated {rank}")
            return x * 2

        returned = decorated(21)
        with rank0():
            _append(log, f"outer {rank}")
            with rank0():  # nested: runs inline on rank 0, never entered elsewhere
                _append(log, f"nested {rank}")

        store = dist.distributed_c10d._get_default_store()
        dist.barrier()
        keys_before = _rank0_keys(store)
        dist.barrier()  # every rank counted before rank 0's first block writes its outcome
        count = 0
        start = time.perf_counter()
        for _ in range(200):
            with rank0(): count += 1  # noqa: E701  # fmt: skip
        loop_seconds = time.perf_counter() - start
        dist.barrier()  # the readers have deleted what they read
        keys_after = _rank0_keys(store)
        t = torch.tensor([1.0])
        dist.all_reduce(t)  # collectives are back after the blocks
        return gather(
            {
                "rank": rank,
                "seen": seen,
                "waited": waited,
                "marker": marker_after_block,
                "returned": returned,
                "count": count,
                "keys": (keys_before, keys_after),
                "loop_seconds": loop_seconds,
                "sum": t.item(),
            }
        )

    r0, r1 = train()
    assert _lines(log) == ["multi-line 0", "decorated 0", "outer 0", "nested 0"]
    assert r0["seen"] == ["multi-line", "one-line"] and r1["seen"] == []
    assert r1["waited"] >= 0.4 and r1["marker"] == ["written by 0"]  # rank 1 waited for the body
    assert r0["returned"] == 42 and r1["returned"] is None
    assert r0["count"] == 200 and r1["count"] == 0
    assert r0["keys"] == r1["keys"] == ([], [])  # 200 blocks, no key left
    assert r0["loop_seconds"] < 10 and r1["loop_seconds"] < 10
    assert r0["sum"] == r1["sum"] == 2.0


def test_three_ranks_share_each_outcome_and_clean_up(tmp_path):
    log = str(tmp_path / "body.log")

    # It ran past pytest's 120 s once on CI's loaded machine, and never here (40 runs under load):
    # a rank stuck for 20 s now has the hang report print every rank's stack, and one stuck for
    # 60 s ends the run with its error, so that a next time says where.
    @autoddp.distributed(nproc=3, hang_report=20, timeout=60)
    def train():
        store = dist.distributed_c10d._get_default_store()
        dist.barrier()
        keys_before = _rank0_keys(store)
        dist.barrier()  # every rank looked before rank 0's first block writes its outcome
        for i in range(50):
            with rank0():
                _append(log, f"block {i}")
        try:
            with rank0():
                raise CustomError("third")
        except Exception as exc:
            failure = type(exc).__name__
        dist.barrier()  # both readers have read every outcome; the last one deleted it
        return gather((failure, keys_before, _rank0_keys(store)))

    assert train() == [("CustomError", [], []), ("Rank0Error", [], []), ("Rank0Error", [], [])]
    assert _lines(log) == [f"block {i}" for i in range(50)]


def test_failures_in_the_body_reach_every_rank(tmp_path):
    @autoddp.distributed(nproc=2)
    def train():
        rank = autoddp.rank()
        outcomes = {}
        start = time.monotonic()
        try:
            with rank0():
                raise CustomError("disk full")
        except Exception as exc:
            outcomes["raise"] = [type(exc).__name__, str(exc), getattr(exc, "type_name", None)]
        outcomes["raise_seconds"] = time.monotonic() - start
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.BatchNorm1d(2))
        calls = {
            "_broadcast_coalesced": lambda: ddp(torch.ones(4, 2)),  # DDP's buffer sync
            "all_reduce": lambda: dist.all_reduce(torch.ones(1)),
            "autoddp.barrier": lambda: autoddp.barrier(),
            "broadcast_object_list": lambda: dist.broadcast_object_list([1], src=0),
        }
        for name, call in calls.items():
            try:
                with rank0():
                    call()
            except Exception as exc:
                outcomes[name] = [type(exc).__name__, str(exc)]
        t = torch.ones(1)
        dist.all_reduce(t)  # the real collectives are back
        outcomes["sum"] = t.item()
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(outcomes))
        with rank0():
            raise CustomError("uncaught on rank 0")

    start = time.monotonic()
    with pytest.raises((CustomError, Rank0Error), match="uncaught on rank 0"):
        train()
    assert time.monotonic() - start < 30
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["raise"] == ["CustomError", "disk full", None]
    assert r1["raise"][0] == "Rank0Error" and r1["raise"][2] == f"{__name__}.CustomError"
    assert "failed on rank 0 with" in r1["raise"][1] and "CustomError: disk full" in r1["raise"][1]
    assert r1["raise_seconds"] < 10
    for name in ("_broadcast_coalesced", "all_reduce", "autoddp.barrier", "broadcast_object_list"):
        assert r0[name][0] == CollectiveInRank0Error.__name__, r0[name]
        assert f"{name}() was called inside the rank0() block" in r0[name][1]
        assert "only rank 0 runs that body" in r0[name][1] and "Move the call out" in r0[name][1]
        assert r1[name][0] == "Rank0Error" and "CollectiveInRank0Error" in r1[name][1], r1[name]
    assert r0["sum"] == r1["sum"] == 2.0


def test_a_collective_in_a_rank0_block_is_the_error_the_caller_gets():
    @autoddp.distributed(nproc=2)
    def train():
        with rank0():
            dist.all_reduce(torch.ones(1))

    # (before: rank 1's Rank0Error led, rank 0's cause only listed: its name ends in Rank0Error)
    with pytest.raises(CollectiveInRank0Error, match=r"all_reduce\(\) was called inside the rank0\(\) block"):
        train()


def test_rank0s_failure_leads_when_rank_0_is_slower_to_end_than_the_ranks_it_failed():
    """Rank 1 learns of rank 0's failure at once, raises and ends; the launcher then stops rank 0,
    still in its teardown. The caller gets rank 0's own exception (its record was written before
    the others learned of it), not rank 1's Rank0Error (CI got that under load)."""

    @autoddp.distributed(nproc=2)
    def train():
        try:
            with rank0():
                raise CustomError("the cause")
        finally:
            if autoddp.rank() == 0:
                time.sleep(5)  # rank 0 slow to end

    with pytest.raises(CustomError, match="the cause"):
        train()


def test_a_rank0_failure_rank_0_handled_does_not_lead_a_later_failure_of_another_rank():
    """Rank 0 catches its block's failure and goes on; rank 1 fails later with its own error, and
    the launcher stops rank 0. The caller gets rank 1's error: rank 0's early record of the
    handled failure explains only a Rank0Error for that block."""

    @autoddp.distributed(nproc=2)
    def train():
        with contextlib.suppress(CustomError, Rank0Error), rank0():
            raise CustomError("handled")
        if autoddp.rank() == 1:
            raise ValueError("rank 1's own")
        time.sleep(30)  # rank 0 still working when rank 1 fails: stopped by the launcher

    with pytest.raises(ValueError, match="rank 1's own"):
        train()


@pytest.mark.unit
def test_a_collective_refused_in_rank0_is_a_cause_and_rank0error_a_consequence(tmp_path):
    from autoddp.in_rank.run_folder import transport

    for rank, error in enumerate([CollectiveInRank0Error("all_reduce() in the block"), Rank0Error("failed")]):
        transport.save_error(str(tmp_path), rank, error)
    reports = transport.load_errors(str(tmp_path))
    # (before: CollectiveInRank0Error's name ends in Rank0Error, so it counted as a consequence and
    # rank 1's Rank0Error, written first under load, led the caller's error)
    assert not reports[0].is_consequence and reports[1].is_consequence


def test_ranks_out_of_step_are_named():
    @autoddp.distributed(nproc=2)
    def train():
        if autoddp.rank() == 0:
            with rank0():  # a block only rank 0 passes: the ranks fall out of step
                pass
        with rank0():
            pass

    with pytest.raises(Rank0Error, match=r"out of step: rank 1 is at the rank0\(\) block at .*test_rank0"):
        train()


def test_waiting_ends_with_the_process_group_timeout(tmp_path):
    @autoddp.distributed(nproc=2, timeout=1.5)
    def train():
        with rank0():
            time.sleep(30)  # far past the timeout; autoddp stops rank 0 once rank 1 fails

    start = time.monotonic()
    with pytest.raises(Rank0Error, match=r"rank 1 gave up waiting .* timeout is 0:00:01.5"):
        train()
    assert time.monotonic() - start < 15


@pytest.mark.unit
def test_bodies_that_cannot_be_skipped_are_refused_at_first_use():
    def returns():
        with rank0():
            return 1

    def breaks():
        for _ in range(3):
            with rank0():
                break

    def continues():
        for i in range(3):
            with rank0():
                if i:
                    continue

    def binds():
        with rank0() as handle:
            print(handle)

    for fn, word in [(returns, "return"), (breaks, "break"), (continues, "continue"), (binds, "as handle")]:
        with pytest.raises(ConfigurationError, match=f"`{word}"):
            fn()
        with pytest.raises(ConfigurationError):  # cached per site, still refused
            fn()

    with (
        pytest.raises(ConfigurationError, match="must be entered by a `with` statement"),
        contextlib.ExitStack() as stack,
    ):
        stack.enter_context(rank0())

    with pytest.raises(ConfigurationError, match="generator or async"):

        @rank0
        def gen():
            yield 1

    namespace = {"rank0": rank0}  # no source to read (python -c, exec): allowed
    exec(compile("with rank0() as handle:\n    ran = handle is None\n", "<string>", "exec"), namespace)
    assert namespace["ran"] is True


@pytest.mark.unit
def test_outside_workers_the_body_just_runs():
    ran = []
    with rank0():
        ran.append("block")
    with rank0(): ran.append("one-line")  # noqa: E701  # fmt: skip
    for i in range(3):
        with rank0():
            ran.append(i)

    @rank0
    def add(x, y=1):
        """Add."""
        return x + y

    assert add(1, y=2) == 3 and add.__name__ == "add" and add.__doc__ == "Add."
    with pytest.raises(CustomError, match="plain"), rank0():
        raise CustomError("plain")
    autoddp.barrier()  # a world of 1: collectives are not refused, the body just runs
    assert ran == ["block", "one-line", 0, 1, 2]


def test_module_level_block_in_a_script_run_once_per_rank(tmp_path):
    script = write(
        tmp_path / "job.py",
        """
        import sys
        import torch.distributed as dist
        import autoddp
        from autoddp.in_rank.rank_zero.block import rank0

        dist.init_process_group("gloo")
        with rank0():
            with open(sys.argv[1], "a") as f:
                f.write("body\\n")
        with open(sys.argv[1], "a") as f:
            f.write(f"after {autoddp.rank()}\\n")
        dist.destroy_process_group()
        """,
    )
    log = tmp_path / "log.txt"
    proc = run_python(["-m", "autoddp.cli", "-n", "2", str(script), str(log)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "body" and sorted(lines[1:]) == ["after 0", "after 1"]


COVERAGE_SCRIPT = """
    import os, sys
    import torch.distributed as dist
    import autoddp
    from autoddp.in_rank.rank_zero.block import rank0


    def helper(rank):
        return rank * 2  # helper-line


    @autoddp.distributed(nproc=2, start_method="fork")
    def train(log):
        rank = autoddp.rank()
        with rank0():
            with open(log, "a") as f:  # body-line
                f.write(f"body {rank}\\n")
        after = rank  # after-line
        with rank0(): open(log, "a").write(f"one-line {rank}\\n")  # noqa
        for i in range(20):
            with rank0():
                after += 0  # loop-body-line
            after += 1  # loop-after-line
        if rank == 1:
            helper(rank)  # rank1-line
        try:
            with rank0():
                raise ValueError("boom")  # raise-line
        except Exception as exc:
            caught = type(exc).__name__  # except-line
        dist.barrier()
        return after


    print("result", train(sys.argv[1]))
"""


@pytest.mark.parametrize("core", ["ctrace", "pytrace"])
def test_under_coverage_run_lines_after_the_block_are_recorded(tmp_path, core):
    coverage = pytest.importorskip("coverage")
    script = write(tmp_path / "covered.py", COVERAGE_SCRIPT)
    write(
        tmp_path / ".coveragerc",
        "[run]\nconcurrency = multiprocessing\nparallel = True\ninclude = */covered.py\n",
    )
    log = tmp_path / "log.txt"
    env = {**os.environ, "COVERAGE_CORE": core}
    proc = subprocess.run(
        [sys.executable, "-m", "coverage", "run", str(script), str(log)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    assert "result 20" in proc.stdout
    assert log.read_text().splitlines() == ["body 0", "one-line 0"]

    source = script.read_text().splitlines()
    tag = {n: line.rsplit("# ", 1)[1] for n, line in enumerate(source, 1) if line.rstrip().endswith("-line")}
    by_process = []
    for path in glob.glob(str(tmp_path / ".coverage.*")):
        data = coverage.CoverageData(path)
        data.read()
        (measured,) = data.measured_files() or [""]
        by_process.append({tag[n] for n in data.lines(measured) or [] if n in tag} if measured else set())
    rank1 = [tags for tags in by_process if "rank1-line" in tags]
    rank0_ = [tags for tags in by_process if "body-line" in tags]
    assert len(rank1) == 1 and len(rank0_) == 1, by_process
    # The skipping rank: nothing of the bodies, and every line after the blocks, also in a later call.
    assert rank1[0] == {"after-line", "loop-after-line", "rank1-line", "helper-line", "except-line"}
    assert rank0_[0] == {
        "body-line",
        "after-line",
        "loop-body-line",
        "loop-after-line",
        "raise-line",
        "except-line",
    }


def _other_python(version: str) -> str:
    """An interpreter of ``version`` on this machine: on PATH (``python3.12``), else pyenv's."""
    on_path = shutil.which(f"python{version}")
    if on_path:
        probe = subprocess.run(
            [on_path, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True
        )
        if probe.returncode == 0 and probe.stdout.decode().strip() == str(
            tuple(map(int, version.split(".")))
        ):
            return on_path
    roots = {os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv"), "/root/.pyenv"} - {""}
    paths = sorted(p for root in roots for p in glob.glob(f"{root}/versions/{version}.*/bin/python"))
    return paths[-1] if paths else ""


def _pythons() -> list:
    """This Python, and 3.10, 3.12 and 3.13 where this machine has them (said by -rs where not)."""
    found = [pytest.param(sys.executable, id="this-python")]
    for version in ("3.10", "3.12", "3.13"):
        path = _other_python(version)
        marks = [] if path else [pytest.mark.skip(reason=f"no Python {version} on PATH or in pyenv here")]
        found.append(pytest.param(path, id=version, marks=marks))
    return found


@pytest.mark.parametrize("python", _pythons())
def test_skip_mechanics_on_other_pythons(python):
    """Each case goes first once: the version branches only matter for a process's first skip."""
    script = os.path.join(HERE, "skip_mechanics.py")
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True)
    assert version.returncode == 0 and (python == sys.executable or version.stdout[:4] != sys.version[:4])
    for first in ("one-line", "empty", "thread"):
        proc = subprocess.run([python, script, first], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (first, proc.stdout, proc.stderr)
        assert "skip mechanics ok" in proc.stdout


@pytest.mark.parametrize("core", ["ctrace", "pytrace"])
def test_skip_mechanics_under_coverage(tmp_path, core):
    pytest.importorskip("coverage")
    script = os.path.join(HERE, "skip_mechanics.py")
    # 3.12.1 + coverage (ctrace, pytrace) crashes on a skip in a thread: see in_rank/rank_zero/skip.py.
    firsts = ("one-line", "empty") if sys.version_info[:2] == (3, 12) else ("one-line", "empty", "thread")
    for first in firsts:
        proc = subprocess.run(
            [sys.executable, "-m", "coverage", "run", f"--data-file={tmp_path / 'data'}", script, first],
            env={**os.environ, "COVERAGE_CORE": core},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, (first, proc.stdout, proc.stderr)
        assert "skip mechanics ok" in proc.stdout


def _probe_in_rank0() -> list:
    """A model and its optimizer made and trained inside a rank0() body (a probe on rank 0 alone)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    trained = []
    with autoddp.rank0():
        probe = torch.nn.Linear(8, 2)
        probe_opt = torch.optim.Adam(probe.parameters(), lr=1e-3)
        probe(torch.randn(4, 8)).pow(2).mean().backward()
        probe_opt.step()
        trained.append(type(probe).__name__)
    return trained


def test_a_model_made_and_trained_inside_a_rank0_block_stays_rank_0s_own():
    # Before: capture wrapped it in DDP (or weighed it with a collective) on rank 0 alone, and the
    # run hung (or was refused) with a collective the user never wrote.
    assert autoddp.distributed(nproc=2)(_probe_in_rank0)() == ["Linear"]
