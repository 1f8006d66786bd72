"""Where autoddp's time goes in a training step: each piece it adds, switched off one after another.

    python benchmarks/step_parts.py [--size small|medium|deep] [--rounds N] [--steps N] [--clock cpu|wall]

One run of 2 gloo workers under ``@autoddp.distributed`` with capture on (what ``autoddp
script.py`` runs; the hang report's marks on). In the same processes, plain single-process code
captured by autoddp (a model, SGD, a shuffled DataLoader) and hand-written DDP (a DataLoader over
a DistributedSampler, ``set_epoch`` every pass, ``gradient_as_bucket_view=True`` as autoddp's)
take turns in blocks of ``--steps`` steps, the order rotating every round. Every step is timed
in phases (data, forward, zero_grad, backward, step). ``--clock cpu`` (the default) reads the
main thread's CPU time: what the rank itself spends, left untouched by waiting for the other
rank in the all-reduce and by other programs' load, so that a few µs show on a busy machine;
``wall`` reads ``perf_counter``. ``instructions`` counts, with valgrind's callgrind, the
instructions of the main thread in each block (``instructions.py``): no load changes them, so a
piece of a few µs shows without hundreds of rounds; the run takes minutes (valgrind).

The captured contender runs in variants that switch autoddp's pieces off one after another:

- ``decorated``: all of it, as under the decorator and the command alike;
- ``- ledger``: the ledger, which tells the step guard which backward passes DDP averaged: every
  forward's outputs hooked (``models._reduction``; ``replica.watched``);
- ``- guard``: the optimizer's step pre-hook that averages gradients DDP did not
  (``models._averaging``);
- ``- sampler``: autoddp's sharded sampler (its loader is swapped for hand-written DDP's);
- ``- hang marks``: the marks around ``backward()`` write nothing (``in_rank.hang.marks``);
- ``- step hooks``: the global optimizer step pre-hooks taken out (capture's, the step report's);
- ``- backward wrappers``: ``torch.autograd.backward``'s wrapper (capture's first check, the step
  report's and the marks' frames) and the counter at torch's engine call (``models.at_engine``)
  taken out;

then hand-written DDP with those global hooks on (``ddp under autoddp``: what a script that
makes its own DDP pays under the command) and off (``ddp``: what torchrun runs). A piece costs
the median over rounds of the difference between two consecutive variants' blocks of one round
(each block's median step: blocks next to each other in time); what the last variant still costs
over ``ddp`` is the routing of the model's calls through its DDP (``models._routing``). The
second table times each check alone in a tight loop on rank 0: a lower bound, since in a real
step its code and data are cold (on a shared 2-core VM, 3-10 times the tight-loop figure). The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import itertools
import json
import statistics
import sys
import time
import timeit
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.optim import optimizer as torch_optimizer
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import autoddp
import instructions
from autoddp.core._compat import engine, tensor_hooks
from autoddp.core.state import CURRENT
from autoddp.in_rank import step_report
from autoddp.in_rank.hang import marks
from autoddp.in_rank.models import _routing

from common import BATCH_SIZE, make_dataset, make_model

PHASES = ("data", "forward", "zero_grad", "backward", "step", "total")
#: The captured contender's variants, each switching off one more piece (module docstring).
VARIANTS = (
    "decorated",
    "- ledger",
    "- guard",
    "- sampler",
    "- hang marks",
    "- step hooks",
    "- backward wrappers",
)
BASELINES = ("ddp under autoddp", "ddp")


def batches(loader: DataLoader, sampler: DistributedSampler | None = None) -> Iterator[Any]:
    """Endless batches; ``sampler``: hand-written DDP's, given ``set_epoch`` before every pass."""
    for epoch in itertools.count():
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader


def timed_step(model: Any, optimizer: Any, data: Iterator[Any], clock: Callable[[], int], rec: dict) -> None:
    """One training step, each phase's nanoseconds appended to ``rec``."""
    t0 = clock()
    x, y = next(data)
    t1 = clock()
    loss = F.cross_entropy(model(x), y)
    t2 = clock()
    optimizer.zero_grad()
    t3 = clock()
    loss.backward()
    t4 = clock()
    optimizer.step()
    t5 = clock()
    for phase, spent in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0), strict=True):
        rec[phase].append(spent)


class Switches:
    """What each variant switches off, and putting it all back."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.replica = model.__dict__[_routing.REPLICA_ATTR]
        self.optimizer = optimizer
        self.guard = dict(optimizer._optimizer_step_pre_hooks)
        self.backward = torch.autograd.backward
        innermost = self.backward
        while hasattr(innermost, "__wrapped__"):  # (each wrapper's functools.wraps)
            innermost = innermost.__wrapped__
        self.plain_backward = innermost
        self.global_hooks = dict(torch_optimizer._global_optimizer_pre_hooks)
        self.engine_owner, self.engine_name = engine.engine_call()
        self.engine = getattr(self.engine_owner, self.engine_name)
        self.plain_engine = inspect.unwrap(self.engine)
        self.marked_thread = marks.MARKS.thread

    @contextlib.contextmanager
    def off(self, pieces: int) -> Iterator[None]:
        """The first ``pieces`` pieces of ``VARIANTS[1:]`` off for a ``with`` block."""
        self.replica.watched = pieces < 1
        if pieces >= 2:
            self.optimizer._optimizer_step_pre_hooks.clear()
        if pieces >= 4:
            marks.MARKS.thread = -2  # (the marks' wrappers pass through: not this thread's calls)
        if pieces >= 5:
            torch_optimizer._global_optimizer_pre_hooks.clear()
        if pieces >= 6:
            torch.autograd.backward = self.plain_backward
            setattr(self.engine_owner, self.engine_name, self.plain_engine)
        try:
            yield
        finally:
            self.replica.watched = True
            self.optimizer._optimizer_step_pre_hooks.update(self.guard)
            marks.MARKS.thread = self.marked_thread
            torch.autograd.backward = self.backward
            setattr(self.engine_owner, self.engine_name, self.engine)
            torch_optimizer._global_optimizer_pre_hooks.update(self.global_hooks)


def contenders(size: str) -> tuple[dict[str, tuple], Switches]:
    """Every variant's (model, optimizer, batches, pieces off), and their switches."""
    torch.manual_seed(0)
    template, dataset = make_model(size), make_dataset(size)
    model = copy.deepcopy(template)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # capture wraps the model here
    captured = batches(DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True))
    own_sampler = DistributedSampler(dataset, shuffle=True)
    own = batches(DataLoader(dataset, batch_size=BATCH_SIZE, sampler=own_sampler), own_sampler)
    ddp = DistributedDataParallel(copy.deepcopy(template), gradient_as_bucket_view=True)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    ddp_sampler = DistributedSampler(dataset, shuffle=True)
    ddp_batches = batches(DataLoader(dataset, batch_size=BATCH_SIZE, sampler=ddp_sampler), ddp_sampler)
    table = {
        name: (model, optimizer, captured if pieces < 3 else own, pieces)
        for pieces, name in enumerate(VARIANTS)
    }
    table["ddp under autoddp"] = (ddp, ddp_optimizer, ddp_batches, 0)
    table["ddp"] = (ddp, ddp_optimizer, ddp_batches, len(VARIANTS) - 1)
    return table, Switches(model, optimizer)


def phases(size: str, rounds: int, steps: int, clock_name: str) -> dict[str, Any]:
    """Median µs per phase of every contender, and each block's medians (rounds in a rotating order).

    ``instructions``: the phases are not timed; each block's instructions per step are its
    ``total`` (in thousands, where the clocks give µs).
    """
    clock = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}.get(clock_name, lambda: 0)
    counter = instructions.Counter() if clock_name == "instructions" else None
    order: list[str] = []
    table, switches = contenders(size)
    names = list(table)
    recorded: dict[str, dict[str, list[int]]] = {name: {p: [] for p in PHASES} for name in names}
    blocks: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PHASES} for name in names}
    warm_up = 1 if counter else 3  # (instructions: no cache or clock to warm, only first calls)
    for number in range(warm_up + rounds):
        turn = number % len(names)
        for name in names[turn:] + names[:turn]:
            model, optimizer, data, pieces = table[name]
            dist.barrier()
            block: dict[str, list[int]] = {p: [] for p in PHASES}
            with switches.off(pieces), counter.block() if counter else contextlib.nullcontext():
                for _ in range(steps):
                    timed_step(model, optimizer, data, clock, block)
            order.append(name)
            if number >= warm_up and counter is None:
                for phase, spent in block.items():
                    recorded[name][phase] += spent
                    blocks[name][phase].append(statistics.median(spent) / 1e3)
    if counter is not None:  # each block's instructions per step, in thousands, as its total
        for name, count in list(zip(order, counter.read(), strict=True))[warm_up * len(names) :]:
            blocks[name]["total"].append(count / steps / 1e3)
            recorded[name]["total"].append(count / steps)
    figures: dict[str, Any] = {
        name: {p: statistics.median(v) / 1e3 if v else float("nan") for p, v in rec.items()}
        for name, rec in recorded.items()
    }
    figures["_blocks"] = blocks  # (for the paired differences; taken out before returning)
    figures["_switches"] = switches  # (for the tight loops)
    figures["_table"] = table
    return figures


def _best_us(fn: Callable[[], Any], number: int = 300, repeat: int = 30) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def tight_loops(table: dict[str, tuple], switches: Switches) -> dict[str, float]:
    """Each check alone, µs per step (rank 0; its forwards issue no collective)."""
    model, optimizer, captured, _ = table["decorated"]
    ddp = table["ddp"][0]
    replica = switches.replica
    x, _ = next(captured)
    leaf = torch.ones(2, requires_grad=True)
    found: dict[str, float] = {}
    replica.watched = False
    found["routing: the model's call through its DDP (vs DDP's own call)"] = _best_us(
        lambda: model(x)
    ) - _best_us(lambda: ddp(x))
    replica.watched = True
    found["ledger: hooking a forward's output"] = _best_us(
        lambda: replica.reduction.forwarded(leaf * 2, True)
    ) - _best_us(lambda: leaf * 2)
    replica.reduction.take()

    def backward(hooked: bool) -> None:
        out = leaf * 2
        if hooked:
            tensor_hooks.hook_output(out, replica.reduction.reached)
        switches.plain_backward(out.sum())

    found["ledger: its hook run by backward()"] = _best_us(lambda: backward(True)) - _best_us(
        lambda: backward(False)
    )
    replica.reduction.unreduced = None  # (the loops above looked like second backward passes)
    guard = next(iter(switches.guard.values()))

    def step_check(checked: bool) -> None:
        replica.forwards += 1  # a forward went through the DDP since the last step: nothing to average
        if checked:
            guard(optimizer, (optimizer,), {})

    found["guard: the step pre-hook"] = _best_us(lambda: step_check(True)) - _best_us(
        lambda: step_check(False)
    )
    steps_hook = next(iter(switches.global_hooks.values()))
    found["capture's global step pre-hook"] = _best_us(lambda: steps_hook(optimizer, (), {}))
    found["backward() wrappers (capture, counting, hang marks)"] = _best_us(
        lambda: switches.backward((leaf * 2).sum())
    ) - _best_us(lambda: switches.plain_backward((leaf * 2).sum()))
    if marks.MARKS.map is not None:
        found["hang marks: the two writes"] = _best_us(
            lambda: (marks.MARKS._write(0, 0), marks.MARKS._write(0, 0))
        )

    def per_batch(sampler: Any, count: int = 32) -> None:
        drawn = iter(BatchSampler(sampler, BATCH_SIZE, False))
        for _ in range(count):
            next(drawn)

    sharded = captured.gi_frame.f_locals["loader"].sampler
    own = table["- sampler"][2].gi_frame.f_locals["sampler"]
    found["sampler: a batch of the sharded pass (vs DistributedSampler)"] = (
        _best_us(lambda: per_batch(sharded), 20, 20) - _best_us(lambda: per_batch(own), 20, 20)
    ) / 32
    return found


def measure(size: str, rounds: int, steps: int, clock: str) -> dict[str, Any]:
    """The decorated function's body: the phases on every rank, the tight loops on rank 0."""
    if clock == "instructions":
        # The step report times a step's backward to its end once per SAMPLE_SECONDS: under valgrind,
        # steps 50 times longer, nearly every step, where natively one in ~60 (its cost: step_report.py).
        step_report.SAMPLE_SECONDS = float("inf")
    figures = phases(size, rounds, steps, clock)
    switches, table = figures.pop("_switches"), figures.pop("_table")
    figures["pieces_us"] = pieces(figures.pop("_blocks"))
    if dist.get_rank() == 0 and clock != "instructions":
        figures["tight_loops_us"] = tight_loops(table, switches)
    dist.barrier()
    figures["capture"] = CURRENT.capture is not None
    return figures


def _paired(blocks: dict[str, dict[str, list[float]]], ours: str, theirs: str) -> dict[str, float]:
    """Per phase, the median over rounds of ``ours`` block minus ``theirs`` block of the same round
    (blocks next to each other in time: the machine's drift falls on both)."""
    return {
        p: statistics.median(a - b for a, b in zip(blocks[ours][p], blocks[theirs][p], strict=True))
        if blocks[ours][p]
        else float("nan")  # (instructions: the total alone)
        for p in PHASES
    }


def pieces(blocks: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Each piece's µs per phase: consecutive variants' difference; the routing: the last over ``ddp``."""
    chain = [*VARIANTS, "ddp"]
    names = [
        "ledger (every forward's outputs hooked)",
        "guard",
        "sampler",
        "hang marks",
        "global step hooks",
        "backward wrappers",
        "routing (the rest)",
    ]
    found = {name: _paired(blocks, chain[i], chain[i + 1]) for i, name in enumerate(names)}
    found["all of autoddp (command and decorator)"] = _paired(blocks, "decorated", "ddp")
    found["hooks on a hand-written DDP"] = _paired(blocks, "ddp under autoddp", "ddp")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("small", "medium", "deep"))
    parser.add_argument(
        "--rounds", type=int, default=200, help="timed rounds (every contender one block each)"
    )
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--clock", default="cpu", choices=("cpu", "wall", "instructions"))
    args = parser.parse_args(argv)
    if args.clock == "instructions" and not instructions.under_valgrind():
        return instructions.rerun([__file__, *(sys.argv[1:] if argv is None else argv)])
    run = autoddp.distributed(nproc=2, backend="gloo")(measure)
    figures = run(args.size, args.rounds, args.steps, args.clock)
    if not figures.pop("capture"):
        print("capture was off: nothing to compare", file=sys.stderr)
        return 1
    loops = figures.pop("tight_loops_us", {})
    unit = "thousand instructions (the main thread's, callgrind)" if args.clock == "instructions" else "µs"
    print(f"median {unit} per step ({args.clock} clock, rank 0, {args.size} model; instructions: total only)")
    print(f"{'':28}" + "".join(f"{p:>10}" for p in PHASES))
    for name in (*VARIANTS, *BASELINES):
        print(f"{name:28}" + "".join(f"{figures[name][p]:10.1f}" for p in PHASES))
    split = figures.pop("pieces_us")
    print("what each piece costs (median over rounds of the difference of two blocks in one round):")
    for name, cost in split.items():
        print(f"{name:28}" + "".join(f"{cost[p]:+10.1f}" for p in PHASES))
    print("each check alone, tight loop (µs per step):")
    for name, cost in loops.items():
        print(f"  {cost:7.2f}  {name}")
    print(
        json.dumps(
            {
                "size": args.size,
                "clock": args.clock,
                "phases_us": figures,
                "pieces_us": split,
                "tight_loops_us": loops,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
