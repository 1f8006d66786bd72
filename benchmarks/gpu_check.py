"""What one GPU can prove about autoddp's CUDA path, in one command that prints one JSON document.

    python benchmarks/gpu_check.py           # on a machine with a GPU: under 5 minutes
    python benchmarks/gpu_check.py --cpu     # the same checks on 2 CPU processes (gloo), to develop it

With one GPU every ``@distributed`` call would run in the calling process, so NCCL, DDP and FSDP
would pass trivially. Instead this process joins a real NCCL group of ONE rank on ``cuda:0``
(``init_process_group("nccl", world_size=1, device_id=cuda:0)``) and enters autoddp's world with a
``World`` that says two processes (``FORCED``), so that ``autoddp.prepare`` wraps as it does on
several GPUs: a real DDP (``device_ids=[0]``) and a real FSDP2 over that group, every collective
an NCCL kernel on a CUDA stream. Checks:

- ``nccl``: the group is NCCL and an all_reduce of a CUDA tensor runs;
- ``ddp``, ``ddp amp``, ``ddp compile``: the wrapped model trains like hand-written DDP on the
  same GPU (same weights), with autocast + GradScaler, and compiled; ``ddp rebuilt``: ``.double()``
  after wrapping gives a new DDP; ``step time``: autoddp's step against hand-written DDP's;
- ``fsdp``: parameters sharded (DTensor), trained, the full state dict gathered;
- ``spawn, CUDA touched here``: the workers start as fresh interpreters and use CUDA, nothing on
  another device; ``fork refused, CUDA touched here``: ``start_method="fork"`` is a clear error;
  ``fork, CUDA untouched``: from a fresh caller, forked workers use CUDA;
- ``captured script``: an unchanged script that says ``cuda:0``, run with ``autoddp -n 1``;
- ``hang marks on a CUDA stream``: "not available" until the hang report marks completion.

With two or more GPUs, ``nccl world`` adds the ``ddp`` checks in a real NCCL world of all of them.
Each check: name, ok (true, false, or null when not available), details, seconds; exit status 1
if any failed. Without a CUDA device it prints ``{"skipped": "no CUDA device, skipped"}``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import autoddp
from autoddp import ConfigurationError
from autoddp.core.state import CURRENT, RunOptions, World
from autoddp.in_rank import models
from autoddp.in_rank.models.ddp import ddp_of
from gpu_processes import Check, captured_script, check, start_probe, touched_checks, untouched_check
from gpu_processes import started as _started

SKIP = {"skipped": "no CUDA device, skipped"}
SKIP_MESSAGE = SKIP["skipped"]
FEATURES, HIDDEN, CLASSES, BATCH = 64, 256, 10, 64
STEPS, BLOCKS = 5, 10  # training steps compared; timed block pairs (of STEPS steps each)
#: autoddp's step over hand-written DDP's on one GPU: its few microseconds a step, and some noise.
RATIO_LIMIT = 1.10


def forced(device: str) -> World:
    """autoddp's world while this process holds a real group of one rank: it wraps as with two."""
    return World(rank=0, local_rank=0, world_size=2, local_world_size=2, device=device)


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def batches(device: torch.device, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(dist.get_rank())
    return [
        (
            torch.randn(BATCH, FEATURES, generator=generator).to(device),
            torch.randint(0, CLASSES, (BATCH,), generator=generator).to(device),
        )
        for _ in range(count)
    ]


def train(model: torch.nn.Module, data: list, amp: bool = False) -> list[float]:
    """SGD steps over ``data``; AMP: autocast (float16 and a GradScaler on CUDA, bfloat16 on CPU)."""
    device = data[0][0].device
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device.type, enabled=amp and device.type == "cuda")
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    losses = []
    for x, y in data:
        with torch.autocast(device.type, dtype=dtype, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.detach())
    return [float(v) for v in torch.stack(losses).cpu()]


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in autoddp.unwrap(model).parameters()])


def _same_everywhere(flat: torch.Tensor) -> bool:
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    return all(torch.equal(copies[0], other) for other in copies[1:])


def ddp_checks(device: torch.device, compile_too: bool) -> list[Check]:
    """autoddp's DDP against hand-written DDP on this rank's device (one GPU or a real world)."""
    results = []

    def against_ddp(amp: bool = False, compiled: bool = False) -> tuple[bool, Any]:
        torch.manual_seed(0)
        template = build_model().to(device)
        ours_module = torch.compile(copy.deepcopy(template)) if compiled else copy.deepcopy(template)
        ours = autoddp.prepare(ours_module)
        ids = [device.index] if device.type == "cuda" else None
        theirs = DistributedDataParallel(
            copy.deepcopy(template), device_ids=ids, gradient_as_bucket_view=True
        )
        data = batches(device, STEPS)
        losses = train(ours, data, amp)
        train(theirs, data, amp)
        ddp = ddp_of(autoddp.unwrap(ours))
        tolerance = 1e-4 if compiled else 1e-5  # (inductor's fused kernels round a little differently)
        close = torch.allclose(_weights(ours), _weights(theirs.module), rtol=0, atol=tolerance)
        ok = ddp is not None and ddp.device_ids == ids and close and _same_everywhere(_weights(ours))
        return ok, {
            "backend": dist.get_backend_config(),
            "device_ids": None if ddp is None else ddp.device_ids,
            "weights equal to hand-written DDP's": close,
            "losses": [round(v, 4) for v in losses],
        }

    results.append(check("ddp", against_ddp))
    results.append(check("ddp amp", lambda: against_ddp(amp=True)))
    if compile_too:
        results.append(check("ddp compile", lambda: against_ddp(compiled=True)))

    def rebuilt() -> tuple[bool, Any]:
        model = autoddp.prepare(build_model().to(device))
        data = batches(device, 2)
        train(model, data[:1])
        before = ddp_of(autoddp.unwrap(model))
        model.double()
        loss = train(model, [(x.double(), y) for x, y in data[1:]])
        after = ddp_of(autoddp.unwrap(model))
        grads = _same_everywhere(torch.cat([p.grad.flatten() for p in autoddp.unwrap(model).parameters()]))
        ok = after is not None and after is not before and grads and loss[0] == loss[0]
        return ok, {"new DDP": after is not before, "gradients equal on every rank": grads}

    results.append(check("ddp rebuilt after model.double()", rebuilt))
    results.append(check("step time", lambda: step_time(device)))
    return results


def step_time(device: torch.device) -> tuple[bool, Any]:
    """Alternating blocks of autoddp's steps and hand-written DDP's, on the same device and data."""
    torch.manual_seed(0)
    template = build_model().to(device)
    ours = autoddp.prepare(copy.deepcopy(template))
    ids = [device.index] if device.type == "cuda" else None
    theirs = DistributedDataParallel(copy.deepcopy(template), device_ids=ids, gradient_as_bucket_view=True)
    data = batches(device, STEPS)
    train(ours, data), train(theirs, data)  # warm-up

    def block(model: torch.nn.Module) -> float:
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        train(model, data)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - started) / STEPS * 1e3

    ratios, ms = [], {"autoddp": [], "ddp": []}
    for index in range(BLOCKS):
        order = [("autoddp", ours), ("ddp", theirs)]
        for name, model in order if index % 2 == 0 else order[::-1]:
            ms[name].append(block(model))
        ratios.append(ms["autoddp"][-1] / ms["ddp"][-1])
    ratio = statistics.median(ratios)
    figures = {name: round(statistics.median(values), 3) for name, values in ms.items()}
    details = {"ms per step": figures, "ratio": round(ratio, 3)}
    if device.type != "cuda":  # a shared CPU's noise (0.8-4x here): a figure, not a verdict
        return ratio == ratio, details
    return ratio < RATIO_LIMIT, {**details, "limit": RATIO_LIMIT}


def fsdp_missing(device: torch.device) -> str | None:
    """Why strategy="fsdp" cannot run on ``device`` with this torch (autoddp's error), or None."""
    try:
        models.fsdp.fsdp_api(device.type)
    except ConfigurationError as error:
        return str(error)
    return None


def fsdp_checks(device: torch.device) -> list[Check]:
    missing = fsdp_missing(device)
    if missing is not None:
        return [check("fsdp", lambda: (None, f"not available: {missing}"))]

    def sharded() -> tuple[bool, Any]:
        from torch.distributed.tensor import DTensor

        torch.manual_seed(0)
        model = autoddp.prepare(build_model())
        losses = train(model, batches(device, 3))
        params = list(model.parameters())
        state = models.state_dict(model)  # a collective: every rank takes part
        ok = all(isinstance(p, DTensor) for p in params) and all(v == v for v in losses)
        ok = ok and (dist.get_rank() != 0 or len(state) == len(params))
        return ok, {"DTensor parameters": sum(isinstance(p, DTensor) for p in params), "losses": losses}

    return [check("fsdp", sharded)]


def auto_check(device: torch.device) -> tuple[bool | None, Any]:
    """strategy="auto" on this device: a budget between the model's sharded and replicated state
    takes FSDP2 (the default budget, read from the GPU, took DDP in the ``ddp`` checks)."""
    missing = fsdp_missing(device)
    if missing is not None:
        return None, f"not available: {missing}"
    from torch.distributed.tensor import DTensor

    from autoddp.core.memory import estimate

    wide = 2048 if device.type == "cuda" else HIDDEN  # (on a GPU: state well above cuBLAS's workspace)
    layers = [torch.nn.Linear(wide, wide) for _ in range(8)]  # (blocks: sharding pays off)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, wide), *layers, torch.nn.Linear(wide, CLASSES))
    units = models.fsdp.units(model)
    ddp_need = estimate.state_only(model, plan="ddp").total
    fsdp_need = estimate.state_only(model, plan="fsdp", processes=2, units=units).total
    if fsdp_need >= ddp_need:
        return (
            None,
            f"not available: the sharded state ({fsdp_need} B) is not below the replicated ({ddp_need} B)",
        )
    budget = ddp_need - 1  # DDP does not fit by a byte; FSDP does, with room for a step
    with forced_world(device, RunOptions(capture=False, device_memory=budget)):
        prepared = autoddp.prepare(model)
        sharded = all(isinstance(p, DTensor) for p in prepared.parameters())
        losses = train(prepared, batches(device, 2))
        note = models.plan_note(prepared)
    details = {"sharded": sharded, "note": note, "losses": losses}
    if device.type == "cuda":  # the first step's peak, activations included, weighed against the budget
        with forced_world(device, RunOptions(capture=False, device_memory=ddp_need + 2**20)):
            replicated = autoddp.prepare(build_model().to(device))
            try:
                x = torch.randn(2**14, FEATURES, device=device)  # activations far over 1 MiB
                opt = torch.optim.SGD(replicated.parameters(), lr=0.1)
                replicated(x).sum().backward()
                opt.step()
                details["first step over the budget"] = "not raised"
            except autoddp.MemoryPlanError as error:
                details["first step over the budget"] = str(error)[:300]
        sharded = sharded and details["first step over the budget"] != "not raised"
    return sharded and all(v == v for v in losses), details


@contextlib.contextmanager
def group_of_one(device: torch.device) -> Iterator[None]:
    """A real process group of one rank in this process for the block: NCCL on cuda:0, else gloo."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # NCCL's communicator made now, not at the first collective
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **kwargs)
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def forced_world(device: torch.device, options: RunOptions) -> Iterator[None]:
    """autoddp's world says two processes (it wraps), its collectives run on the real group of one."""
    with CURRENT.entered(forced(str(device)), options):
        try:
            yield
        finally:
            CURRENT.release_wrapped()
            gc.collect()


def one_gpu_checks(device: torch.device, compile_too: bool) -> list[Check]:
    """The group of one (NCCL on cuda:0; gloo with ``--cpu --one``) and autoddp wrapping over it."""
    results = []
    with group_of_one(device):

        def group() -> tuple[bool, Any]:
            total = torch.ones(1, device=device)
            dist.all_reduce(total)
            expected = "cuda:nccl" if device.type == "cuda" else "cpu:gloo"
            return expected in dist.get_backend_config() and total.item() == 1, dist.get_backend_config()

        results.append(check("nccl" if device.type == "cuda" else "gloo group of one", group))
        with forced_world(device, RunOptions(capture=False)):
            results += ddp_checks(device, compile_too)
        with forced_world(device, RunOptions(strategy="fsdp", capture=False)):
            results += fsdp_checks(device)
        results.append(check("auto: fsdp where ddp does not fit", lambda: auto_check(device)))
        results.append(check("hang marks on a CUDA stream", hang_marks))
    return results


def hang_marks() -> tuple[bool | None, Any]:
    """The hang report's completion marks on NCCL's queued collectives, once autoddp has them."""
    from autoddp.in_rank.hang import marks, record

    found = [f"{m.__name__}.{n}" for m in (marks, record) for n in dir(m) if "complet" in n.lower()]
    if not found:
        return None, "not available: autoddp.in_rank.hang has no completion marks yet (issue 20, item 3)"
    return None, f"present ({', '.join(found)}), not yet exercised by this check"


def world_checks(compile_too: bool) -> list[Check]:
    """A decorated function's body in a real world (gloo CPU processes, or NCCL on several GPUs)."""
    device = autoddp.device()
    results = ddp_checks(device, compile_too)
    return _everywhere(results)


def fsdp_world_checks() -> list[Check]:
    return _everywhere(fsdp_checks(autoddp.device()))


def _everywhere(results: list[Check]) -> list[Check]:
    """Rank 0's checks, each ok only if it passed on every rank."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, [r["ok"] for r in results])
    for index, result in enumerate(results):
        result["ok"] = all(oks[index] for oks in every) if result["ok"] is not None else None
    return results


def guarded(name: str, body: Callable[[], list[Check]]) -> list[Check]:
    """``body``'s checks, or one failed check named ``name`` if it raised before giving them."""
    failed: list[Check] = []

    def run() -> tuple[bool, Any]:
        failed.extend(body())
        return True, None

    entry = check(name, run)
    return failed if entry["ok"] else [entry]


def main(argv: list[str] | None = None) -> int:
    """Run the checks, print one JSON document; 0 if every check passed (or no CUDA), else 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on 2 CPU processes (gloo) instead")
    parser.add_argument("--one", action="store_true", help="with --cpu: the one-GPU path, on gloo")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile check")
    parser.add_argument("--fork-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fork_probe:  # (a fresh caller, CUDA untouched: the workers are forked)
        run = autoddp.distributed(nproc=2, backend="gloo", capture=False, start_method="fork")(start_probe)
        print(json.dumps(run()))
        return 0
    # Counted through NVML, without initialising CUDA here.
    gpus = torch.cuda.device_count() if torch.backends.cuda.is_built() else 0
    if not gpus and not args.cpu:
        print(json.dumps(SKIP))
        return 0
    started = time.monotonic()
    compile_too = not args.no_compile
    if args.cpu and args.one:
        checks = guarded("gloo group of one", lambda: one_gpu_checks(torch.device("cpu"), compile_too))
        where = "1 CPU process (gloo), the one-GPU path"
    elif args.cpu:
        options: dict[str, Any] = {"nproc": 2, "backend": "gloo", "capture": False, "timeout": 240}
        checks = guarded("ddp world", lambda: autoddp.distributed(**options)(world_checks)(compile_too))
        if fsdp_missing(torch.device("cpu")) is None:
            fsdp = autoddp.distributed(strategy="fsdp", **options)(fsdp_world_checks)
            checks += guarded("fsdp world", fsdp)
        else:
            checks += fsdp_checks(torch.device("cpu"))
        checks += [check(method, lambda m=method: _started(m, cuda=False)) for method in ("fork", "spawn")]
        checks.append(check("captured script", lambda: captured_script(cuda=False)))
        where = "2 CPU processes (gloo)"
    else:
        checks = [untouched_check()]  # first, while CUDA is untouched here (NVML counted the GPUs)
        checks.append(check("captured script", lambda: captured_script(cuda=True)))
        checks += guarded("nccl group of one", lambda: one_gpu_checks(torch.device("cuda:0"), compile_too))
        checks += guarded("CUDA touched here", touched_checks)
        if gpus > 1:
            world = {"nproc": gpus, "backend": "nccl", "capture": False, "timeout": 240}
            label = f"nccl world of {gpus}"
            for entry in guarded(label, lambda: autoddp.distributed(**world)(world_checks)(False)):
                checks.append({**entry, "name": f"{label}: {entry['name']}"})
        where = f"{gpus} x {torch.cuda.get_device_name(0)}"
    failed = [c["name"] for c in checks if c["ok"] is False]
    document = {
        "on": where,
        "torch": torch.__version__,
        "seconds": round(time.monotonic() - started, 1),
        "ok": not failed,
        "failed": failed,
        "checks": checks,
    }
    print(json.dumps(document, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
