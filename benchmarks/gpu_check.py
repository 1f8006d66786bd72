"""End-to-end check of autoddp on the GPUs of this machine, with step times against plain code.

    python benchmarks/gpu_check.py          # every visible GPU; well under 5 minutes
    python benchmarks/gpu_check.py --cpu    # the same code on 2 CPU processes (gloo), to develop it

One ``@autoddp.distributed`` call runs on all visible GPUs: with one GPU, a world of 1 in this
process with the device pinned, the model on ``cuda:0`` and DDP skipped; with two or more, a real
NCCL world (capture off, so that the plain contender stays plain). In it, each mode (plain fp32,
AMP with ``torch.autocast`` and a GradScaler,
``torch.compile``) trains a model prepared by autoddp and checks that every rank ends with the
same weights, then times it in alternating blocks against a plain copy of the model run as
single-GPU code in the same process (no DDP, no collectives) and prints the ratio: wrapped step
time over plain single-GPU step time, with the same per-GPU batch (so above 1 by what gradient
synchronisation costs). Two more calls check plain single-GPU code under capture (the model found
through its optimizer, the shuffled loader sharded) and ``strategy="fsdp"`` (sharded with two
or more processes, trained, its full state gathered). Without a CUDA device it prints "no CUDA
device, skipped" and exits 0.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoddp
from autoddp.models.ddp import ddp_of

SKIP_MESSAGE = "gpu_check: no CUDA device, skipped"
BLOCKS = 15  # timed block pairs per model and mode
WARMUP_STEPS = 10
# (in features, hidden units, classes, batch, steps per block): a tiny model, where the launch of
# each kernel dominates and wrapper overhead shows most, and an MLP (21M parameters on GPUs,
# smaller for --cpu runs, which only exercise the code).
Shape = tuple[int, int, int, int, int]
GPU_MODELS: dict[str, Shape] = {"tiny": (16, 0, 4, 64, 50), "mlp": (1024, 4096, 10, 512, 20)}
CPU_MODELS: dict[str, Shape] = {"tiny": (16, 0, 4, 64, 50), "mlp": (64, 256, 10, 64, 20)}


def build_model(shape: Shape) -> torch.nn.Module:
    """One Linear (no hidden units) or an MLP with two hidden layers."""
    features, hidden, out, _, _ = shape
    if not hidden:
        return torch.nn.Linear(features, out)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, out),
    )


class Stepper:
    """One model trained in one mode: ``eager`` (fp32), ``amp`` (autocast + GradScaler), ``compile``."""

    def __init__(self, model: torch.nn.Module, mode: str, device: torch.device) -> None:
        self.model, self.mode, self.device = model, mode, device
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        # float16 with a GradScaler on CUDA, the classic AMP recipe; CPU autocast takes bfloat16.
        self.amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode == "amp" and device.type == "cuda")
        self.output_dtype: torch.dtype | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step; returns the loss, detached (reading it would synchronise)."""
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.mode == "amp"):
            output = self.model(x)
            loss = F.cross_entropy(output, y)
        self.output_dtype = output.dtype
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()

    def block(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Seconds for one step per batch, the device synchronised at both ends."""
        self._synchronize()
        start = time.perf_counter()
        for x, y in batches:
            self.step(x, y)
        self._synchronize()
        return time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class CountingBackend:
    """torch.compile's default backend (inductor) that counts the graphs it is given.

    It shows whether a compiled model really runs compiled: one that silently fell back to
    eager mode gives no graph.
    """

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return torch._dynamo.lookup_backend("inductor")(graph, example_inputs)


def _same_on_all_ranks(model: torch.nn.Module) -> bool:
    """Whether every rank holds the same weights (trivially true in a world of 1)."""

    flat = torch.cat([p.detach().float().flatten() for p in autoddp.unwrap(model).parameters()])
    if autoddp.world_size() == 1:
        return True
    copies = [torch.empty_like(flat) for _ in range(autoddp.world_size())]
    dist.all_gather(copies, flat)
    return all(torch.allclose(copies[0], other, rtol=0, atol=1e-6) for other in copies[1:])


def check_mode(name: str, shape: Shape, mode: str, checks: dict[str, bool]) -> dict[str, float]:
    """Train and time one model in one mode on this rank; add pass/fail entries to ``checks``."""

    device = autoddp.device()
    world = autoddp.world_size()
    features, _, classes, batch, steps = shape
    torch.manual_seed(0)
    template = build_model(shape)
    plain = copy.deepcopy(template).to(device)  # plain single-GPU code: no autoddp, no DDP
    wrapped = copy.deepcopy(template)
    backends = {"plain": CountingBackend(), "wrapped": CountingBackend()}
    if mode == "compile":
        plain = torch.compile(plain, backend=backends["plain"])
        wrapped = torch.compile(wrapped, backend=backends["wrapped"])
    wrapped = autoddp.prepare(wrapped)  # what @distributed does to a model argument
    label = f"{name}/{mode}"

    on_device = all(p.device == device for p in autoddp.unwrap(wrapped).parameters())
    checks[f"{label}: model on {device}"] = on_device
    has_ddp = ddp_of(autoddp.unwrap(wrapped)) is not None
    checks[f"{label}: DDP {'used' if world > 1 else 'skipped'}"] = has_ddp == (world > 1)

    generator = torch.Generator(device="cpu").manual_seed(autoddp.rank())
    batches = [
        (
            torch.randn(batch, features, generator=generator).to(device),
            torch.randint(0, classes, (batch,), generator=generator).to(device),
        )
        for _ in range(steps)
    ]
    steppers = {"wrapped": Stepper(wrapped, mode, device), "plain": Stepper(plain, mode, device)}
    losses = [steppers["wrapped"].step(x, y) for x, y in batches[:WARMUP_STEPS]]
    if mode == "compile":
        checks[f"{label}: runs compiled through the wrapper"] = backends["wrapped"].graphs > 0
    checks[f"{label}: loss finite"] = bool(torch.isfinite(torch.stack(losses)).all())
    checks[f"{label}: weights equal on all ranks"] = _same_on_all_ranks(wrapped)
    if mode == "amp":
        checks[f"{label}: autocast output is {steppers['wrapped'].amp_dtype}"] = (
            steppers["wrapped"].output_dtype == steppers["wrapped"].amp_dtype
        )
    for x, y in batches[:WARMUP_STEPS]:
        steppers["plain"].step(x, y)

    ratios, seconds = [], {"wrapped": [], "plain": []}
    for index in range(BLOCKS):
        for kind in ("wrapped", "plain") if index % 2 == 0 else ("plain", "wrapped"):
            if world > 1:
                dist.barrier()
            seconds[kind].append(steppers[kind].block(batches) / steps)
        ratios.append(seconds["wrapped"][-1] / seconds["plain"][-1])
    return {
        "ratio": statistics.median(ratios),
        "wrapped_ms": statistics.median(seconds["wrapped"]) * 1e3,
        "plain_ms": statistics.median(seconds["plain"]) * 1e3,
    }


def run_checks(models: dict[str, Shape], modes: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """The decorated function's body: every check and timing on this rank, gathered on all ranks."""

    device = autoddp.device()
    rank, world = autoddp.rank(), autoddp.world_size()
    checks: dict[str, bool] = {}
    if device.type == "cuda":
        checks[f"device pinned to cuda:{autoddp.local_rank()}"] = (
            device.index == autoddp.local_rank() and torch.cuda.current_device() == autoddp.local_rank()
        )
    if world > 1:
        backend = dist.get_backend_config()  # e.g. "cpu:gloo,cuda:nccl"
        checks[f"process group {backend}"] = device.type != "cuda" or "cuda:nccl" in backend
        total = torch.full((1,), float(rank + 1), device=device)
        dist.all_reduce(total)  # NCCL for a CUDA tensor
        checks[f"all_reduce on {device.type}"] = total.item() == world * (world + 1) / 2
    timings = {f"{name}/{mode}": check_mode(name, models[name], mode, checks) for name, mode in modes}
    report = {"rank": rank, "device": str(device), "checks": checks, "timings": timings}
    if world == 1:
        return {"world_size": 1, "ranks": [report]}
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, report)
    return {"world_size": world, "ranks": reports}


def run_capture(shape: Shape) -> dict[str, Any]:
    """strategy="fsdp" on the same MLP (sharded with two or more processes), and plain code captured."""

    from autoddp.models.ddp import is_wrapped

    device, world = autoddp.device(), autoddp.world_size()
    checks: dict[str, bool] = {}
    torch.manual_seed(0)
    plain = build_model(shape).to("cuda" if device.type == "cuda" else "cpu")  # as single-GPU code says it
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.01)  # capture wraps the model here
    features, _, classes, batch, _ = shape
    data = torch.utils.data.TensorDataset(
        torch.randn(batch * 4, features), torch.randint(0, classes, (batch * 4,))
    )
    seen = 0
    for x, y in torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True):
        loss = F.cross_entropy(plain(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += len(x)
    checks["capture: plain code's model on this process's device"] = next(plain.parameters()).device == device
    checks[f"capture: DDP {'used' if world > 1 else 'skipped'}"] = is_wrapped(plain) == (world > 1)
    checks["capture: the shuffled loader sharded"] = seen == batch * 4 // world
    checks["capture: weights equal on all ranks"] = _same_on_all_ranks(plain)
    return {"checks": checks}


def fsdp_checks(shape: Shape) -> dict[str, Any]:
    """The body of the strategy="fsdp" call: the MLP sharded (two or more processes), trained, gathered."""
    from torch.distributed.tensor import DTensor

    from autoddp import models

    device, world = autoddp.device(), autoddp.world_size()
    torch.manual_seed(0)
    model = autoddp.prepare(build_model(shape))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    features, _, classes, batch, _ = shape
    losses = []
    for _ in range(5):
        x = torch.randn(batch, features, device=device)
        loss = F.cross_entropy(model(x), torch.randint(0, classes, (batch,), device=device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    checks = {
        f"fsdp: parameters {'sharded' if world > 1 else 'whole (one process)'}": sharded == (world > 1),
        f"fsdp: each rank holds 1/{world} of the parameters": abs(local / total - 1 / world) < 0.02,
        "fsdp: loss finite": bool(torch.isfinite(torch.stack(losses)).all()),
    }
    state = models.state_dict(model)  # a collective: every rank takes part
    checks["fsdp: full state dict gathered on rank 0"] = autoddp.rank() != 0 or len(state) == len(
        list(model.parameters())
    )
    return {"checks": checks}


def print_report(result: dict[str, Any], gpu_names: str, elapsed: float) -> bool:
    """Print the checks and the timing table; True if every check passed on every rank."""
    ranks = result["ranks"]
    print(f"gpu_check: world of {result['world_size']} on {gpu_names} ({elapsed:.0f} s)")
    passed = True
    for name in ranks[0]["checks"]:
        ok = all(report["checks"].get(name, False) for report in ranks)
        passed &= ok
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    header = ("model/mode", "wrapped ms", "plain ms", "ratio (rank 0)", "ratio (worst rank)")
    print("  {:16}  {:>10}  {:>9}  {:>14}  {:>18}".format(*header))
    for label, timing in ranks[0]["timings"].items():
        worst = max(report["timings"][label]["ratio"] for report in ranks)
        print(
            f"  {label:16}  {timing['wrapped_ms']:10.3f}  {timing['plain_ms']:9.3f}  "
            f"{timing['ratio']:14.3f}  {worst:18.3f}"
        )
    print("  ratio: step time through autoddp over plain single-GPU code, same per-GPU batch")
    return passed


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; 0 if it passed or there is no CUDA device, 1 if a check failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU processes (gloo) instead")
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: all GPUs; 2 with --cpu)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile mode")
    args = parser.parse_args(argv)

    # Counted through NVML, without initialising CUDA here, so the workers can still be forked.
    gpus = torch.cuda.device_count() if torch.backends.cuda.is_built() else 0
    if not gpus and not args.cpu:
        print(SKIP_MESSAGE)
        return 0
    modes = [("tiny", "eager"), ("mlp", "eager"), ("mlp", "amp")]
    if not args.no_compile:
        modes.append(("mlp", "compile"))
    started = time.monotonic()
    if args.cpu:
        options: dict[str, Any] = {"nproc": args.nproc or 2, "backend": "gloo"}
    else:
        options = {"nproc": min(args.nproc or gpus, gpus)}
    # A collective may wait for another rank's first compilation: allow it minutes, not torch's 30.
    models = CPU_MODELS if args.cpu else GPU_MODELS
    # capture off: the plain contender of each timing must stay plain single-GPU code
    result = autoddp.distributed(timeout=240, capture=False, **options)(run_checks)(models, modes)
    captured = autoddp.distributed(timeout=240, **options)(run_capture)(models["mlp"])
    fsdp = autoddp.distributed(timeout=240, strategy="fsdp", **options)(fsdp_checks)(models["mlp"])
    for extra in (captured, fsdp):
        for name, ok in extra["checks"].items():  # rank 0's, after every rank took part
            for report in result["ranks"]:
                report["checks"][name] = ok
    names = "CPU" if args.cpu else ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(gpus)}))
    return 0 if print_report(result, f"{options['nproc']} x {names}", time.monotonic() - started) else 1


if __name__ == "__main__":
    sys.exit(main())
