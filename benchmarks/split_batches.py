"""What ``split_batches`` costs per step against plain DDP at the same per-process batch.

    python benchmarks/split_batches.py [--nproc N] [--batch B] [--pairs N] [--steps N] [--cpu]

One run of ``--nproc`` workers (``@autoddp.distributed``, capture off; gloo on the CPU, NCCL on
GPUs unless ``--cpu``). Two contenders train the same MLP from the same weights, each process on
``--batch`` samples per step: plain DDP (``autoddp.prepare``, a loader of ``batch_size=B``) and
split mode (``autoddp.prepare(..., split_batches=True)``, a loader of ``batch_size=B * N``, each
process taking its part). They take turns in blocks of ``--steps`` steps (A B, then B A, ...),
the loader's iteration included (split mode's sampler and weights are part of its cost). Twice:
without BatchNorm (split mode adds the sampler's parts and the gradient weight of uneven
batches: none here) and with BatchNorm (split mode's global statistics: one all-reduce per layer
in the forward, one in the backward). Prints the median ratio split / plain of the block times,
then one JSON object. No timing is asserted anywhere: the numbers are for reading.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoddp

FEATURES, HIDDEN, CLASSES = 64, 256, 10


def _model(batchnorm: bool) -> nn.Module:
    norm = [nn.BatchNorm1d(HIDDEN)] if batchnorm else []
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        *norm,
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        *norm,
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def _block(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, steps: int) -> float:
    device = autoddp.device()
    start = time.perf_counter()
    for _, (x, y) in zip(range(steps), loader, strict=False):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _compare(batchnorm: bool, batch: int, pairs: int, steps: int) -> dict:
    world = autoddp.world_size()
    torch.manual_seed(0)
    data = TensorDataset(
        torch.randn(batch * world * (steps + 1), FEATURES),
        torch.randint(0, CLASSES, (batch * world * (steps + 1),)),
    )
    base = _model(batchnorm)
    plain = autoddp.prepare(_model(batchnorm))
    plain.load_state_dict(base.state_dict())
    split = _model(batchnorm)
    split.load_state_dict(base.state_dict())
    split, split_loader = autoddp.prepare(
        (split, DataLoader(data, batch_size=batch * world, shuffle=True)), split_batches=True
    )
    plain_loader = autoddp.prepare(DataLoader(data, batch_size=batch, shuffle=True))
    contenders = {
        "plain": (plain, torch.optim.SGD(plain.parameters(), lr=0.01), plain_loader),
        "split": (split, torch.optim.SGD(split.parameters(), lr=0.01), split_loader),
    }
    for model, optimizer, loader in contenders.values():  # warm-up
        _block(model, optimizer, loader, steps)
    ratios = []
    for pair in range(pairs):
        order = ["plain", "split"] if pair % 2 == 0 else ["split", "plain"]
        times = {name: _block(*contenders[name], steps) for name in order}
        ratios.append(times["split"] / times["plain"])
    return {
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


@autoddp.distributed(capture=False)
def _run(batch: int, pairs: int, steps: int) -> dict:
    warnings.filterwarnings("ignore", message=".*has BatchNorm layers")  # plain DDP's: per process
    results = {
        "without_batchnorm": _compare(False, batch, pairs, steps),
        "with_batchnorm": _compare(True, batch, pairs, steps),
    }
    results.update(nproc=autoddp.world_size(), device=str(autoddp.device()), batch_per_process=batch)
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="samples per process per step")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU even where GPUs are")
    args = parser.parse_args(argv)
    run = autoddp.distributed(
        _run.__wrapped__, nproc=args.nproc, capture=False, backend="gloo" if args.cpu else None
    )
    results = run(args.batch, args.pairs, args.steps)
    for name in ("without_batchnorm", "with_batchnorm"):
        r = results[name]
        print(
            f"{name.replace('_', ' '):>18}: split / plain step time {r['ratio_median']:.3f} "
            f"(min {r['ratio_min']:.3f}, max {r['ratio_max']:.3f}) "
            f"over {args.pairs} pairs of {args.steps} steps"
        )
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
