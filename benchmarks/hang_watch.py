"""The hang report's cost on the training step, measured two ways.

    python benchmarks/hang_watch.py [--pairs N] [--launch-pairs N] [--nproc N] [--sizes small,medium]

1. In the same workers (``--pairs`` block pairs per model): one run of ``--nproc`` workers started
   by ``@autoddp.distributed`` with the hang report on (its default, ``hang_report=60``: the
   launcher's watch reads the records all along). Two copies of the same prepared model and
   shuffling loader (``steady_state.build_autoddp``) take turns in blocks of steps (A B, then B
   A, ...), as in ``steady_state.py``: "on" trains as every watched worker does (each collective
   and DDP's ``backward()`` write the rank's record on entry and exit), "off" with the marks
   passing through, as they do in a thread nobody watches. Nothing is patched between blocks:
   replacing functions and class attributes makes Python drop the attribute lookups it had
   specialised, which alone costs more than the marks. A control times "on" against "on".
2. Whole launches (``--launch-pairs``): ``hang_report=60`` against ``hang_report=0`` (no marks, no
   watch; both with ``step_report=False``, which would keep the marks), alternating (A B, then B
   A, ...), each a fresh run of the workers timing the same training; a pair's ratio is on over
   off. Everything is in it, and so is the noise of separate runs.

It also times, in isolation, one marked call and one call passing through, over the same call
unwrapped; a marked call that returns a work object (``async_op=True``: the work is kept, weakly,
for the worker's poller), and a marked call on a tensor once CUDA is in use in the process (the
check for a CUDA tensor; on a GPU a CUDA event is then recorded after the call, not timed here:
this machine has none); the poller's time per token (``pending.Pending.poll``); and one check
of the launcher's watch (one ``Watch.tick`` over the run's live records, which the watch makes
about once a second). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import autoddp
from autoddp.core import _variables
from autoddp.in_rank.hang import record
from autoddp.in_rank.hang.marks import MARKS
from autoddp.launch.hang.watch import Watch

from common import make_dataset, make_model, use_cuda
from steady_state import STEPS_PER_BLOCK, build_autoddp, summarise, train_block


def compare(size: str, pairs: int, warmup_blocks: int, control: bool = False) -> dict[str, Any]:
    """Alternate blocks with the marks on and passing through on the ``size`` model."""
    torch.manual_seed(0)
    template, dataset = make_model(size), make_dataset(size)
    steps = STEPS_PER_BLOCK[size]
    contenders = {name: build_autoddp(copy.deepcopy(template), dataset) for name in ("on", "off")}
    marking = MARKS.thread  # the marks pass through in any other thread than this one
    threads = {"on": marking, "off": marking if control else -1}
    wall: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for pair in range(-warmup_blocks, pairs):
            for name in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                MARKS.thread = threads[name]
                block_wall, block_cpu = train_block(*contenders[name], steps)
                if pair >= 0:
                    wall[name].append(block_wall / steps)
                    cpu[name].append(block_cpu / steps)
    finally:
        MARKS.thread = marking
    del contenders
    gc.collect()
    return {"steps_per_block": steps, "pairs": pairs, "wall": _named(wall), "cpu": _named(cpu)}


def _named(times: dict[str, list[float]]) -> dict[str, float]:
    """``steady_state.summarise`` with its contenders named on / off."""
    figures = summarise(times["on"], times["off"])
    return {key.replace("autoddp_", "on_").replace("ddp_", "off_"): value for key, value in figures.items()}


def call_costs_us(calls: int = 200_000) -> dict[str, float]:
    """Microseconds a marked call, and a call passing through, cost over the same call unwrapped."""

    def call() -> None:
        return None

    wrapped = MARKS._collective(record.NAMES.index("all_reduce"), call)
    marking = MARKS.thread

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append(time.perf_counter() - start)
        return min(times) / calls * 1e6

    class Done(dist.Work):
        def is_completed(self) -> bool:
            return True

    work, tensor = Done(), torch.ones(1)

    def call_async() -> Any:
        return work

    def call_on(t: torch.Tensor) -> None:
        return None

    wrapped_async = MARKS._collective(record.NAMES.index("all_reduce"), call_async)
    wrapped_on = MARKS._collective(record.NAMES.index("all_reduce"), call_on)
    waits = MARKS.pending
    plain = best(call)
    marked = best(wrapped)
    try:
        marked_async = best(wrapped_async) - best(call_async)
        waits.cuda, cuda = True, waits.cuda
        marked_on = best(lambda: wrapped_on(tensor)) - best(lambda: call_on(tensor))
    finally:
        waits.cuda = cuda
        waits.tokens.clear()
    for _ in range(1000):
        waits.work(0, 0.0, work)
    start = time.perf_counter()
    waits.poll()  # 1000 completed tokens dropped, the record told
    poll = (time.perf_counter() - start) / 1000 * 1e6
    MARKS.thread = -1
    try:
        passing = best(wrapped)
    finally:
        MARKS.thread = marking
    return {
        "marked_call_us": marked - plain,
        "passing_call_us": passing - plain,
        "marked_async_call_us": marked_async,
        "marked_call_checking_cuda_us": marked_on,
        "poll_per_token_us": poll,
    }


def tick_cost_us(ticks: int = 2000) -> float:
    """Microseconds of one check of the launcher's watch over this run's live records."""
    watch = Watch(os.environ[_variables.HANG_FOLDER], autoddp.world_size(), 60.0, emit=lambda line: None)
    start = time.perf_counter()
    for _ in range(ticks):
        watch.tick(time.monotonic())
    return (time.perf_counter() - start) / ticks * 1e6


def in_workers(sizes: list[str], pairs: int, warmup_blocks: int) -> dict[str, Any]:
    """Part 1, in the workers of one run; the isolated costs on rank 0."""
    if MARKS.thread == -1:
        raise RuntimeError("the hang report's marks are not installed in this worker: nothing to measure")
    result: dict[str, Any] = {}
    for size in sizes:
        result[size] = compare(size, pairs, warmup_blocks)
        result[size]["control"] = compare(size, pairs, warmup_blocks, control=True)["wall"]
    dist.barrier()
    if autoddp.rank() == 0:
        result.update(call_costs_us(), watch_tick_us=tick_cost_us())
    dist.barrier()
    return result


def one_launch(size: str, blocks: int) -> float:
    """Part 2, one run: the median seconds per step over ``blocks`` blocks (after 20 untimed)."""
    torch.manual_seed(0)
    contender = build_autoddp(make_model(size), make_dataset(size))
    steps = STEPS_PER_BLOCK[size]
    times = [train_block(*contender, steps)[0] / steps for _ in range(blocks + 20)][20:]
    return statistics.median(times)


def launches(size: str, pairs: int, blocks: int, nproc: int, backend: str | None) -> dict[str, Any]:
    """Part 2: whole runs with hang_report=60 and hang_report=0, alternating."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for pair in range(pairs):
        for name in ("on", "off") if pair % 2 == 0 else ("off", "on"):
            seconds = 60 if name == "on" else 0  # (no step report: it would keep the marks at 0)
            launch = autoddp.distributed(nproc=nproc, backend=backend, hang_report=seconds, step_report=False)
            times[name].append(launch(one_launch)(size, blocks))
    return {"pairs": pairs, "blocks": blocks, "wall": _named(times)}


def main() -> None:
    """Measure both ways, print a summary and the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1000, help="timed block pairs per model, in the workers")
    parser.add_argument("--warmup-blocks", type=int, default=10, help="untimed block pairs first")
    parser.add_argument("--launch-pairs", type=int, default=10, help="pairs of whole runs per model")
    parser.add_argument("--launch-blocks", type=int, default=200, help="timed blocks in each run")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="small,medium")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    backend = None if use_cuda(args.nproc) else "gloo"
    run = autoddp.distributed(nproc=args.nproc, backend=backend, hang_report=60, step_report=False)(
        in_workers
    )
    result = run(sizes, args.pairs, args.warmup_blocks)
    for size in sizes:
        if args.launch_pairs:
            whole_runs = launches(size, args.launch_pairs, args.launch_blocks, args.nproc, backend)
            result[size]["launches"] = whole_runs
        wall = result[size]["wall"]
        line = (
            f"{size}: in the workers, on {wall['on_ms_median']:.3f} ms/step, "
            f"off {wall['off_ms_median']:.3f}, "
            f"ratio {wall['ratio']:.3f} (95% CI {wall['ratio_ci_low']:.3f}-{wall['ratio_ci_high']:.3f}; "
            f"control {result[size]['control']['ratio']:.3f})"
        )
        if args.launch_pairs:
            whole = result[size]["launches"]["wall"]
            line += (
                f"; whole runs, hang_report=60 over 0: {whole['ratio']:.3f} "
                f"(95% CI {whole['ratio_ci_low']:.3f}-{whole['ratio_ci_high']:.3f})"
            )
        print(line)
    print(
        f"one marked call: +{result['marked_call_us']:.2f} us, one passing through: "
        f"+{result['passing_call_us']:.2f} us; one check of the watch: {result['watch_tick_us']:.0f} us "
        "(about once a second)"
    )
    print(
        f"one marked call returning a work object: +{result['marked_async_call_us']:.2f} us; "
        f"one marked call with CUDA in use (the check for a CUDA tensor): "
        f"+{result['marked_call_checking_cuda_us']:.2f} us; the poller, per token: "
        f"{result['poll_per_token_us']:.2f} us (in its own thread, 4 times a second)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
