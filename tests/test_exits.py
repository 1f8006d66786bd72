"""Clean exits: a script that leaves its process group open still ends well under ``autoddp``.

Left open, gloo's threads run into the interpreter's exit and abort it ("terminate called
without an active exception", SIGABRT) in about one run in eight, under torchrun too. The
script runner ends the group after the script's own atexit hooks. ``python
benchmarks/clean_exits.py`` repeats this many times against torchrun.
"""

from __future__ import annotations

import pytest

from conftest import run_python, write

LEAVES_OPEN = """
    import atexit, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    if "--hook" in sys.argv:
        atexit.register(lambda: sys.stdout.write(f"hook sees the group: {dist.is_initialized()}\\n"))
    if "--own-destroy" in sys.argv:
        atexit.register(dist.destroy_process_group)
    sys.stdout.write(f"done {dist.get_rank()}\\n")
    if "--exit" in sys.argv:
        sys.exit(0)
"""


def _run(tmp_path, *args: str):
    script = write(tmp_path / "leaves_open.py", LEAVES_OPEN)
    return run_python(["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script), *args], cwd=tmp_path)


@pytest.mark.parametrize("variant", [[], ["--exit", "--hook"], ["--own-destroy"]])
def test_a_script_that_leaves_its_group_open_exits_cleanly(tmp_path, variant):
    proc = _run(tmp_path, *variant)
    assert proc.returncode == 0, proc.stderr
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if "done" in line) == [
        "[rank 0] done 0",
        "[rank 1] done 1",
    ]
    if "--hook" in variant:  # the script's own atexit hooks run first, with the group still there
        assert proc.stdout.count("hook sees the group: True") == 2


def test_a_failing_script_still_reports_its_error(tmp_path):
    script = write(
        tmp_path / "fails.py",
        """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        raise ValueError("broken on purpose")
        """,
    )
    proc = run_python(["-m", "autoddp.cli", "-n", "2", str(script)], cwd=tmp_path)
    assert proc.returncode == 1 and "ValueError: broken on purpose" in proc.stderr
