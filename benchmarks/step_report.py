"""What the step report costs a training step: microseconds per step with and without it.

    python benchmarks/step_report.py [--pairs N] [--steps N] [--size small|medium] [--calls N]

In this process, no launch: the step report's clock (``autoddp.in_rank.step_report``) is
installed as a worker installs it (its record in a temporary folder) and taken out again, in
alternating blocks of ``--steps`` training steps (A B, then B A, ...): each step draws a batch from
a DataLoader, runs the forward and ``backward()`` and steps the optimizer, so every hook of the
clock runs once a step (the batch's ``__next__``, the backward's first node and its two final
callbacks, the step hook and its write into the record). A control times "on" against "on". It
also times each hook alone over the same call without it. Every time is this thread's CPU time
(``time.thread_time``: the data loading, the model and the clock all run on it, one intra-op
thread), so that other processes on a shared machine weigh less. The clock takes no collective:
DDP's all-reduce (and the waiting the report measures) adds nothing here. The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import timeit
from typing import Any

import torch
from torch.utils.data import DataLoader

from autoddp.core.state import World
from autoddp.in_rank.step_report import CLOCK, SAMPLE_SECONDS

from common import BATCH_SIZE, make_dataset, make_model

WORLD = World(rank=0, world_size=2)  # (the clock times only worlds of several processes)


def _block(model: torch.nn.Module, optimizer: Any, loader: DataLoader, steps: int) -> float:
    """CPU seconds of this thread for ``steps`` training steps, each on the next batch of ``loader``."""
    batches = iter(loader)
    start = time.thread_time()
    for _ in range(steps):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return time.thread_time() - start


def compare(size: str, pairs: int, steps: int, control: bool = False) -> dict[str, float]:
    """Median microseconds a step with the clock on and off (or on and on: ``control``)."""
    torch.manual_seed(0)
    model, loader = make_model(size), DataLoader(make_dataset(size), batch_size=BATCH_SIZE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as folder:
        for pair in range(-2, pairs):  # two pairs of warm-up
            for name in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                if name == "on" or control:
                    with CLOCK.installed(folder, WORLD):
                        seconds = _block(model, optimizer, loader, steps)
                else:
                    seconds = _block(model, optimizer, loader, steps)
                if pair >= 0:
                    times[name].append(seconds / steps * 1e6)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    diffs = [a - b for a, b in zip(times["on"], times["off"], strict=True)]
    return {"on_us": on, "off_us": off, "added_us": statistics.median(diffs), "ratio": on / off}


def hook_costs_us(calls: int = 20_000, rounds: int = 9) -> dict[str, float]:
    """Microseconds each hook adds to the call it wraps, timed alone: the best of ``rounds``
    rounds, each timing the call without the clock and with it, one after the other."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.ones(2, 4)
    batches = DataLoader(list(range(calls * 2 * rounds * 4)), batch_size=1)

    def backward() -> None:
        model(x).sum().backward()

    def costs(iterator: Any) -> dict[str, float]:
        def best(fn: Any) -> float:
            return min(timeit.repeat(fn, number=calls, repeat=2, timer=time.thread_time)) / calls * 1e6

        return {
            "next": best(lambda: next(iterator)),
            "backward": best(backward),
            "step": best(optimizer.step),
        }

    plain: dict[str, list[float]] = {}
    clocked: dict[str, list[float]] = {}
    iterator = iter(batches)
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(rounds):
            for name, value in costs(iterator).items():
                plain.setdefault(name, []).append(value)
            with CLOCK.installed(folder, WORLD):
                for name, value in costs(iterator).items():
                    clocked.setdefault(name, []).append(value)
                CLOCK.sampling = True  # every backward timed to its end, as in a step the clock samples
                clocked.setdefault("sampled_backward", []).append(
                    min(timeit.repeat(backward, number=calls, repeat=2, timer=time.thread_time)) / calls * 1e6
                )
    plain["sampled_backward"] = plain["backward"]
    return {f"{name}_us": min(clocked[name]) - min(plain[name]) for name in plain}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30, help="block pairs (A B) timed")
    parser.add_argument("--steps", type=int, default=200, help="steps per block")
    parser.add_argument("--size", default="small", choices=("small", "medium"))
    parser.add_argument("--calls", type=int, default=20_000, help="calls per timing of a hook alone")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    whole = compare(args.size, args.pairs, args.steps)
    control = compare(args.size, args.pairs, args.steps, control=True)
    hooks = hook_costs_us(args.calls)
    print(
        f"{args.size} model, {args.pairs} pairs of {args.steps} steps: {whole['on_us']:.1f} CPU us a step "
        f"with the step report, {whole['off_us']:.1f} us without: +{whole['added_us']:.2f} us "
        f"(ratio {whole['ratio']:.3f}; on over on: {control['added_us']:+.2f} us)"
    )
    print(
        "each hook alone: batch __next__ {next_us:.2f} us, backward {backward_us:.2f} us, "
        "optimizer step {step_us:.2f} us; a backward timed to its end {sampled_backward_us:.2f} us "
        "(one step in {SAMPLE_SECONDS} s)".format(SAMPLE_SECONDS=SAMPLE_SECONDS, **hooks)
    )
    print(json.dumps({"size": args.size, "whole": whole, "control": control, "hooks": hooks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
