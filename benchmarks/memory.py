"""Peak memory per rank and step time: hand-written DDP, autoddp's DDP, and strategy="fsdp".

    python benchmarks/memory.py [--rounds N] [--steps N] [--nproc N]

The same model (an MLP of 16 blocks of 1024x1024, about 16.8M parameters, trained with Adam: its
state is 4 copies of the parameters) is trained in fresh workers started by
``@autoddp.distributed``, the contenders taking turns round by round: ``hand`` wraps it in
``DistributedDataParallel`` with torch's defaults (capture off), ``ddp`` is ``autoddp.prepare``
with autoddp's defaults, ``fsdp`` is ``strategy="fsdp"``. Each worker resets its peak resident
set after building the model and two warm-up steps (``/proc/self/clear_refs``), trains
``--steps`` steps, and reports that peak and the bytes of parameters, gradients and optimizer
state it holds itself. Prints one JSON object with the medians and the ratios ddp / hand and
fsdp / ddp.
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


def train(steps: int, hand_written: bool = False) -> dict[str, float]:
    """One worker's figures for the contender it was started as."""
    torch.manual_seed(0)
    if hand_written:
        device = autoddp.device()
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(make_model().to(device), device_ids=ids)
    else:
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
    # gradients that are views into DDP's buckets share storage: count each storage once
    storages = {}
    for p in model.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    state += sum(storages.values())
    state += sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return {"step_ms": elapsed * 1e3, "peak_mib": _peak_kb() / 1024, "state_mib": state / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    backend = None if use_cuda(args.nproc) else "gloo"
    contenders = {
        "hand": ({"capture": False}, True),
        "ddp": ({}, False),
        "fsdp": ({"strategy": "fsdp"}, False),
    }
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    for round_ in range(args.rounds):
        order = list(contenders) if round_ % 2 == 0 else list(reversed(contenders))
        for name in order:
            options, hand_written = contenders[name]
            run = autoddp.distributed(nproc=args.nproc, backend=backend, **options)(train)
            figures[name].append(run(args.steps, hand_written))
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in figures.items()
    }
    result = {
        **{f"{name}_{key}": round(value, 2) for name, m in medians.items() for key, value in m.items()},
        "ddp_peak_ratio_vs_hand": round(medians["ddp"]["peak_mib"] / medians["hand"]["peak_mib"], 3),
        "ddp_step_ratio_vs_hand": round(medians["ddp"]["step_ms"] / medians["hand"]["step_ms"], 3),
        "fsdp_peak_ratio_vs_ddp": round(medians["fsdp"]["peak_mib"] / medians["ddp"]["peak_mib"], 3),
        "fsdp_state_ratio_vs_ddp": round(medians["fsdp"]["state_mib"] / medians["ddp"]["state_mib"], 3),
        "fsdp_step_ratio_vs_ddp": round(medians["fsdp"]["step_ms"] / medians["ddp"]["step_ms"], 3),
        "parameters": sum(p.numel() for p in make_model().parameters()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
