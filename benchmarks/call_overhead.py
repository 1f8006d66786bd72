"""What ``@autoddp.distributed`` costs per call when it runs in place (one process, nproc=1).

    python benchmarks/call_overhead.py [--repeats N] [--calls N]

Times a plain function against the same function decorated with ``nproc=1``, in turns, for two
kinds of arguments: a number (the bare cost of the wrapper) and a small model plus a DataLoader
(what a train function receives, so ``prepare`` has real work: moving the model to the device).
Prints one JSON object: per-call overhead in microseconds for every repeat.
"""

from __future__ import annotations

import argparse
import json
import timeit
from typing import Any

import torch
from torch.utils.data import DataLoader

import autoddp

from common import BATCH_SIZE, make_dataset, make_model


def train(*args: Any) -> int:
    """Stands for a train function; returns a plain value, as most do."""
    return len(args)


def overheads_us(arguments: tuple, repeats: int, calls: int) -> list[float]:
    """Per repeat: (decorated - plain) time per call, in microseconds, the two timed in turns."""
    decorated = autoddp.distributed(nproc=1)(train)
    result = []
    for repeat in range(repeats):
        pair = [("plain", train), ("decorated", decorated)]
        seconds: dict[str, float] = {}
        for name, fn in pair if repeat % 2 == 0 else reversed(pair):
            seconds[name] = timeit.timeit(lambda fn=fn: fn(*arguments), number=calls)
        result.append((seconds["decorated"] - seconds["plain"]) / calls * 1e6)
    return result


def main() -> None:
    """Time both kinds of argument and print the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = make_model("medium")
    loader = DataLoader(make_dataset("small"), batch_size=BATCH_SIZE, shuffle=True)
    result = {
        "number_argument_us": overheads_us((1,), args.repeats, args.calls),
        "model_and_loader_us": overheads_us((model, loader), args.repeats, args.calls),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
