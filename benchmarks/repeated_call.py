"""A notebook-style session: the cost of each repeated decorated call that passes a model.

    python benchmarks/repeated_call.py [--repeats N] [--nproc N]

In one process, a ``@autoddp.distributed(nproc=N)`` function is called again and again, in
turns passed nothing and passed a small model (which its workers wrap in DDP). The first call
is not timed. Prints one JSON object: seconds per call of each kind and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import autoddp


def train(model: torch.nn.Module | None = None) -> int:
    """Stands for a train function; with a model its workers build a DDP."""
    if model is not None:
        model(torch.ones(1, 4)).sum().backward()
    return autoddp.world_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    call = autoddp.distributed(nproc=args.nproc, backend="gloo")(train)
    call()  # the first call: the caller's one-time imports
    empty, with_model = [], []
    for repeat in range(args.repeats):
        for kind in ("empty", "model") if repeat % 2 == 0 else ("model", "empty"):
            start = time.perf_counter()
            call(torch.nn.Linear(4, 2) if kind == "model" else None)
            (with_model if kind == "model" else empty).append(time.perf_counter() - start)
    ratio = statistics.median(with_model) / statistics.median(empty)
    print(json.dumps({"empty_call_s": empty, "model_call_s": with_model, "ratio": ratio}))


if __name__ == "__main__":
    main()
