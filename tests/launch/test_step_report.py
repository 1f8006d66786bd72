"""The step report: where a step's time goes, said once on the caller's console at the end of a run.

A rank slowed on purpose by 30 ms a step, in its data (a slow ``Dataset.__getitem__``) or in its
computing (a sleep in ``forward``), must be named with its phase, under the command and the
decorator, and the report's numbers must agree with the injected delay and with the script's own
count of steps per second. The report is the caller's (never a worker's), off with the option,
absent for one process and before two optimizer steps, and said so far on ``SIGUSR1``.
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from autoddp.in_rank.run_folder.step_record import Totals
from autoddp.launch import step_report
from conftest import run_python, write

#: Rank 1 is 30 ms late each step: in its data (argv[1] "data") or in its forward ("compute").
#: Rank 0 prints the steps per second it measured itself, from the end of its first step.
SLOWED = """
    import os, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset

    PHASE, STEPS, BATCH = sys.argv[1], 24, 8


    def slow(phase):
        return PHASE == phase and os.environ.get("RANK") == "1"  # (read in the worker)


    class Samples(Dataset):
        def __len__(self):
            return 2 * BATCH * STEPS  # each of the 2 ranks: STEPS batches

        def __getitem__(self, i):
            if slow("data"):
                time.sleep(0.030 / BATCH)
            return torch.randn(16), torch.randn(4)


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(16, 4)

        def forward(self, x):
            if slow("compute"):
                time.sleep(0.030)
            return self.layer(x)


    def train():
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step, (x, y) in enumerate(DataLoader(Samples(), batch_size=BATCH, shuffle=True)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step == 0:
                started = time.perf_counter()
        if os.environ["RANK"] == "0":
            print(f"own steps/s {step / (time.perf_counter() - started):.3f}", flush=True)
"""

COMMAND = SLOWED + "\n    train()\n"

DECORATOR = (
    SLOWED
    + """
    if __name__ == "__main__":
        import autoddp

        autoddp.distributed(nproc=2)(train)()
"""
)

VERDICT = re.compile(
    r"autoddp:   rank (\d+) arrives ([\d.]+) ms after the others each step \(\d+% of a step\): "
    r"its (data loading|computing) takes ([\d.]+) ms longer"
)
HEADER = re.compile(
    r"autoddp: step report at the end: (\d+) optimizer steps on (\d+) processes, ([\d.]+) steps/s"
)


def _slowed_run(tmp_path, phase: str, door: str) -> subprocess.CompletedProcess:
    script = write(tmp_path / f"slowed_{door}.py", COMMAND if door == "command" else DECORATOR)
    args = ["-m", "autoddp.cli", "-n", "2", str(script), phase] if door == "command" else [str(script), phase]
    return run_python(args, cwd=tmp_path, timeout=100)


@pytest.mark.parametrize("door", ["command", "decorator"])
@pytest.mark.parametrize("phase", ["data", "compute"])
def test_a_rank_slowed_30_ms_a_step_is_named_in_its_phase_with_the_delay(tmp_path, phase, door):
    proc = _slowed_run(tmp_path, phase, door)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, verdict = HEADER.search(proc.stderr), VERDICT.search(proc.stderr)
    assert header is not None and verdict is not None, proc.stderr
    steps, processes, rate = int(header[1]), int(header[2]), float(header[3])
    assert (steps, processes) == (24, 2)
    rank, late, said, longer = int(verdict[1]), float(verdict[2]), verdict[3], float(verdict[4])
    assert rank == 1 and said == {"data": "data loading", "compute": "computing"}[phase], proc.stderr
    # the injected delay (30 ms a step) is what the others wait, and what rank 1's phase takes longer
    assert 20 < late < 45 and 24 < longer < 45, proc.stderr
    own = float(proc.stdout.split("own steps/s ")[1].split()[0])  # rank 0's own measurement
    assert abs(rate - own) / own < 0.15, (rate, own)
    report = [line for line in proc.stderr.splitlines() if "step report" in line]
    assert len(report) == 1  # said once, by the caller
    block = proc.stderr[proc.stderr.index(report[0]) :].splitlines()
    assert 3 < len([line for line in block if line.startswith("autoddp:   ")]) <= 7


QUICK = """
    import sys, torch

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(int(sys.argv[1])):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    print("trained")
"""


def test_the_report_is_the_callers_once_and_off_with_the_option(tmp_path):
    script = str(write(tmp_path / "quick.py", QUICK))
    decorated = write(
        tmp_path / "decorated.py",
        """
        import sys, torch, autoddp

        @autoddp.distributed(nproc=2, step_report=sys.argv[1] == "on")
        def train():
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(5):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()

        train()
        """,
    )
    runs = {
        "all ranks shown": ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", script, "5"],
        "off": ["-m", "autoddp.cli", "-n", "2", "--no-step-report", script, "5"],
        "one process": ["-m", "autoddp.cli", "-n", "1", script, "5"],
        "one step": ["-m", "autoddp.cli", "-n", "2", script, "1"],
        "decorator on": [str(decorated), "on"],
        "decorator off": [str(decorated), "off"],
    }
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # (the runs three at a time)
        done = dict(
            zip(runs, pool.map(lambda args: run_python(args, cwd=tmp_path), runs.values()), strict=True)
        )
    said = {}
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        said[name] = [line for line in (proc.stdout + proc.stderr).splitlines() if "step report" in line]
    shown = said["all ranks shown"]  # every rank's output on the console: the report is the caller's, once
    assert len(shown) == 1 and shown[0].startswith("autoddp: step report at the end: 5 optimizer steps on 2 ")
    assert len(said["decorator on"]) == 1
    assert said["off"] == said["one process"] == said["one step"] == said["decorator off"] == []


#: Rank 0 says "ready" after its third step, then steps until the test drops the file ``go``.
UNTIL_GO = """
    import os, sys, time, torch

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    while True:
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        step += 1
        if step == 3 and os.environ["RANK"] == "0":
            print("ready", flush=True)
        time.sleep(0.02)
        go = torch.tensor([float(os.path.exists(sys.argv[1]))])
        torch.distributed.all_reduce(go)  # (every rank stops at the same step)
        if go.item() == 2 and step > 3:
            break
"""


def test_sigusr1_to_the_caller_says_the_report_so_far(tmp_path):
    script = write(tmp_path / "until_go.py", UNTIL_GO)
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoddp.cli", "-n", "2", str(script), str(go)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # (a few steps more, written into the records)
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not any("step report so far" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        go.write_text("")
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    reader.join(timeout=10)
    assert proc.returncode == 0, "".join(lines)[-3000:]
    said = [line for line in lines if "step report" in line]
    assert len(said) == 2 and "so far" in said[0] and "at the end" in said[1], said


def _totals(rank: int, data: float, compute: float, waited: float, steps: int = 10) -> Totals:
    return Totals(
        rank, 8, steps, (data + compute + waited) * steps, data * steps, waited * steps, 32 * steps, steps + 1
    )


@pytest.mark.unit
def test_many_ranks_fit_in_eight_lines_and_an_even_run_names_no_straggler():
    late = [_totals(r, 0.002, 0.010, 0.015 + r * 1e-5) for r in range(7)] + [_totals(7, 0.002, 0.025, 0.0)]
    lines = step_report.words(late)
    assert len(lines) <= 8 and "rank 7 arrives 15.0 ms after the others" in lines[-1], lines
    assert "its computing takes 15.0 ms longer" in lines[-1]
    assert [line.split()[0] for line in lines[2:-1]] == ["0", "7", "4"]  # rank 0, the slowest, the median
    even = step_report.words([_totals(r, 0.002, 0.010, 0.001 + r * 1e-4) for r in range(3)])
    assert "no straggler" in even[-1] and len(even) == 6, even
    assert step_report.words([_totals(0, 0.1, 0.1, 0.1)]) == []  # one rank: nothing to compare
    assert step_report.words([_totals(0, 0, 0, 0, steps=0), _totals(1, 0, 0, 0, steps=0)]) == []


@pytest.mark.unit
def test_a_ranks_record_reads_back_and_a_batch_counts_its_first_arrays_rows(tmp_path):
    from autoddp.in_rank.run_folder import step_record
    from autoddp.in_rank.step_report import samples

    writer = step_record.Writer(str(tmp_path), 3, 4)
    assert step_record.read(str(tmp_path)) == [Totals(3, 4, 0, 0.0, 0.0, 0.0, 0, 0)]
    writer.write(5, 1.0, 0.25, 0.5, 40, 6)
    (totals,) = step_record.read(str(tmp_path))
    assert totals == Totals(3, 4, 5, 1.0, 0.25, 0.5, 40, 6) and totals.compute == 0.25
    writer.close()
    (tmp_path / "steps-9.record").write_bytes(b"partial")  # a file being written: left out
    assert [t.rank for t in step_record.read(str(tmp_path))] == [3]
    batch = [torch.ones(5, 2), torch.zeros(5)]
    assert [samples(batch), samples({"ids": torch.ones(3, 7)}), samples(torch.tensor(1.0))] == [5, 3, 1]
    assert [samples(["text"]), samples(()), samples(None)] == [0, 0, 0]
