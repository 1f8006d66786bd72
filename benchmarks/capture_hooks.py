"""What capture adds to every training step, measured piece by piece (no processes started).

    python benchmarks/capture_hooks.py [--repeat N]

Capture's hooks are global while the user's code runs, so the A/B step benchmark
(``steady_state.py --capture``) puts them on both contenders; this measures them alone:

- the optimizer step pre-hook (torch's global hook) and the ``torch.autograd.backward`` wrapper,
  once their first checks are done: nanoseconds per step, against the call they wrap;
- a watched submodule's call (``models._routing.watch``: auxiliary losses through submodules)
  against the plain module call, per call;
- the sharded sampler streaming a custom sampler in parts (``samplers.ShardedSampler``) against
  torch's DistributedSampler over the same data, per batch of 64.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import timeit

import torch
from torch import nn
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

from autoddp.core import _backward
from autoddp.core.state import CURRENT, RunOptions, World
from autoddp.in_rank import models
from autoddp.in_rank.capture import Session
from autoddp.in_rank.data.samplers import ShardedSampler
from autoddp.in_rank.models import _routing


def _best_ns(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def hooks(repeat: int) -> dict[str, float]:
    session = Session(RunOptions(), join=lambda: World(), planned=World(world_size=2))
    session.undistributed.backward_checked = session.undistributed.step_checked = True

    def plain(
        tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None
    ):
        return None  # (torch.autograd.backward's parameters: the wrapper takes them)

    calls = _backward.BackwardCalls()  # (the one wrapper of backward(): capture's watcher and count)
    calls.registered = (session.steps,)
    calls.listen(session.steps, True)
    calls.counting = (CURRENT, models.BACKWARD)  # (``count`` without putting the wrapper in place)
    wrapped = calls._wrap(plain)
    number = 200_000
    base = _best_ns(lambda: plain(1), number, repeat)
    return {
        "step_pre_hook_ns": round(_best_ns(lambda: session.steps._before_step(None, (), {}), number, repeat)),
        "backward_wrapper_ns": round(_best_ns(lambda: wrapped(1), number, repeat) - base),
    }


class _Replica:
    inside = True  # every normal step's submodule calls run inside the DDP's forward
    bypasses = 0

    def count_bypass(self, grad):  # pragma: no cover - not reached inside the DDP's forward
        self.bypasses += 1


def watcher(repeat: int) -> dict[str, float]:
    torch.set_grad_enabled(True)
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    plain = _best_ns(lambda: layer(x), 20_000, repeat)
    root = nn.Sequential(layer)
    _routing.watch(root, _Replica())
    watched = _best_ns(lambda: layer(x), 20_000, repeat)
    return {"submodule_call_ns": round(plain), "watched_submodule_call_extra_ns": round(watched - plain)}


def sampler(repeat: int) -> dict[str, float]:
    data = range(1_000_000)
    world = World(rank=0, world_size=2)
    batches = 200

    def first_batches(source) -> None:
        iterator = iter(BatchSampler(source, 64, False))
        for _ in range(batches):
            next(iterator)

    sharded = ShardedSampler(RandomSampler(data, replacement=True, num_samples=10**10), world=world, seed=0)
    reference = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    ours = min(timeit.repeat(lambda: first_batches(sharded), number=1, repeat=repeat)) / batches * 1e6
    torchs = min(timeit.repeat(lambda: first_batches(reference), number=1, repeat=repeat)) / batches * 1e6
    return {
        "sharded_sampler_us_per_batch": round(ours, 2),
        "distributed_sampler_us_per_batch": round(torchs, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    result = {**hooks(args.repeat), **watcher(args.repeat), **sampler(args.repeat)}
    print(
        f"step pre-hook {result['step_pre_hook_ns']} ns/step, backward wrapper "
        f"{result['backward_wrapper_ns']} ns/step; a watched submodule call "
        f"+{result['watched_submodule_call_extra_ns']} ns over {result['submodule_call_ns']} ns; "
        f"streamed sampler {result['sharded_sampler_us_per_batch']} us/batch of 64 (torch's "
        f"DistributedSampler over 1M items: {result['distributed_sampler_us_per_batch']} us, "
        "first 200 batches, its permutation included)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
