"""Sharded against replicated: peak memory per rank and step time of strategy="fsdp" vs "ddp".

    python benchmarks/fsdp_memory.py [--rounds N] [--steps N] [--nproc N]

The same model (an MLP of 16 blocks of 1024x1024, about 16.8M parameters, trained with Adam: its
state is 4 copies of the parameters) is trained by ``@autoddp.distributed(strategy=...)`` in
fresh workers, the two strategies alternating round by round. Each worker resets its peak
resident set after building the model and two warm-up steps (``/proc/self/clear_refs``), trains
``--steps`` steps, and reports that peak and the bytes of parameters, gradients and optimizer
state it holds itself. Prints one JSON object with the medians and the ratios fsdp / ddp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import autoddp

from common import use_cuda

WIDTH, BLOCKS, BATCH = 1024, 16, 32


def make_model() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def _peak_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # Linux: the peak resident set starts again from now


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def train(steps: int) -> dict[str, float]:
    """One worker's figures for the strategy it was started with."""
    torch.manual_seed(0)
    model = autoddp.prepare(make_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    device = autoddp.device()
    x = torch.randn(BATCH, WIDTH, device=device)
    y = torch.randint(0, 10, (BATCH,), device=device)

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    step()
    step()
    _reset_peak()
    autoddp.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    autoddp.barrier()
    elapsed = (time.perf_counter() - start) / steps
    state = sum(_local_bytes(p) for p in model.parameters())
    state += sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    state += sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return {"step_ms": elapsed * 1e3, "peak_mib": _peak_kb() / 1024, "state_mib": state / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    backend = None if use_cuda(args.nproc) else "gloo"
    figures: dict[str, list[dict[str, float]]] = {"ddp": [], "fsdp": []}
    for round_ in range(args.rounds):
        for strategy in ("ddp", "fsdp") if round_ % 2 == 0 else ("fsdp", "ddp"):
            run = autoddp.distributed(nproc=args.nproc, backend=backend, strategy=strategy)(train)
            figures[strategy].append(run(args.steps))
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in figures.items()
    }
    result = {
        **{f"{name}_{key}": round(value, 2) for name, m in medians.items() for key, value in m.items()},
        "fsdp_peak_ratio_vs_ddp": round(medians["fsdp"]["peak_mib"] / medians["ddp"]["peak_mib"], 3),
        "fsdp_state_ratio_vs_ddp": round(medians["fsdp"]["state_mib"] / medians["ddp"]["state_mib"], 3),
        "fsdp_step_ratio_vs_ddp": round(medians["fsdp"]["step_ms"] / medians["ddp"]["step_ms"], 3),
        "parameters": sum(p.numel() for p in make_model().parameters()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
