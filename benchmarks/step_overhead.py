"""What autoddp adds to a training step, at 30, 300 and 3000 parameter tensors.

    python benchmarks/step_overhead.py [--sizes 30,300,3000] [--pairs N] [--steps N] [--nproc N]

One run of ``--nproc`` gloo workers (``@autoddp.distributed``, capture off). For each size, a
stack of ``Linear(8, 8)`` layers with that many parameter tensors (two per layer) is trained by
``autoddp.prepare`` and, from the same weights, by hand-written ``DistributedDataParallel``; they
take turns in blocks of ``--steps`` steps (A B, then B A, ...). Per size it prints the median
ratio of the block times and the median time autoddp adds per step (the difference), and, alone,
the check autoddp makes before every forward (``Replica.for_call``: did the parameters change?)
how many submodules carry a watcher (``models._routing.watch``: one method call per submodule
call, only for a model under capture's optimizer guard; ``capture_hooks.py`` times one). The
check must stay flat across the sizes. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import timeit
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import autoddp
from autoddp.in_rank.models import _routing

FEATURES = 8
BATCH = 16


def make_model(tensors: int) -> nn.Sequential:
    """``tensors`` parameter tensors: ``tensors // 2`` Linear(8, 8) layers (weight and bias each)."""
    return nn.Sequential(*(nn.Linear(FEATURES, FEATURES) for _ in range(max(1, tensors // 2))))


def _block(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> float:
    """Seconds for ``steps`` training steps on the same batch."""
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), x).backward()
        optimizer.step()
    return time.perf_counter() - start


def _check_us(model: nn.Module) -> float:
    """Best microseconds of the check before a forward with gradients, alone."""
    replica = model.__dict__[_routing.REPLICA_ATTR]
    return min(timeit.repeat(lambda: replica.for_call(model), number=200, repeat=5)) / 200 * 1e6


def _watched(model: nn.Module) -> int:
    """Submodules whose calls a watcher counts (``_routing.watch``: only under an optimizer's guard)."""
    return sum("forward" in layer.__dict__ for layer in model)


def measure(sizes: list[int], pairs: int, steps: int) -> dict[str, Any]:
    """The decorated function's body: every size's figures on this rank (rank 0's are printed)."""
    results: dict[str, Any] = {}
    for tensors in sizes:
        torch.manual_seed(0)
        template = make_model(tensors)
        ours = autoddp.prepare(copy.deepcopy(template))
        theirs = DistributedDataParallel(copy.deepcopy(template), gradient_as_bucket_view=True)
        contenders = {
            "autoddp": (ours, torch.optim.SGD(ours.parameters(), lr=1e-3)),
            "ddp": (theirs, torch.optim.SGD(theirs.parameters(), lr=1e-3)),
        }
        x = torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(autoddp.rank()))
        for model, optimizer in contenders.values():
            _block(model, optimizer, x, 2)  # warm-up (the first forward broadcasts rank 0's weights)
        ratios, added, plain = [], [], []
        for index in range(pairs):
            times = {}
            for name in ("autoddp", "ddp") if index % 2 == 0 else ("ddp", "autoddp"):
                dist.barrier()
                times[name] = _block(*contenders[name], x, steps)
            ratios.append(times["autoddp"] / times["ddp"])
            added.append((times["autoddp"] - times["ddp"]) / steps * 1e6)
            plain.append(times["ddp"] / steps * 1e3)
        results[str(tensors)] = {
            "parameter_tensors": sum(1 for _ in ours.parameters()),
            "ratio": statistics.median(ratios),
            "added_us_per_step": statistics.median(added),
            "ddp_ms_per_step": statistics.median(plain),
            "check_us": _check_us(ours),
            "watched_submodules": _watched(autoddp.unwrap(ours)),
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="30,300,3000", help="parameter tensors per model, comma-separated")
    parser.add_argument("--pairs", type=int, default=20, help="timed block pairs per size")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    run = autoddp.distributed(nproc=args.nproc, backend="gloo", capture=False)(measure)
    results = run(sizes, args.pairs, args.steps)
    for figures in results.values():
        print(
            f"{figures['parameter_tensors']:5} tensors: step {figures['ddp_ms_per_step']:.2f} ms (DDP), "
            f"ratio {figures['ratio']:.3f}, autoddp adds {figures['added_us_per_step']:+.1f} us/step; "
            f"the check {figures['check_us']:.2f} us, {figures['watched_submodules']} watched submodules"
        )
    checks = [figures["check_us"] for figures in results.values()]
    results["check_flat"] = max(checks) / min(checks) if min(checks) > 0 else None
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
