"""autoddp's benchmark suite: launch latency, step time, import and call overhead, worker memory.

    python benchmarks/run.py            # the full run (about 6 minutes on 2 CPU cores)
    python benchmarks/run.py --quick    # fewer repeats (about 2-3 minutes)
    python benchmarks/run.py --selftest # import and call overhead only, a few seconds: checks the harness

Measures on whatever machine it runs: ``--nproc`` processes (default 2), one GPU each on NCCL when
there are enough GPUs, else CPU processes on gloo. Contenders are interleaved within one run (the
order rotates every round) so that load from other programs falls on all of them alike; every
figure is repeated and reported as min and median: the full run makes 7 launch rounds, 1000 step
block pairs per model plus an A/A control (DDP against itself), 10 import measurements; --quick
makes 5 launch rounds, 300 block pairs without the control, 5 import measurements. Prints a
table, then, as its last line, one JSON object: ``first_step_ratio_vs_torchrun``,
``step_time_ratio_small``, ``step_time_ratio_medium``, ``import_overhead_ms``,
``single_process_call_overhead_us``, ``worker_rss_ratio_vs_torchrun`` (ratios are medians of the
per-round or per-pair ratios, times are medians), then extra figures (exit times, the autoddp
command, minimums, intervals) and the machine.

The contenders are small scripts in this folder:
- ``train_torchrun.py``: hand-written DDP, run by ``torchrun --standalone --nproc-per-node=N`` and by
  ``autoddp -n N`` (the autoddp command);
- ``train_autoddp.py``: the same training as a plain function under ``@autoddp.distributed``,
  run by ``python``;
- ``steady_state.py``: step time of ``autoddp.prepare``'d model and loader against hand-written
  DDP with a DistributedSampler, in the same processes;
- ``call_overhead.py``: the decorator's cost per call with one process;
- ``result_transfer.py``: returning a large tensor from rank 0, against torch.save + torch.load;
- ``repeated_call.py``: repeated decorated calls in one session, passing a model or nothing;
- ``memory.py``: peak memory per rank and step time of hand-written DDP, autoddp's DDP and
  strategy="fsdp";
- ``epoch_time.py`` (run on its own): epoch time of an unchanged CPU-bound script
  (``train_epochs.py``) under ``autoddp -n N`` against the same training under torchrun;
- ``accumulation.py`` (run on its own): gradient accumulation (K = 8 micro-batches) left as one
  process writes it under autoddp, against hand-written DDP with and without ``no_sync``: step
  times and all-reduces per optimizer step;
- ``step_parts.py`` (run on its own): what each piece autoddp adds to a training step costs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:  # for ``common`` when this file is imported rather than run
    sys.path.insert(0, str(HERE))
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "AUTODDP_RUN_ID",
    "AUTODDP_PARENT_PID",
)
LAUNCH_TIMEOUT_S = 180  # one launch of a contender; a healthy one takes seconds


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much to measure: repeats of each figure."""

    launch_rounds: int
    step_pairs: int
    step_warmup_blocks: int
    import_repeats: int
    call_repeats: int
    call_count: int
    transfer_mib: int = 0  # size of the tensor returned by the result-transfer rows (0: not measured)
    transfer_repeats: int = 0
    fsdp_rounds: int = 0  # strategy="fsdp" against "ddp": rounds of fresh launches (0: not measured)
    launch_rounds_wide: int = 0  # rounds of the 8-process launches (0: not measured)
    step_control: bool = False  # also time DDP against itself (the A/A noise floor); doubles that part


FULL = Settings(
    launch_rounds=7,
    launch_rounds_wide=5,
    step_pairs=1000,
    step_warmup_blocks=20,
    import_repeats=10,
    call_repeats=9,
    call_count=5000,
    transfer_mib=1024,
    transfer_repeats=3,
    fsdp_rounds=3,
    step_control=True,
)
QUICK = Settings(
    launch_rounds=5,
    launch_rounds_wide=2,
    step_pairs=300,
    step_warmup_blocks=10,
    import_repeats=5,
    call_repeats=5,
    call_count=3000,
    transfer_mib=256,
    transfer_repeats=2,
    fsdp_rounds=1,
)
SELFTEST = Settings(
    launch_rounds=0, step_pairs=0, step_warmup_blocks=0, import_repeats=2, call_repeats=2, call_count=200
)


# --- running things --------------------------------------------------------------------------


def clean_environment() -> dict[str, str]:
    """This process's environment without launcher variables: every contender starts as a plain job."""
    return {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), including those that started their own session."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and everything it started (torchrun's workers run in sessions of their own)."""
    victims = _descendants(proc.pid) if Path("/proc").is_dir() else []
    for pid in [proc.pid, *victims]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_command(
    command: Sequence[str], timeout: float, environment: dict[str, str] | None = None
) -> tuple[float, float, str]:
    """Run ``command`` to its end; return (wall-clock start, wall-clock end, stdout).

    ``environment``: the command's whole environment (default: ``clean_environment()``). Raises
    with the end of its output if it fails or runs past ``timeout`` seconds (then it and every
    process it started are killed).
    """
    start = time.time()
    proc = subprocess.Popen(
        list(command),
        cwd=REPO,
        env=clean_environment() if environment is None else environment,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_tree(proc)
        raise
    end = time.time()
    if proc.returncode != 0:
        tail = "\n".join((out + err).strip().splitlines()[-60:])  # torchrun's summary alone is ~25 lines
        raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}:\n{tail}")
    return start, end, out


def last_json_line(output: str) -> Any:
    """The JSON object on the last non-empty line of ``output``."""
    return json.loads(output.strip().splitlines()[-1])


def min_median(values: Sequence[float]) -> tuple[float, float]:
    """The smallest and the median of ``values``."""
    return min(values), statistics.median(values)


# --- launch: first step, exit, worker memory ------------------------------------------------


def _tool(name: str, module: str) -> list[str]:
    """The console script ``name`` next to this interpreter, else ``python -m module``."""
    script = Path(sys.executable).with_name(name)
    if script.exists():
        return [str(script)]
    found = shutil.which(name)
    return [found] if found else [sys.executable, "-m", module]


def launch_commands(nproc: int, stamp_file: str) -> dict[str, list[str]]:
    """The contenders of the launch benchmark, each a full command line."""
    return {
        "torchrun": [
            *_tool("torchrun", "torch.distributed.run"),
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(HERE / "train_torchrun.py"),
            stamp_file,
        ],
        "decorator": [sys.executable, str(HERE / "train_autoddp.py"), stamp_file, str(nproc)],
        "cli": [
            *_tool("autoddp", "autoddp.cli"),
            "-n",
            str(nproc),
            str(HERE / "train_torchrun.py"),
            stamp_file,
        ],
    }


LAUNCH_LABELS = {
    "torchrun": "torchrun --standalone (hand-written DDP)",
    "decorator": "python script.py (@autoddp.distributed)",
    "cli": "autoddp -n N script.py (hand-written DDP)",
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of one contender: seconds from the command's start, and worker memory (KiB)."""

    first_step_s: float
    exit_s: float
    worker_hwm_kb: int  # the largest peak resident set among the workers
    worker_pss_kb: int  # the largest proportional set among the workers, at the end


def launch_once(command: Sequence[str], stamp_file: str, nproc: int) -> Launch:
    """Run one launch contender and read what its workers recorded."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(stamp_file)
    start, end, _ = run_command(command, LAUNCH_TIMEOUT_S)
    with open(stamp_file) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    first = [r["time"] for r in records if r["event"] == "first_step"]
    done = [r for r in records if r["event"] == "done"]
    if len(first) != nproc or len(done) != nproc:
        raise RuntimeError(f"{' '.join(command)}: expected {nproc} ranks to report, got {records}")
    return Launch(
        first_step_s=max(first) - start,
        exit_s=end - start,
        worker_hwm_kb=max(r["hwm_kb"] for r in done),
        worker_pss_kb=max(r["pss_kb"] for r in done),
    )


def measure_launch(nproc: int, rounds: int, progress: Callable[[str], None]) -> dict[str, list[Launch]]:
    """``rounds`` rounds; each runs every contender once, in an order that rotates every round."""
    results: dict[str, list[Launch]] = {}
    with tempfile.TemporaryDirectory(prefix="autoddp-bench-") as folder:
        stamp_file = os.path.join(folder, "stamps.jsonl")
        commands = launch_commands(nproc, stamp_file)
        names = list(commands)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                launch = launch_once(commands[name], stamp_file, nproc)
                results.setdefault(name, []).append(launch)
                progress(
                    f"launch round {round_index + 1}/{rounds}: {name} first step {launch.first_step_s:.2f} s"
                )
    return results


def paired_ratio(results: dict[str, list[Launch]], name: str, field: str) -> tuple[float, float]:
    """(median, min) over rounds of ``name``'s figure over torchrun's in the same round."""
    ratios = [
        getattr(a, field) / getattr(b, field) for a, b in zip(results[name], results["torchrun"], strict=True)
    ]
    return statistics.median(ratios), min(ratios)


# --- steady-state step time -----------------------------------------------------------------


def measure_step_time(nproc: int, pairs: int, warmup_blocks: int, control: bool) -> dict[str, Any]:
    """Run ``steady_state.py`` (both contenders in one run of ``nproc`` workers); its JSON result."""
    command = [
        sys.executable,
        str(HERE / "steady_state.py"),
        f"--pairs={pairs}",
        f"--warmup-blocks={warmup_blocks}",
        f"--nproc={nproc}",
        *(["--control"] if control else []),
    ]
    _, _, out = run_command(command, timeout=120 + (4 if control else 2) * pairs)
    return last_json_line(out)


def measure_repeated_call(nproc: int, repeats: int) -> dict[str, Any]:
    """Run ``repeated_call.py``: repeated decorated calls passing a model against passing nothing."""
    command = [sys.executable, str(HERE / "repeated_call.py"), f"--repeats={repeats}", f"--nproc={nproc}"]
    _, _, out = run_command(command, timeout=300)
    return last_json_line(out)


def measure_fsdp(nproc: int, rounds: int) -> dict[str, Any]:
    """Run ``memory.py``: peak memory per rank and step time of hand-written DDP, autoddp, FSDP."""
    command = [sys.executable, str(HERE / "memory.py"), f"--rounds={rounds}", f"--nproc={nproc}"]
    _, _, out = run_command(command, timeout=600)
    return last_json_line(out)


def measure_capture_cost(nproc: int, pairs: int, warmup_blocks: int) -> dict[str, Any]:
    """Run ``steady_state.py --capture``: captured plain code against ``prepare`` (medium model)."""
    command = [
        sys.executable,
        str(HERE / "steady_state.py"),
        "--capture",
        "--sizes=medium",
        f"--pairs={pairs}",
        f"--warmup-blocks={warmup_blocks}",
        f"--nproc={nproc}",
    ]
    _, _, out = run_command(command, timeout=120 + 2 * pairs)
    return last_json_line(out)["medium"]


# --- import and single-process call overhead ------------------------------------------------

IMPORT_PROBE = (
    "import time; start = time.perf_counter(); import torch; middle = time.perf_counter(); "
    "import autoddp; end = time.perf_counter(); print(middle - start, end - middle)"
)


def measure_import_overhead(repeats: int) -> dict[str, list[float]]:
    """``import torch``, then ``import autoddp``, in ``repeats`` fresh interpreters: milliseconds each."""
    torch_ms, autoddp_ms = [], []
    for _ in range(repeats):
        _, _, out = run_command([sys.executable, "-c", IMPORT_PROBE], timeout=120)
        torch_s, autoddp_s = (float(word) for word in out.split())
        torch_ms.append(torch_s * 1e3)
        autoddp_ms.append(autoddp_s * 1e3)
    return {"torch_ms": torch_ms, "autoddp_ms": autoddp_ms}


def measure_call_overhead(repeats: int, calls: int) -> dict[str, list[float]]:
    """Run ``call_overhead.py``: microseconds per call that ``@distributed(nproc=1)`` adds."""
    command = [sys.executable, str(HERE / "call_overhead.py"), f"--repeats={repeats}", f"--calls={calls}"]
    _, _, out = run_command(command, timeout=300)
    return last_json_line(out)


def measure_result_transfer(mib: int, repeats: int) -> dict[str, Any]:
    """Run ``result_transfer.py``: returning an N MiB tensor against torch.save + torch.load."""
    command = [sys.executable, str(HERE / "result_transfer.py"), f"--mib={mib}", f"--repeats={repeats}"]
    _, _, out = run_command(command, timeout=600)
    return last_json_line(out)


# --- the report -----------------------------------------------------------------------------


def machine_description(nproc: int) -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    from common import use_cuda

    cuda = use_cuda(nproc)
    return {
        "processes": nproc,
        "device": f"{nproc} x {torch.cuda.get_device_name(0)} (NCCL)"
        if cuda
        else f"{nproc} CPU processes (gloo)",
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


class Table:
    """Rows of (label, min, median, unit) under section titles, printed aligned."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, str, str]] = []

    def section(self, title: str) -> None:
        """A title line; the rows after it are indented."""
        self.lines.append((title, "", "", ""))

    def row(self, label: str, values: Sequence[float], unit: str, digits: int = 2) -> None:
        """A row of repeated measurements: their min and median."""
        self.figures(label, *min_median(values), unit, digits)

    def figures(self, label: str, low: float | None, mid: float, unit: str, digits: int = 2) -> None:
        """A row of figures computed elsewhere, for the min (if any) and median columns."""
        shown_low = "-" if low is None else f"{low:.{digits}f}"
        self.lines.append((f"  {label}", shown_low, f"{mid:.{digits}f}", unit))

    def print(self) -> None:
        """Print the header and every line, columns aligned."""
        width = max(len(line[0]) for line in self.lines)
        print(f"{'':{width}}  {'min':>9}  {'median':>9}")
        for label, low, mid, unit in self.lines:
            if not low:
                print(label)
            else:
                print(f"{label:{width}}  {low:>9}  {mid:>9}  {unit}")


def _launch_summary(table: Table, launch: dict[str, list[Launch]], nproc: int, suffix: str) -> dict[str, Any]:
    """The launch rows for ``nproc`` processes; keys end with ``suffix`` (none for the main run)."""
    result: dict[str, Any] = {}
    rounds = len(launch["torchrun"])
    table.section(
        f"Launch of {nproc} processes, seconds from the command's start ({rounds} interleaved rounds)"
    )
    for field, what in (("first_step_s", "first step"), ("exit_s", "exit")):
        for name, label in LAUNCH_LABELS.items():
            table.row(f"{what:10}  {label}", [getattr(x, field) for x in launch[name]], "s")
    table.section(f"Worker memory, {nproc} processes, MiB (largest rank)")
    for field, what in (("worker_hwm_kb", "peak RSS"), ("worker_pss_kb", "PSS at end")):
        for name, label in LAUNCH_LABELS.items():
            table.row(f"{what:10}  {label}", [getattr(x, field) / 1024 for x in launch[name]], "MiB", 0)
    table.section(f"Launch ratios against torchrun, {nproc} processes, per round (lower is better)")
    for key, name, field, label in (
        ("first_step_ratio_vs_torchrun", "decorator", "first_step_s", "first step, decorator"),
        ("exit_ratio_vs_torchrun", "decorator", "exit_s", "exit, decorator"),
        ("cli_first_step_ratio_vs_torchrun", "cli", "first_step_s", "first step, autoddp command"),
        ("cli_exit_ratio_vs_torchrun", "cli", "exit_s", "exit, autoddp command"),
        ("worker_rss_ratio_vs_torchrun", "decorator", "worker_hwm_kb", "worker peak RSS, decorator"),
        ("cli_worker_rss_ratio_vs_torchrun", "cli", "worker_hwm_kb", "worker peak RSS, autoddp command"),
        ("worker_pss_ratio_vs_torchrun", "decorator", "worker_pss_kb", "worker PSS, decorator"),
        ("cli_worker_pss_ratio_vs_torchrun", "cli", "worker_pss_kb", "worker PSS, autoddp command"),
    ):
        median, low = paired_ratio(launch, name, field)
        table.figures(label, low, median, "x", 3)
        result[key + suffix] = round(median, 3)
    result["first_step_ratio_vs_torchrun_min" + suffix] = round(
        paired_ratio(launch, "decorator", "first_step_s")[1], 3
    )
    result["first_step_s_median" + suffix] = {
        name: round(statistics.median(x.first_step_s for x in runs), 3) for name, runs in launch.items()
    }
    return result


def summary(
    table: Table,
    launch: dict[int, dict[str, list[Launch]]] | None,
    steps: dict[str, Any] | None,
    imports: dict[str, list[float]],
    calls: dict[str, list[float]],
    transfer: dict[str, Any] | None = None,
    capture: dict[str, Any] | None = None,
    fsdp: dict[str, Any] | None = None,
    repeated: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fill the table and return the JSON summary (None for figures not measured)."""
    result: dict[str, Any] = {}
    for nproc, runs in (launch or {}).items():
        result.update(_launch_summary(table, runs, nproc, suffix="" if nproc == min(launch) else f"_{nproc}"))
    if steps:
        table.section("Steady-state step time, autoddp.prepare vs hand-written DDP + DistributedSampler")
        for size, figures in steps.items():
            wall, cpu = figures["wall"], figures["cpu"]
            table.figures(
                f"{size:6}  autoddp", wall["autoddp_ms_min"], wall["autoddp_ms_median"], "ms/step", 3
            )
            table.figures(f"{size:6}  DDP", wall["ddp_ms_min"], wall["ddp_ms_median"], "ms/step", 3)
            interval = f"{wall['ratio_ci_low']:.3f}-{wall['ratio_ci_high']:.3f}"
            note = f"x  (95% CI {interval}; CPU-time ratio {cpu['ratio']:.3f})"
            table.figures(
                f"{size:6}  ratio, median of {figures['pairs']} block pairs", None, wall["ratio"], note, 3
            )
            result[f"step_time_ratio_{size}"] = round(wall["ratio"], 3)
            result[f"step_time_ratio_{size}_ci95"] = [
                round(wall["ratio_ci_low"], 3),
                round(wall["ratio_ci_high"], 3),
            ]
            result[f"step_cpu_ratio_{size}"] = round(cpu["ratio"], 3)
            control = figures.get("control")
            if control:
                interval = f"{control['ratio_ci_low']:.3f}-{control['ratio_ci_high']:.3f}"
                label = f"{size:6}  A/A control: DDP against itself (noise floor)"
                table.figures(label, None, control["ratio"], f"x  (95% CI {interval})", 3)
                result[f"step_time_ratio_{size}_control"] = round(control["ratio"], 3)
    if capture:
        wall = capture["wall"]
        table.section("Capture's cost on the step: captured plain code vs prepare (medium model)")
        table.figures("captured", wall["autoddp_ms_min"], wall["autoddp_ms_median"], "ms/step", 3)
        table.figures("prepare", wall["ddp_ms_min"], wall["ddp_ms_median"], "ms/step", 3)
        interval = f"{wall['ratio_ci_low']:.3f}-{wall['ratio_ci_high']:.3f}"
        table.figures(
            f"ratio, median of {capture['pairs']} pairs", None, wall["ratio"], f"x  (95% CI {interval})", 3
        )
        result["capture_step_time_ratio_vs_prepare"] = round(wall["ratio"], 3)
        result["capture_step_time_ratio_vs_prepare_ci95"] = [
            round(wall["ratio_ci_low"], 3),
            round(wall["ratio_ci_high"], 3),
        ]
    if repeated:
        table.section("Repeated decorated calls in one session (a notebook), seconds per call")
        table.row("passed nothing", repeated["empty_call_s"], "s")
        table.row("passed a model (its workers build a DDP)", repeated["model_call_s"], "s")
        table.figures("ratio of medians", None, repeated["ratio"], "x", 3)
        result["repeated_call_ratio_model_vs_empty"] = round(repeated["ratio"], 3)
    if fsdp:
        table.section(
            f"strategy='fsdp' vs 'ddp', Adam on an MLP of {fsdp['parameters'] / 1e6:.1f}M parameters"
        )
        for name in ("ddp", "fsdp"):
            table.figures(f"{name:4}  peak memory per rank", None, fsdp[f"{name}_peak_mib"], "MiB", 0)
            table.figures(
                f"{name:4}  params+grads+optimizer state", None, fsdp[f"{name}_state_mib"], "MiB", 0
            )
            table.figures(f"{name:4}  step time", None, fsdp[f"{name}_step_ms"], "ms", 1)
        for key in (
            "ddp_peak_ratio_vs_hand",
            "ddp_step_ratio_vs_hand",
            "fsdp_peak_ratio_vs_ddp",
            "fsdp_state_ratio_vs_ddp",
            "fsdp_step_ratio_vs_ddp",
        ):
            table.figures(key, None, fsdp[key], "x", 3)
            result[key] = fsdp[key]
    table.section(f"Import and call overhead ({len(imports['autoddp_ms'])} fresh interpreters)")
    table.row("import torch", imports["torch_ms"], "ms", 1)
    table.row("import autoddp, after torch", imports["autoddp_ms"], "ms", 1)
    table.row("@distributed(nproc=1) call, per call", calls["number_argument_us"], "us", 1)
    table.row("  same, passed a model and a DataLoader", calls["model_and_loader_us"], "us", 1)
    result["import_overhead_ms"] = round(statistics.median(imports["autoddp_ms"]), 1)
    result["import_overhead_ms_min"] = round(min(imports["autoddp_ms"]), 1)
    result["single_process_call_overhead_us"] = round(statistics.median(calls["number_argument_us"]), 1)
    result["single_process_call_overhead_model_loader_us"] = round(
        statistics.median(calls["model_and_loader_us"]), 1
    )
    if transfer:
        table.section(f"Returning a {transfer['mib']} MiB tensor from rank 0 (decorator, 2 processes)")
        table.row("autoddp, the transfer alone", transfer["transfer_s"], "s")
        table.row("torch.save + torch.load of it", transfer["torch_save_load_s"], "s")
        table.figures("ratio", None, transfer["ratio"], "x", 3)
        result["result_transfer_ratio_vs_torch_save"] = round(transfer["ratio"], 3)
        result["result_transfer_s_median"] = round(statistics.median(transfer["transfer_s"]), 2)
    return result


KEYS = (
    "first_step_ratio_vs_torchrun",
    "step_time_ratio_small",
    "step_time_ratio_medium",
    "import_overhead_ms",
    "single_process_call_overhead_us",
    "worker_rss_ratio_vs_torchrun",
)


def main(argv: Sequence[str] | None = None) -> None:
    """Measure everything the mode asks for, print the table, and the JSON line last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer repeats: about 2-3 minutes")
    mode.add_argument("--selftest", action="store_true", help="import and call overhead only (seconds)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per launch (default 2)")
    parser.add_argument("--wide", type=int, default=8, help="processes of the wide launch rows (default 8)")
    args = parser.parse_args(argv)
    settings = SELFTEST if args.selftest else QUICK if args.quick else FULL
    began = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - began:6.1f} s] {message}", file=sys.stderr, flush=True)

    machine = machine_description(args.nproc)
    launch = steps = None
    if settings.launch_rounds:
        # Untimed: bring torch, dynamo (DDP imports it) and both launchers into the page cache.
        warm = "import torch, torch._dynamo, torch.distributed.run, autoddp, autoddp.cli"
        run_command([sys.executable, "-c", warm], timeout=300)
        progress("warm-up done")
        launch = {args.nproc: measure_launch(args.nproc, settings.launch_rounds, progress)}
        if settings.launch_rounds_wide and args.wide > args.nproc:
            launch[args.wide] = measure_launch(args.wide, settings.launch_rounds_wide, progress)
    capture = None
    if settings.step_pairs:
        progress("steady-state step time")
        steps = measure_step_time(
            args.nproc, settings.step_pairs, settings.step_warmup_blocks, settings.step_control
        )
        progress("capture's cost on the step")
        capture = measure_capture_cost(args.nproc, settings.step_pairs // 2, settings.step_warmup_blocks)
    progress("import and call overhead")
    imports = measure_import_overhead(settings.import_repeats)
    calls = measure_call_overhead(settings.call_repeats, settings.call_count)
    transfer = None
    if settings.transfer_mib:
        progress(f"returning a {settings.transfer_mib} MiB tensor")
        transfer = measure_result_transfer(settings.transfer_mib, settings.transfer_repeats)

    repeated = None
    if settings.launch_rounds:
        progress("repeated decorated calls")
        repeated = measure_repeated_call(args.nproc, settings.launch_rounds)
    fsdp = None
    if settings.fsdp_rounds:
        progress("strategy='fsdp' against 'ddp'")
        fsdp = measure_fsdp(args.nproc, settings.fsdp_rounds)

    table = Table()
    figures = summary(table, launch, steps, imports, calls, transfer, capture, fsdp, repeated)
    mode_name = "selftest" if args.selftest else "quick" if args.quick else "full"
    print(f"autoddp benchmarks ({mode_name}): {machine['device']}, {machine['cpu_cores']} CPU cores,")
    print(f"  {machine['platform']}, Python {machine['python']}, torch {machine['torch']}")
    table.print()
    print(f"({time.monotonic() - began:.0f} s)", flush=True)
    result = {key: figures.get(key) for key in KEYS}
    result.update({key: value for key, value in figures.items() if key not in result})
    result.update(mode=mode_name, machine=machine)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
