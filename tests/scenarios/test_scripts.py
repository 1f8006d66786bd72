"""@distributed in real scripts: only the decorated function runs in the workers."""

from __future__ import annotations

import pytest

from conftest import run_python, write

NO_GUARD = """
    import os, sys
    import torch.distributed as dist
    import autoddp

    with open(sys.argv[1], "a") as f:
        f.write("top\\n")

    @autoddp.distributed(nproc=2, start_method=sys.argv[2])
    def train(path):
        with open(path, "a") as f:
            f.write(f"train {autoddp.rank()} {dist.get_world_size()}\\n")
        return autoddp.rank() + 40

    result = train(sys.argv[1])
    with open(sys.argv[1], "a") as f:
        f.write(f"after {result}\\n")
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_script_without_main_guard_runs_top_level_once(tmp_path, method):
    script = write(tmp_path / "noguard.py", NO_GUARD)
    log = tmp_path / "log.txt"
    proc = run_python([str(script), str(log), method], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    assert lines.count("top") == 1
    assert sorted(line for line in lines if line.startswith("train")) == ["train 0 2", "train 1 2"]
    assert lines[-1] == "after 40"
    assert lines.count("after 40") == 1


def test_script_with_main_guard_and_local_function(tmp_path):
    script = write(
        tmp_path / "guarded.py",
        """
        import autoddp

        def main():
            offset = 5

            @autoddp.distributed(nproc=2, start_method="spawn")
            def train():
                return autoddp.world_size() + offset

            print("result", train())

        if __name__ == "__main__":
            main()
        """,
    )
    proc = run_python([str(script)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["result 7"]


@pytest.mark.parametrize("method", ["auto", "spawn"])
def test_function_fed_on_stdin(tmp_path, method):
    source = f"""
import autoddp, torch

class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))

@autoddp.distributed(nproc=2, start_method={method!r})
def train():
    return Scale().w * autoddp.world_size(), autoddp.rank()

print("stdin", train())
"""
    proc = run_python(["-"], stdin=source, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "stdin (tensor(4.), 0)"


def test_python_dash_c(tmp_path):
    code = "import autoddp; print(autoddp.distributed(nproc=2)(lambda: autoddp.world_size() * 10)())"
    proc = run_python(["-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "20"


def test_uncaught_worker_error_shows_rank_and_traceback(tmp_path):
    script = write(
        tmp_path / "fails.py",
        """
        import autoddp

        def load_batch(i):
            raise KeyError(f"sample {i} missing")

        @autoddp.distributed(nproc=2)
        def train():
            if autoddp.rank() == 1:
                load_batch(7)
            autoddp.barrier()

        train()
        """,
    )
    proc = run_python([str(script)], cwd=tmp_path)
    assert proc.returncode == 1
    err = proc.stderr
    assert "Traceback of rank 1 of 2" in err
    assert "load_batch(7)" in err and "raise KeyError" in err  # the worker's source lines
    assert "KeyError: 'sample 7 missing'\nautoddp: [rank 1 of 2] raised this" in err


PREPARE_AT_THE_TOP = """
    import sys
    import torch
    import autoddp

    torch.manual_seed(0)
    model = autoddp.prepare(torch.nn.Linear(4, 1))  # the first line that needs the group
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4).chunk(2)[autoddp.rank()]
    model(x).mean().backward()
    opt.step()
    weights = autoddp.unwrap(model).weight.detach()
    parts = autoddp.gather(weights)
    if autoddp.rank() == 0:
        print("same", all(torch.equal(parts[0], p) for p in parts), type(model).__name__)
"""


def test_prepare_at_the_top_of_a_script_under_the_command_joins_the_group(tmp_path):
    script = write(tmp_path / "prepared.py", PREPARE_AT_THE_TOP)
    ran = run_python(["-m", "autoddp.cli", "-n", "2", str(script)], cwd=tmp_path)
    # (before: torch's "Default process group has not been initialized" on every rank)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "same True" in ran.stdout
    refused = run_python(["-m", "autoddp.cli", "-n", "2", "--no-capture", str(script)], cwd=tmp_path)
    assert refused.returncode == 1
    assert "ConfigurationError" in refused.stderr and "init_process_group() before it" in refused.stderr
