"""autoddp.print and autoddp.progress: console output once per job, not once per process."""

from __future__ import annotations

import builtins
import io
import re
import sys

import pytest

from autoddp.core import state
from autoddp.in_rank import console
from conftest import run_python, write

PRINTS = """
    import sys
    import autoddp
    from autoddp.in_rank import console

    console.print("before", 1, sep="-", end="!\\n")

    @autoddp.distributed(nproc=2, start_method=sys.argv[1])
    def run(shared):
        console.print("once", autoddp.world_size())
        console.print("to stderr", file=sys.stderr)
        console.print("rank 0 says", all_ranks=True)
        with open(shared, "a") as out:  # both ranks append to one file, each message at once
            console.print("both", "x", sep="+", file=out, all_ranks=True)
            console.print("first\\nsecond", file=out, all_ranks=True)
            for i in range(300):
                console.print("spam " * 60 + str(i), file=out, all_ranks=True)
        return autoddp.rank() + 7

    console.print("result", run(sys.argv[2]))
"""

SPAM = "spam " * 60
# a line that is exactly one whole message of one rank (a mix of two ranks matches nothing)
WHOLE = re.compile(r"\[rank [01]\] (both\+x|first|second|(spam ){60}\d+|rank 0 says|top [01]|result [01])")


def _check_all_ranks_lines(lines: list[str]) -> None:
    """Both ranks' ``all_ranks=True`` messages are all there, prefixed per line and never mixed."""
    for rank in (0, 1):
        assert lines.count(f"[rank {rank}] both+x") == 1
        # every line of a multi-line message carries the prefix, and the lines stay together
        assert lines.index(f"[rank {rank}] second") == lines.index(f"[rank {rank}] first") + 1
        spam = [line for line in lines if line.startswith(f"[rank {rank}] spam")]
        assert spam == [f"[rank {rank}] {SPAM}{i}" for i in range(300)]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_print_once_by_default_and_every_rank_on_request(tmp_path, method):
    script = write(tmp_path / "prints.py", PRINTS)
    shared = tmp_path / "shared.txt"
    proc = run_python([str(script), method, str(shared)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()  # the launcher shows rank 0's output only, unless told otherwise
    assert lines[0] == "before-1!"  # outside the workers: the builtin print, sep and end included
    assert lines[-1] == "result 7"
    assert lines.count("once 2") == 1
    assert lines.count("[rank 0] rank 0 says") == 1
    assert proc.stderr.splitlines().count("to stderr") == 1
    written = shared.read_text().splitlines()
    _check_all_ranks_lines(written)
    assert [line for line in written if not WHOLE.fullmatch(line)] == []
    assert len(written) == 2 * (3 + 300)


TORCHRUN = """
    import autoddp
    from autoddp.in_rank import console

    console.print("top", autoddp.rank(), all_ranks=True)

    @autoddp.distributed(nproc=2)  # runs in place: torchrun already started one process per rank
    def run():
        console.print("once", autoddp.world_size())
        console.print("both", "x", sep="+", all_ranks=True)
        console.print("first\\nsecond", all_ranks=True)
        for i in range(300):
            console.print("spam " * 60 + str(i), all_ranks=True)
        for _ in console.progress(range(25), desc=f"bar-of-rank-{autoddp.rank()}", mininterval=600):
            pass
        return autoddp.rank()

    console.print("result", run(), all_ranks=True)
"""


def test_ranks_sharing_one_pipe_under_torchrun(tmp_path):
    """torchrun leaves every rank on the caller's stdout and stderr: the case the helpers are for."""
    script = write(tmp_path / "under_torchrun.py", TORCHRUN)
    proc = run_python(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines.count("once 2") == 1
    _check_all_ranks_lines(lines)
    assert sorted(line for line in lines if "top" in line) == ["[rank 0] top 0", "[rank 1] top 1"]
    assert sorted(line for line in lines if "result" in line) == ["[rank 0] result 0", "[rank 1] result 1"]
    assert [line for line in lines if line != "once 2" and not WHOLE.fullmatch(line)] == []
    if _has_tqdm():
        _check_one_bar(proc.stderr)


PROGRESS = """
    import sys
    import torch
    import torch.distributed as dist
    import autoddp
    from autoddp.in_rank import console

    def numbers():  # a generator: no length for the bar to rely on
        yield from range(25)

    @autoddp.distributed(nproc=2)
    def run(shared):
        seen, total = [], torch.zeros(1)
        with open(shared, "a") as bars:  # both ranks' bars (if any) go to one file
            desc = f"bar-of-rank-{autoddp.rank()}"
            for i in console.progress(numbers(), desc=desc, file=bars, mininterval=600):
                seen.append(i)
                total += i
                dist.all_reduce(total)  # a collective in every step: the ranks must stay in step
        every = [None, None]
        dist.all_gather_object(every, (seen, total.item(), list(console.progress(range(3)))))
        return every

    print("result", run(sys.argv[1]))
"""


def _has_tqdm() -> bool:
    try:
        import tqdm.auto  # noqa: F401
    except ImportError:
        return False
    return True


def _expected_total() -> float:
    total = 0.0
    for i in range(25):
        total = 2 * (total + i)
    return total


def _check_one_bar(stream: str) -> None:
    """Rank 0 drew its bar (start and final state, thanks to mininterval); rank 1 drew nothing."""
    updates = re.split(r"[\r\n]+", stream)
    assert not any("bar-of-rank-1" in update for update in updates), stream
    final = [
        update
        for update in updates
        if update.startswith("bar-of-rank-0") and re.search(r" 25(/25|it) ", update)
    ]
    assert len(final) == 1, stream


def test_progress_yields_every_item_on_every_rank_and_one_bar(tmp_path):
    script = write(tmp_path / "progress.py", PROGRESS)
    shared = tmp_path / "bars.txt"
    proc = run_python([str(script), str(shared)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    same = (list(range(25)), _expected_total(), [0, 1, 2])
    assert proc.stdout.splitlines() == [f"result {[same, same]}"]
    if _has_tqdm():
        _check_one_bar(shared.read_text())
    else:
        assert not shared.exists() or shared.read_text() == ""


@pytest.mark.unit
def test_progress_bar_is_tqdm_on_rank_0_only():
    pytest.importorskip("tqdm")
    from tqdm.auto import tqdm

    for rank, disabled in ((0, False), (1, True)):
        with state.CURRENT.entered(state.World(rank=rank, world_size=2)):
            bar = console.progress(range(4), file=io.StringIO())
        assert isinstance(bar, tqdm)
        assert bar.disable is disabled
        assert list(bar) == [0, 1, 2, 3]


@pytest.mark.unit
def test_progress_without_tqdm_returns_the_iterable(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # makes `import tqdm.auto` fail
    items = [3, 1, 2]
    assert console.progress(items, desc="ignored") is items


@pytest.mark.unit
def test_progress_outside_workers_iterates_everything(capsys):
    pytest.importorskip("tqdm")
    assert list(console.progress(range(5), desc="solo", file=sys.stdout, mininterval=600)) == list(range(5))
    assert "solo: 100%" in capsys.readouterr().out


@pytest.mark.unit
@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((), {}),
        (("a", 1, None), {}),
        (("a", "b"), {"sep": "--", "end": "|"}),
        (("a", "b"), {"sep": None, "end": None}),
        (("x\ny",), {"end": ""}),
        (("flushed",), {"flush": True}),
        (("all", "ranks"), {"all_ranks": True}),
    ],
)
def test_outside_workers_it_is_the_builtin_print(capsys, args, kwargs):
    console.print(*args, **kwargs)
    ours = capsys.readouterr()
    kwargs.pop("all_ranks", None)
    builtins.print(*args, **kwargs)
    assert capsys.readouterr() == ours


@pytest.mark.unit
def test_outside_workers_file_argument_is_honoured(capsys):
    ours, theirs = io.StringIO(), io.StringIO()
    console.print("to", "file", sep="_", end=".", file=ours)
    builtins.print("to", "file", sep="_", end=".", file=theirs)
    assert ours.getvalue() == theirs.getvalue() == "to_file."
    assert capsys.readouterr().out == ""


class _Recorder(io.StringIO):
    """A text stream that records each write call and each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.flushes = 0

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)

    def flush(self) -> None:
        self.flushes += 1


@pytest.mark.unit
@pytest.mark.parametrize("rank", [0, 1])
def test_in_a_world_each_message_is_one_flushed_write(rank):
    out = _Recorder()
    with state.CURRENT.entered(state.World(rank=rank, world_size=2)):
        console.print("plain", 1, file=out)
        console.print("a\nb", "c", sep="+", end="", file=out, all_ranks=True)
        console.print(file=out, all_ranks=True)
    expected = [f"[rank {rank}] a\n[rank {rank}] b+c", f"[rank {rank}] \n"]
    assert out.writes == (["plain 1\n", *expected] if rank == 0 else expected)
    assert out.flushes == len(out.writes)


@pytest.mark.unit
def test_in_a_world_rank_0_prints_to_stdout_unprefixed(capsys):
    with state.CURRENT.entered(state.World(rank=0, world_size=4)):
        console.print("hello", "world")
    assert capsys.readouterr().out == "hello world\n"


@pytest.mark.unit
def test_in_a_world_lines_end_at_newlines_only_and_any_writable_works():
    class WriteOnly:  # the builtin print needs nothing more than write()
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> None:
            self.text += text

    out = WriteOnly()
    with state.CURRENT.entered(state.World(rank=1, world_size=2)):
        console.print("10%\r20%\x0cdone\n", file=out, all_ranks=True)
    assert out.text == "[rank 1] 10%\r20%\x0cdone\n[rank 1] \n"


@pytest.mark.unit
@pytest.mark.parametrize("rank", [0, 1])
def test_in_a_world_bad_separators_fail_on_every_rank_as_in_the_builtin(rank):
    with state.CURRENT.entered(state.World(rank=rank, world_size=2)):
        with pytest.raises(TypeError, match="sep must be None or a string, not int"):
            console.print("a", "b", sep=1)
        with pytest.raises(TypeError, match="end must be None or a string, not bytes"):
            console.print("a", end=b"\n")


def test_no_double_prefix_when_the_launcher_prefixes_every_rank(tmp_path):
    script = tmp_path / "prefixed.py"
    script.write_text(
        "import autoddp\n"
        "@autoddp.distributed(nproc=2, ranks='all')\n"
        "def f():\n"
        "    autoddp.print('hello\\nworld', all_ranks=True)\n"
        "f()\n"
    )
    proc = run_python([str(script)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        "[rank 0] hello",
        "[rank 0] world",
        "[rank 1] hello",
        "[rank 1] world",
    ]
