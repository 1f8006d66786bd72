"""Steady-state step time: autoddp's prepared model and loader against hand-written DDP.

    python benchmarks/steady_state.py [--pairs N] [--warmup-blocks N] [--nproc N] [--sizes small,medium]
                                      [--control]

Both contenders live in the same processes (one run of ``--nproc`` workers started by
``@autoddp.distributed``), train copies of the same model on the same data with the same batch,
and take turns in blocks of steps (A B, then B A, ...), so that whatever else the machine is
doing falls on both alike. A pair's ratio is autoddp's block time over hand-written DDP's; the
figure is the median over pairs. ``--control`` adds the same measurement of hand-written DDP
against itself, whose distance from 1 is what noise and the harness alone produce. The last line
printed is one JSON object.

- autoddp: ``autoddp.prepare(model)`` and ``autoddp.prepare(loader)`` on a plain
  ``DataLoader(shuffle=True)``; every new pass over the loader reshuffles by itself.
- hand-written: ``DistributedDataParallel(model)`` and a ``DataLoader`` with a
  ``DistributedSampler``, ``sampler.set_epoch(epoch)`` before every pass.

``--capture`` compares, the same way, plain single-GPU code that autoddp captured (a model given
to an optimizer, a shuffling DataLoader iterated) against the ``prepare`` contender: the cost of
capture on the training step.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import autoddp

from common import BATCH_SIZE, make_dataset, make_model, use_cuda

# Steps per timed block: short blocks (about 10 ms on a CPU core) put the two contenders of a pair
# so close together in time that load from other programs mostly falls on both alike or on
# neither; on a busy 2-core machine they gave a 95% interval about 3 times narrower than blocks
# 5 times longer, in the same total time.
STEPS_PER_BLOCK = {"small": 5, "medium": 2}


def autoddp_batches(loader: DataLoader) -> Iterator[Any]:
    """Endless batches from an autoddp-prepared loader: each pass is a new, reshuffled epoch."""
    while True:
        yield from loader


def hand_written_batches(loader: DataLoader, sampler: DistributedSampler) -> Iterator[Any]:
    """Endless batches from a hand-made DistributedSampler loader, calling set_epoch as DDP users do."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def train_block(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[Any], steps: int
) -> tuple[float, float]:
    """Train ``steps`` steps; return (wall seconds on the slowest rank, CPU seconds of all ranks).

    CPU time (every thread of every rank) does not grow while a rank waits for a CPU that
    another program holds, so on a busy machine it shows the contenders' own cost more steadily
    than wall time; it leaves out the time spent waiting for messages.
    """
    device = autoddp.device()
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        x, y = next(batches)
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    cpu = torch.tensor([time.process_time() - start_cpu], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # CPU tensors: gloo, also beside NCCL
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    return float(wall.item()), float(cpu.item())


def summarise(autoddp_times: list[float], ddp_times: list[float]) -> dict[str, float]:
    """Median of the per-pair ratios autoddp / hand-written, its 95% interval, and per-step times."""
    ratios = sorted(a / b for a, b in zip(autoddp_times, ddp_times, strict=True))
    n = len(ratios)
    half_width = 0.98 * math.sqrt(n)  # distribution-free interval for the median (order statistics)
    low, high = max(0, int(n / 2 - half_width)), min(n - 1, math.ceil(n / 2 + half_width))
    return {
        "ratio": statistics.median(ratios),
        "ratio_ci_low": ratios[low],
        "ratio_ci_high": ratios[high],
        "ratio_of_medians": statistics.median(autoddp_times) / statistics.median(ddp_times),
        "autoddp_ms_min": min(autoddp_times) * 1e3,
        "autoddp_ms_median": statistics.median(autoddp_times) * 1e3,
        "ddp_ms_min": min(ddp_times) * 1e3,
        "ddp_ms_median": statistics.median(ddp_times) * 1e3,
    }


Contender = tuple[torch.nn.Module, torch.optim.Optimizer, Iterator[Any]]


def build_autoddp(template: torch.nn.Module, dataset: Dataset) -> Contender:
    """autoddp's way: prepare a copy of the model and a plain shuffling DataLoader."""
    model = autoddp.prepare(copy.deepcopy(template))
    loader = autoddp.prepare(DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), autoddp_batches(loader)


def build_hand_written(template: torch.nn.Module, dataset: Dataset) -> Contender:
    """The usual way: DistributedDataParallel and a DataLoader over a DistributedSampler."""
    device = autoddp.device()
    model = DistributedDataParallel(
        copy.deepcopy(template).to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), hand_written_batches(loader, sampler)


def build_captured(template: torch.nn.Module, dataset: Dataset) -> Contender:
    """Plain single-GPU code, distributed by capture: the optimizer finds the model, the loader
    is sharded when first iterated."""
    model = copy.deepcopy(template).to(autoddp.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True)
    return model, optimizer, autoddp_batches(loader)


BUILDERS = {"autoddp": build_autoddp, "ddp": build_hand_written}
#: Capture against prepare: "autoddp" is the captured contender, "ddp" the prepared one.
CAPTURE_BUILDERS = {"autoddp": build_captured, "ddp": build_autoddp}


def compare(
    size: str, pairs: int, warmup_blocks: int, builders: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Alternate blocks of the two contenders on the ``size`` model; per-step times and their ratios.

    Half of the pairs run with autoddp's contender built first, half with the hand-written one
    built first, so that neither gains from where its objects happen to lie in memory.
    ``builders`` replaces the contenders (the A/A control puts hand-written DDP in both places).
    """
    builders = builders or BUILDERS
    torch.manual_seed(0)
    template = make_model(size)
    dataset = make_dataset(size)
    steps = STEPS_PER_BLOCK[size]
    wall: dict[str, list[float]] = {"autoddp": [], "ddp": []}
    cpu: dict[str, list[float]] = {"autoddp": [], "ddp": []}
    for built_first in ("autoddp", "ddp"):
        names = sorted(builders, key=lambda name: name != built_first)
        contenders = {name: builders[name](template, dataset) for name in names}
        for _ in range(warmup_blocks):
            for name in names:
                train_block(*contenders[name], steps)
        for pair in range(pairs // 2):
            for name in names if pair % 2 == 0 else reversed(names):
                block_wall, block_cpu = train_block(*contenders[name], steps)
                wall[name].append(block_wall / steps)
                cpu[name].append(block_cpu / steps)
        del contenders  # free the hand-made DDP while its process group is still there
        gc.collect()
    return {
        "steps_per_block": steps,
        "pairs": len(wall["ddp"]),
        "wall": summarise(wall["autoddp"], wall["ddp"]),
        "cpu": summarise(cpu["autoddp"], cpu["ddp"]),
    }


def run_all(
    sizes: list[str], pairs: int, warmup_blocks: int, control: bool = False, capture: bool = False
) -> dict[str, Any]:
    """Every size, one after the other, in the same worker processes.

    With ``control``, each size also runs an A/A comparison (hand-written DDP against itself): how
    far from 1 the harness puts two identical contenders on this machine. With ``capture`` the
    contenders are captured plain code against ``prepare``.
    """
    result = {}
    for size in sizes:
        result[size] = compare(size, pairs, warmup_blocks, CAPTURE_BUILDERS if capture else None)
        if control:
            same = {"autoddp": build_hand_written, "ddp": build_hand_written}
            result[size]["control"] = compare(size, pairs, warmup_blocks, same)["wall"]
    return result


def main() -> None:
    """Start the workers, compare every size, print the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1000, help="timed block pairs per model")
    parser.add_argument("--warmup-blocks", type=int, default=10, help="untimed blocks per contender first")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--control", action="store_true", help="also time hand-written DDP against itself")
    parser.add_argument("--capture", action="store_true", help="captured plain code against prepare")
    args = parser.parse_args()
    backend = None if use_cuda(args.nproc) else "gloo"
    launch = autoddp.distributed(nproc=args.nproc, backend=backend)(run_all)
    result = launch(args.sizes.split(","), args.pairs, args.warmup_blocks, args.control, args.capture)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
