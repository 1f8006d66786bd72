"""Epoch time of an unchanged CPU-bound script under ``autoddp -n N`` against ``torchrun``, same run.

    python benchmarks/epoch_time.py            # 8 rounds of 6 epochs (about 3-4 minutes on 2 busy cores)
    python benchmarks/epoch_time.py --quick    # 3 rounds of 3 epochs, a smaller data set (under a minute)

The script is ``train_epochs.py``: plain single-GPU code (a small conv net on random images, a
shuffled DataLoader, SGD) that ``autoddp -n N`` runs unchanged, and that ``torchrun --standalone
--nproc-per-node N`` runs with its torchrun-style lines on (``--hand-written-ddp``): the same model,
data, batch per process and steps per epoch. Each round runs both launchers once, the order
alternating (A B, then B A, ...), with ``OMP_NUM_THREADS`` unset as in a user's shell, so each
launcher chooses its workers' threads itself. Epoch times are the workers' own prints (rank 0
times every epoch inside the script): start-up is left out, and reported apart as the command's
wall time less its epochs. The first epoch is a warm-up (DDP's first step, the loader's first
pass); a run's figure is the median of its later epochs. A round's ratio is autoddp's figure over
torchrun's; the result is the median of the rounds' ratios with its distribution-free 95%
interval, for wall time and for rank 0's CPU time (all its threads), which waiting for a core
held by another program does not grow: on a busy machine it shows the launchers' own cost more
steadily. The JSON says whether the kernel shares the CPU between sessions first
(``sched_autogroup``): torchrun's workers each have a session, autoddp's share the command's.
Prints a table, a verdict on the wall-time ratio against 1.0, then as its last line one JSON
object. The figures of ``--quick`` are for checking the harness, not for quoting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from run import HERE, Table, _tool, clean_environment, machine_description, run_command
from steady_state import summarise

EPOCH_LINE = re.compile(
    r"epoch (\d+) ([0-9.]+)s loss ([0-9.]+) threads (\d+) cpu ([0-9.]+)s(?: faults (\d+))?"
)
#: ``--steady-malloc``: glibc's thresholds fixed for both contenders (no trimming of the heap's top
#: between steps, activations never mmapped), so that neither pays page faults the other does not.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
RUN_TIMEOUT_S = 600  # one launch; a healthy full-size one takes 10-20 s
LABELS = {"autoddp": "autoddp -n N (unchanged script)", "torchrun": "torchrun (hand-written DDP)"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much to measure."""

    rounds: int
    epochs: int
    samples: int


FULL = Settings(rounds=8, epochs=6, samples=2048)
QUICK = Settings(rounds=3, epochs=3, samples=1024)


@dataclasses.dataclass(frozen=True)
class Run:
    """One launch: what rank 0 printed of every epoch (wall and CPU seconds; the last epoch's loss and
    threads), and the command's wall time."""

    epoch_s: list[float]
    epoch_cpu_s: list[float]
    last_loss: float
    threads: int
    wall_s: float
    #: rank 0's minor page faults per epoch (empty from a script that does not print them)
    epoch_faults: list[int] = dataclasses.field(default_factory=list)

    @property
    def figure_s(self) -> float:
        """The median of the epochs after the first (the only one when there is one): an epoch
        that load from other programs slowed counts no more than one that it did not."""
        return statistics.median(self.epoch_s[1:] or self.epoch_s)

    @property
    def cpu_figure_s(self) -> float:
        """The same of rank 0's CPU time (all its threads): it does not grow while the process
        waits for a core that another program holds, so it shows the launchers' own cost more
        steadily on a busy machine, and it leaves out waiting for the other rank."""
        return statistics.median(self.epoch_cpu_s[1:] or self.epoch_cpu_s)

    @property
    def startup_s(self) -> float:
        """The command's wall time less its epochs: start-up, joining the group and exit."""
        return self.wall_s - sum(self.epoch_s)


def commands(nproc: int, settings: Settings) -> dict[str, list[str]]:
    """The two contenders, full command lines, on the same script and data."""
    script = [
        str(HERE / "train_epochs.py"),
        "--epochs",
        str(settings.epochs),
        "--samples",
        str(settings.samples),
    ]
    return {
        "autoddp": [*_tool("autoddp", "autoddp.cli"), "-n", str(nproc), *script],
        "torchrun": [
            *_tool("torchrun", "torch.distributed.run"),
            "--standalone",
            f"--nproc-per-node={nproc}",
            *script,
            "--hand-written-ddp",
        ],
    }


def parse_run(output: str, wall_s: float, epochs: int) -> Run:
    """Read rank 0's epoch lines from a launch's output (exactly ``epochs`` of them, in order)."""
    found = [match.groups() for match in EPOCH_LINE.finditer(output)]
    if [int(number) for number, *_ in found] != list(range(1, epochs + 1)):
        raise RuntimeError(f"expected the lines of epochs 1..{epochs} from rank 0, got:\n{output[-3000:]}")
    return Run(
        epoch_s=[float(line[1]) for line in found],
        epoch_cpu_s=[float(line[4]) for line in found],
        last_loss=float(found[-1][2]),
        threads=int(found[-1][3]),
        wall_s=wall_s,
        epoch_faults=[int(line[5]) for line in found if line[5] is not None],
    )


def environment(steady_malloc: bool = False) -> dict[str, str]:
    """A plain job's environment without ``OMP_NUM_THREADS`` (as in a user's shell: each launcher
    chooses its workers' threads) and without GPUs (a CPU benchmark: gloo, also on a GPU machine);
    ``steady_malloc``: with ``STEADY_MALLOC``, the same for both."""
    plain = {name: value for name, value in clean_environment().items() if name != "OMP_NUM_THREADS"}
    return {**plain, "CUDA_VISIBLE_DEVICES": "", **(STEADY_MALLOC if steady_malloc else {})}


def measure(
    nproc: int, settings: Settings, progress: Callable[[str], None], steady_malloc: bool = False
) -> dict[str, list[Run]]:
    """``settings.rounds`` rounds of both launchers, the order alternating every round."""
    lines, env = commands(nproc, settings), environment(steady_malloc)
    names = list(lines)
    results: dict[str, list[Run]] = {name: [] for name in names}
    for index in range(settings.rounds):
        for name in names if index % 2 == 0 else reversed(names):
            start, end, output = run_command(lines[name], RUN_TIMEOUT_S, env)
            run = parse_run(output, end - start, settings.epochs)
            results[name].append(run)
            later = run.epoch_faults[1:]
            faults = f", {statistics.median(later):.0f} page faults" if later else ""
            progress(f"round {index + 1}/{settings.rounds}: {name} epoch {run.figure_s:.3f} s{faults}")
    return results


def report(results: dict[str, list[Run]], table: Table) -> dict[str, Any]:
    """Fill the table; return the figures (ratio and interval, times, threads, losses)."""
    autoddp, torchrun = results["autoddp"], results["torchrun"]
    figures = summarise([r.figure_s for r in autoddp], [r.figure_s for r in torchrun])
    cpu = summarise([r.cpu_figure_s for r in autoddp], [r.cpu_figure_s for r in torchrun])
    table.section(f"Epoch time of train_epochs.py, seconds ({len(autoddp)} interleaved rounds)")
    rows: list[tuple[str, Callable[[Run], float], int]] = [
        ("epochs 2+", lambda r: r.figure_s, 3),
        ("epoch 1", lambda r: r.epoch_s[0], 3),
        ("CPU, 2+", lambda r: r.cpu_figure_s, 3),
        ("start+exit", lambda r: r.startup_s, 2),
    ]
    if all(len(r.epoch_faults) > 1 for runs in results.values() for r in runs):
        rows.insert(3, ("faults, 2+", lambda r: statistics.median(r.epoch_faults[1:]), 0))
    for what, figure, digits in rows:
        for name, label in LABELS.items():
            unit = "" if what.startswith("faults") else "s"
            table.row(f"{what:10}  {label}", [figure(r) for r in results[name]], unit, digits)
    for what, ratios in (("epoch time", figures), ("CPU time", cpu)):
        interval = f"{ratios['ratio_ci_low']:.3f}-{ratios['ratio_ci_high']:.3f}"
        label = f"ratio autoddp / torchrun, {what}, median of {len(autoddp)} rounds"
        table.figures(label, None, ratios["ratio"], f"x  (95% CI {interval})", 3)

    def medians(figure: Callable[[Run], float], digits: int) -> dict[str, float]:
        return {name: round(statistics.median(map(figure, runs)), digits) for name, runs in results.items()}

    return {
        "epoch_time_ratio_vs_torchrun": round(figures["ratio"], 3),
        "epoch_time_ratio_vs_torchrun_ci95": [
            round(figures["ratio_ci_low"], 3),
            round(figures["ratio_ci_high"], 3),
        ],
        "epoch_time_ratio_of_medians": round(figures["ratio_of_medians"], 3),
        "cpu_time_ratio_vs_torchrun": round(cpu["ratio"], 3),
        "cpu_time_ratio_vs_torchrun_ci95": [round(cpu["ratio_ci_low"], 3), round(cpu["ratio_ci_high"], 3)],
        "epoch_s_median": medians(lambda r: r.figure_s, 3),
        "epoch_cpu_s_median": medians(lambda r: r.cpu_figure_s, 3),
        "first_epoch_s_median": medians(lambda r: r.epoch_s[0], 3),
        "startup_and_exit_s_median": medians(lambda r: r.startup_s, 2),
        "last_loss_median": medians(lambda r: r.last_loss, 4),
        "threads_per_worker": {name: sorted({r.threads for r in runs}) for name, runs in results.items()},
        "page_faults_per_epoch_median": {
            name: statistics.median(statistics.median(r.epoch_faults[1:]) for r in runs)
            for name, runs in results.items()
            if all(len(r.epoch_faults) > 1 for r in runs)
        },
    }


def verdict(figures: dict[str, Any]) -> str:
    """One line: the ratio against 1.0, and whether the interval says more than the median."""
    ratio = figures["epoch_time_ratio_vs_torchrun"]
    low, high = figures["epoch_time_ratio_vs_torchrun_ci95"]
    if high < 1.0:
        return f"ratio {ratio:.3f} <= 1.0, faster than torchrun: the 95% CI {low:.3f}-{high:.3f} is below 1"
    if ratio <= 1.0:
        return f"ratio {ratio:.3f} <= 1.0 (95% CI {low:.3f}-{high:.3f})"
    if low <= 1.0:
        return f"ratio {ratio:.3f} > 1.0, but 1.0 is inside the 95% CI {low:.3f}-{high:.3f}: within noise"
    return f"SLOWER than torchrun: ratio {ratio:.3f}, the whole 95% CI {low:.3f}-{high:.3f} above 1.0"


def sched_autogroup() -> bool | None:
    """Whether Linux shares the CPU between sessions first (``kernel.sched_autogroup_enabled``).

    torchrun starts each worker in a session of its own, autoddp's forked workers stay in the
    command's: where other sessions load the machine, torchrun's workers then get a larger share
    of it in wall time for the same CPU time (the CPU-time ratio is free of this).
    """
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def main(argv: Sequence[str] | None = None) -> None:
    """Measure, print the table, the verdict, and the JSON line last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 3 epochs on 1024 samples")
    parser.add_argument("--rounds", type=int, help="rounds of both launchers (default 8; quick 3)")
    parser.add_argument("--epochs", type=int, help="per launch, the first untimed (default 6; quick 3)")
    parser.add_argument("--samples", type=int, help="samples in the data set (default 2048; quick 1024)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per launch (default 2)")
    parser.add_argument(
        "--steady-malloc",
        action="store_true",
        help="fix glibc's malloc thresholds for both contenders (no page faults from heap trimming)",
    )
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    settings = Settings(
        rounds=args.rounds or base.rounds,
        epochs=args.epochs or base.epochs,
        samples=args.samples or base.samples,
    )
    began = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - began:6.1f} s] {message}", file=sys.stderr, flush=True)

    results = measure(args.nproc, settings, progress, args.steady_malloc)
    table = Table()
    figures = report(results, table)
    machine = {**machine_description(args.nproc), "sched_autogroup": sched_autogroup()}
    print(f"autoddp -n {args.nproc} vs torchrun: {machine['device']}, {machine['cpu_cores']} CPU cores,")
    print(f"  {machine['platform']}, Python {machine['python']}, torch {machine['torch']}")
    malloc = "; glibc malloc thresholds fixed for both (--steady-malloc)" if args.steady_malloc else ""
    print(f"  OMP_NUM_THREADS unset; {settings}{malloc}")
    table.print()
    print(verdict(figures))
    print(f"({time.monotonic() - began:.0f} s)", flush=True)
    figures.update(**dataclasses.asdict(settings), machine=machine, steady_malloc=args.steady_malloc)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
