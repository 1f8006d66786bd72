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


# The DDP tutorial's shape (pytorch/examples ddp-tutorial-series/multigpu_torchrun.py): a Trainer
# holds the script's own DDP, ``main()`` destroys the group and returns, so the DDP is freed after
# its group. Its reducer then dropped the group's last reference with the GIL held while a gloo
# thread waited for the GIL to free a finished all-reduce made in a backward: a deadlock at exit.
TUTORIAL = """
    import sys, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Trainer:
        def __init__(self):
            self.model = DDP(torch.nn.Linear(20, 1))
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

        def train(self, steps, late):
            for step in range(steps):
                x = torch.randn(32, 20, requires_grad=True)
                if late and step == steps - 1 and dist.get_rank() == 0:
                    # one more all-reduce made at the end of the backward (after DDP's) and
                    # never waited for: the race's window held open (rank 1 matches it 3 s later)
                    late_all_reduce = lambda: dist.all_reduce(torch.ones(21), async_op=True) and None
                    engine = torch.autograd.Variable._execution_engine
                    x.register_hook(lambda g: engine.queue_callback(late_all_reduce))
                self.optimizer.zero_grad()
                torch.nn.functional.mse_loss(self.model(x), torch.zeros(32, 1)).backward()
                self.optimizer.step()
            if dist.get_rank() == 0:
                torch.save(self.model.module.state_dict(), "snapshot.pt")
            if late and dist.get_rank() == 1:
                time.sleep(3)
                dist.all_reduce(torch.ones(21))

    def main(late=False):
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        trainer = Trainer()
        trainer.train(8, late)
        dist.destroy_process_group()
        print(f"trained {dist.is_initialized()}")

    if __name__ == "__main__":
        if "--decorated" in sys.argv:
            import autoddp
            autoddp.distributed(nproc=2)(main)("--late" in sys.argv)
        else:
            main("--late" in sys.argv)
"""


def _tutorial(tmp_path, how: str, *flags: str):
    script = write(tmp_path / "tutorial.py", TUTORIAL)
    if how == "decorator":
        args = [str(script), "--decorated", *flags]
    else:
        off = ["--no-capture"] if how == "no-capture" else []
        args = ["-m", "autoddp.cli", "-n", "2", *off, str(script), *flags]
    return run_python(args, cwd=tmp_path, timeout=60)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["command", "no-capture", "decorator"])
def test_a_ddp_freed_after_its_group_was_destroyed_ends_even_with_an_all_reduce_in_flight(tmp_path, how):
    proc = _tutorial(tmp_path, how, "--late")
    assert proc.returncode == 0, proc.stderr
    assert "trained False" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
    assert (tmp_path / "snapshot.pt").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how, runs", [("command", 5), ("decorator", 3)])
def test_the_tutorial_shape_ends_in_every_one_of_many_runs(tmp_path, how, runs):
    for run in range(runs):
        proc = _tutorial(tmp_path, how)
        assert proc.returncode == 0, f"run {run + 1} of {runs}: {proc.stderr}"
        assert "trained False" in proc.stdout, proc.stdout


# What runs after the user's code, inside autoddp's end of a worker, can still block: an object
# freed there whose ``__del__`` never returns (here on one rank), a destructor waiting for a thread.
STUCK_AFTER = """
    import atexit, gc, sys, time
    import torch, torch.distributed as dist

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            time.sleep(3600)  # never returns in time

    def train(stuck_rank):
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        gc.disable()  # (the cycle is freed by autoddp's own collection, after the user's code)
        if dist.get_rank() == stuck_rank:
            held = Cycle()
            if "--decorated" not in sys.argv:  # a script's: let go of after its atexit hooks ran
                atexit.register(lambda: held)
        print(f"trained {t.item():.0f}")
        return "the result"

    if __name__ == "__main__":
        stuck = int(sys.argv[1])
        if "--decorated" in sys.argv:
            import autoddp
            try:
                print("returned:", autoddp.distributed(nproc=2)(train)(stuck))
            except autoddp.WorkerError as error:
                print(f"WorkerError of rank {error.rank}: {error}")
        else:
            train(stuck)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, stuck", [("command", 0), ("command", 1), ("decorator", 1), ("decorator", 0)])
def test_a_rank_that_does_not_end_after_the_users_code_is_named_with_its_stack_and_the_run_ends(
    tmp_path, monkeypatch, how, stuck
):
    monkeypatch.setenv("AUTODDP_EXIT_SECONDS", "3")
    script = write(tmp_path / "stuck.py", STUCK_AFTER)
    if how == "decorator":
        args = [str(script), str(stuck), "--decorated"]
    else:
        args = ["-m", "autoddp.cli", "-n", "2", str(script), str(stuck)]
    proc = run_python(args, cwd=tmp_path, timeout=90)
    said = f"autoddp: rank {stuck} finished your code, but its process had not ended"
    assert said in proc.stderr, proc.stderr
    where = proc.stderr.split(said, 1)[1]
    assert "in __del__" in where and "stuck.py" in where, where
    if how == "command":
        assert proc.returncode == 0, proc.stderr  # the user's own status: the script ended well
        assert "trained 2" in proc.stdout
    elif stuck == 1:
        assert proc.returncode == 0 and "returned: the result" in proc.stdout, proc.stderr
    else:  # rank 0 stopped before it wrote its result: said, not a silent None
        assert "WorkerError of rank 0: rank 0 finished your function but never ended" in proc.stdout


@pytest.mark.timeout(120)
def test_a_script_that_ends_with_os_exit_0_ends_the_run_well(tmp_path):
    # os._exit(0) skips the teardown (some scripts end so, to skip a slow one): under fork elastic
    # waited forever for a return value no worker sends
    script = write(
        tmp_path / "exits.py",
        """
        import os, sys, torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        sys.stdout.write(f"done {dist.get_rank()}\\n")
        sys.stdout.flush()
        os._exit(0)
        """,
    )
    proc = run_python(["-m", "autoddp.cli", "-n", "2", str(script)], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "done 0" in proc.stdout
