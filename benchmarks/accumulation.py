"""Gradient accumulation: unchanged single-process code under autoddp against hand-written DDP.

    python benchmarks/accumulation.py [--micro-steps K] [--rounds N] [--width W] [--batch B] [--nproc N]
                                      [--strategy ddp|fsdp]

One run of ``--nproc`` gloo workers (``@autoddp.distributed``, capture on: the code inside is
what a single-process script runs), an MLP of ``--width`` (the default: 12.6M parameters, 50 MB
of gradients, so that the all-reduce weighs) trained with SGD in optimizer steps of K = 8
micro-batches each, three ways in the same processes, from the same weights, on the same data:

- ``autoddp``: single-process accumulation, unchanged: ``(loss / K).backward()`` K times, then
  ``optimizer.step(); optimizer.zero_grad()``; capture wraps the model when the optimizer is made;
- ``no_sync``: hand-written DDP with ``model.no_sync()`` around the first K - 1 micro-steps'
  forward and backward (what an expert writes);
- ``ddp``: hand-written DDP without ``no_sync`` (every backward all-reduces).

Both hand-written models use ``gradient_as_bucket_view=True`` as autoddp's DDP does, so that only
the synchronisation differs. The contenders take turns, one optimizer step each, in a rotating
order (``--rounds`` rounds after 2 untimed ones); a round's time is the slowest rank's. Printed:
the median ratios autoddp / no_sync and autoddp / ddp, the median step times, the all-reduces each
contender issues per optimizer step (counted by torch's profiler over one more step each: its
gloo all-reduce events, one per DDP bucket, and any other all-reduce) and those counts in whole
gradient synchronisations (all-reduces over the buckets of one), and how far autoddp's weights
end from hand-written ``no_sync``'s (the same steps on the same data: only the order of float
additions differs). The last line printed is one JSON object.

``--strategy fsdp``: the same with FSDP2 (``strategy="fsdp"`` for autoddp; by hand, ``fully_shard``
on each Linear layer and the root, as autoddp shards this model, with
``set_requires_gradient_sync(False)`` on the first K - 1 micro-steps for ``no_sync``); the
collectives counted are the reduce-scatters (one per layer per synchronisation) and all-reduces.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import autoddp

CONTENDERS = ("autoddp", "no_sync", "ddp")
FEATURES, CLASSES = 1024, 10


def make_model(width: int) -> torch.nn.Module:
    """An MLP FEATURES -> width -> width // 2 -> CLASSES (width 4096: 12.6M parameters)."""
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width // 2),
        torch.nn.ReLU(),
        torch.nn.Linear(width // 2, CLASSES),
    )


def single_process_step(model: Any, optimizer: Any, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One optimizer step of accumulation as one process writes it (autoddp's contender)."""
    for x, y in micro:
        loss = F.cross_entropy(model(x), y) / len(micro)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def no_sync_step(model: Any, optimizer: Any, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Hand-written DDP's accumulation: no gradient synchronisation but at the last micro-step."""
    for index, (x, y) in enumerate(micro):
        skip = model.no_sync() if index < len(micro) - 1 else contextlib.nullcontext()
        with skip:  # the forward too: DDP decides at the forward whether the backward synchronises
            loss = F.cross_entropy(model(x), y) / len(micro)
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


STEPS: dict[str, Callable[..., None]] = {
    "autoddp": single_process_step,
    "no_sync": no_sync_step,
    "ddp": single_process_step,
}


def fsdp_no_sync_step(model: Any, optimizer: Any, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Hand-written FSDP2's accumulation: no reduce-scatter but at the last micro-step."""
    for index, (x, y) in enumerate(micro):
        model.set_requires_gradient_sync(index == len(micro) - 1)
        loss = F.cross_entropy(model(x), y) / len(micro)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def hand_sharded(template: torch.nn.Module) -> torch.nn.Module:
    """``template`` sharded by hand as autoddp shards it: each Linear layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(template)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def all_reduces(step: Callable[[], None]) -> dict[str, int]:
    """The gradient synchronisations one call of ``step`` issues on this rank (all-reduces, and
    FSDP2's reduce-scatters), by torch profiler event name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: dict[str, int] = {}
    for event in prof.events():
        name = event.name
        if any(part in name for part in ("all_reduce", "allreduce", "reduce_scatter")):
            counts[name] = counts.get(name, 0) + 1
    return counts


def _calls(counts: dict[str, int]) -> int:
    """All-reduce calls in ``counts``: gloo's own events where there are (one per collective),
    else the dispatcher's (``c10d::allreduce_``)."""
    gloo = sum(n for name, n in counts.items() if name.startswith("gloo:"))
    return gloo or sum(n for name, n in counts.items() if name.startswith("c10d::"))


def _timed(step: Callable[[], None]) -> float:
    """Seconds for ``step`` on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    step()
    spent = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return float(spent.item())


def measure(width: int, batch: int, micro_steps: int, rounds: int, strategy: str = "ddp") -> dict[str, Any]:
    """The decorated function's body: every contender's times and counts (rank 0's returned)."""
    torch.manual_seed(0)  # the same template on every rank
    template = make_model(width)
    generator = torch.Generator().manual_seed(1 + autoddp.rank())  # each rank its own data
    micro = [
        (
            torch.randn(batch, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (batch,), generator=generator),
        )
        for _ in range(micro_steps)
    ]
    models: dict[str, Any] = {"autoddp": copy.deepcopy(template)}
    optimizers = {"autoddp": torch.optim.SGD(models["autoddp"].parameters(), lr=0.01)}  # capture wraps here
    for name in ("no_sync", "ddp"):
        if strategy == "fsdp":
            models[name] = hand_sharded(template)
        else:
            models[name] = DistributedDataParallel(copy.deepcopy(template), gradient_as_bucket_view=True)
        optimizers[name] = torch.optim.SGD(models[name].parameters(), lr=0.01)
    made = {**STEPS, "no_sync": fsdp_no_sync_step} if strategy == "fsdp" else STEPS
    steps = {name: (lambda n=name: made[n](models[n], optimizers[n], micro)) for name in CONTENDERS}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for number in range(2 + rounds):
        turn = number % len(CONTENDERS)
        for name in CONTENDERS[turn:] + CONTENDERS[:turn]:
            spent = _timed(steps[name])
            if number >= 2:
                times[name].append(spent)
    counts = {name: all_reduces(steps[name]) for name in CONTENDERS}
    hand = models["no_sync"].module if strategy == "ddp" else models["no_sync"]
    ours, theirs = ([_whole(p) for p in m.parameters()] for m in (models["autoddp"], hand))
    return {
        "parameters": sum(p.numel() for p in template.parameters()),
        "times": times,
        "counts": counts,
        "max_weight_difference": max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True)),
    }


def _whole(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()


def summarise(result: dict[str, Any], micro_steps: int) -> dict[str, Any]:
    """Ratios (median of the per-round ratios), step times and all-reduce counts."""
    times = result["times"]
    calls = {name: _calls(result["counts"][name]) for name in CONTENDERS}
    buckets = max(1, round(calls["ddp"] / micro_steps))  # ddp synchronises at every backward
    return {
        "ratio_vs_no_sync": statistics.median(
            a / b for a, b in zip(times["autoddp"], times["no_sync"], strict=True)
        ),
        "ratio_vs_ddp": statistics.median(a / b for a, b in zip(times["autoddp"], times["ddp"], strict=True)),
        "step_ms": {name: statistics.median(times[name]) * 1e3 for name in CONTENDERS},
        "all_reduces_per_step": calls,
        "synchronisations_per_step": {name: calls[name] / buckets for name in CONTENDERS},
        "buckets_per_synchronisation": buckets,
        "profiler_events": result["counts"],
        "max_weight_difference_vs_no_sync": result["max_weight_difference"],
        "parameters": result["parameters"],
        "micro_steps": micro_steps,
        "rounds": len(times["autoddp"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-steps", type=int, default=8, help="K: micro-batches per optimizer step")
    parser.add_argument(
        "--rounds", type=int, default=10, help="timed rounds (one optimizer step per contender)"
    )
    parser.add_argument(
        "--width", type=int, default=4096, help="the MLP's first hidden width (4096: 12.6M parameters)"
    )
    parser.add_argument("--batch", type=int, default=16, help="samples per micro-batch per process")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp", help="DDP, or FSDP2 everywhere")
    args = parser.parse_args(argv)
    # (no step report: the three contenders take turns in the same workers)
    run = autoddp.distributed(nproc=args.nproc, backend="gloo", step_report=False, strategy=args.strategy)(
        measure
    )
    measured = run(args.width, args.batch, args.micro_steps, args.rounds, args.strategy)
    summary = {**summarise(measured, args.micro_steps), "strategy": args.strategy}
    ms, calls, syncs = (
        summary["step_ms"],
        summary["all_reduces_per_step"],
        summary["synchronisations_per_step"],
    )
    print(
        f"{summary['parameters'] / 1e6:.1f}M parameters, K = {args.micro_steps}, {summary['rounds']} rounds, "
        f"{args.nproc} gloo processes; per optimizer step:"
    )
    for name in CONTENDERS:
        print(
            f"  {name:8} {ms[name]:8.1f} ms  {calls[name]:3} all-reduces ({syncs[name]:g} synchronisations)"
        )
    print(
        f"autoddp / no_sync {summary['ratio_vs_no_sync']:.3f}, autoddp / ddp {summary['ratio_vs_ddp']:.3f}; "
        f"autoddp's weights vs no_sync's: max difference {summary['max_weight_difference_vs_no_sync']:.2e}"
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
