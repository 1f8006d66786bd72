"""The memory estimate (``autoddp.core.memory``) against the measured peak of a training step.

    python benchmarks/memory_estimate.py [--only NAME,...] [--scale F] [--steps N]

For each model of ``CASES`` (MLPs, convnets with BatchNorm, transformers, an embedding-heavy
model, tied weights, an LSTM; SGD with and without momentum, Adam, AdamW, Adagrad, RMSprop), a
fresh Python process joins a gloo group of one and reads its resident set; then resets the peak
resident set (``/proc/self/clear_refs``, "5", as ``benchmarks/memory.py``), builds the model and
its batch (the batch's bytes, the data's, are taken off what is measured), sets glibc's
allocator as an autoddp CPU worker does when it wraps a model
(``core.environment.hardware.keep_freed_memory``: freed blocks under 32 MiB kept for the next
step), wraps it in ``DistributedDataParallel(gradient_as_bucket_view=True)`` (autoddp's DDP) and
trains ``--steps`` steps of the loop a script writes (``output = model(x)``, cross-entropy over
the output's last dimension against random classes made at the first step, ``backward``,
``optimizer.step()``, ``zero_grad``; ``output`` and ``loss`` live until the next forward returns)
on CPU. Measured: the peak resident set (``VmHWM``) less the resident set before the model; and
again in another fresh process with glibc returning every freed block over 64 KiB
(``MALLOC_MMAP_THRESHOLD_=65536``), where the resident set is the bytes in use: what the estimate
tracks, without the blocks the allocator keeps; and in a third with torch's profiler recording
every allocation of torch's CPU allocator (``profile_memory=True``): the most bytes its tensors
held at once (the ``[memory]`` events' ``Total Allocated``), what ``torch.cuda.max_memory_allocated``
counts on a GPU, without the runtime's own memory (threads' buffers, libraries).
Estimated: ``estimate(..., plan="ddp")`` for the same model, batch and optimizer (its loss rule is
this cross-entropy: ``core.memory.tracker.surrogate_loss``). Prints a markdown table (model,
optimizer, the estimate's parts, measured, ratio), the estimate's notes, and, last, one JSON
object. ``--scale`` multiplies the widths (a quick check: 0.25).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

MiB = 2**20


@dataclass(frozen=True)
class Case:
    """One model, its batch and its optimizer: ``build(scale)`` returns (model, inputs)."""

    name: str
    build: Callable[[float], tuple[nn.Module, tuple]]
    optimizer: type
    options: dict


def _w(width: int, scale: float) -> int:
    return max(8, int(width * scale))


def mlp(width: int, depth: int, batch: int) -> Callable[[float], tuple[nn.Module, tuple]]:
    def build(scale: float) -> tuple[nn.Module, tuple]:
        w = _w(width, scale)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(w, w), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(w, 10)), (torch.randn(batch, w),)

    return build


def convnet(channels: int, batch: int, side: int) -> Callable[[float], tuple[nn.Module, tuple]]:
    def build(scale: float) -> tuple[nn.Module, tuple]:
        c = _w(channels, scale)
        layers: list[nn.Module] = [nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()]
        for i in range(3):
            layers += [nn.Conv2d(c << i, c << (i + 1), 3, padding=1, stride=2), nn.BatchNorm2d(c << (i + 1))]
            layers += [nn.ReLU()]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c << 3, 100)]
        return nn.Sequential(*layers), (torch.randn(batch, 3, side, side),)

    return build


def transformer(
    width: int, layers: int, batch: int, length: int
) -> Callable[[float], tuple[nn.Module, tuple]]:
    def build(scale: float) -> tuple[nn.Module, tuple]:
        w = _w(width, scale) // 8 * 8
        layer = nn.TransformerEncoderLayer(w, 8, 4 * w, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), (
            torch.randn(batch, length, w),
        )

    return build


class Bag(nn.Module):
    """An embedding-heavy model: a large table, the mean of the looked-up rows, a small head."""

    def __init__(self, rows: int, width: int) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, width)
        self.head = nn.Linear(width, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).mean(dim=1))


class TiedLM(nn.Module):
    """A small language model whose output layer is its embedding (tied weights: one parameter)."""

    def __init__(self, vocabulary: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(width, vocabulary, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.embed(ids)))


class Recurrent(nn.Module):
    """An LSTM over a sequence, and a head on its last step."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def _bag(scale: float) -> tuple[nn.Module, tuple]:
    rows = _w(100_000, scale)
    return Bag(rows, 256), (torch.randint(0, rows, (256, 32)),)


def _tied(scale: float) -> tuple[nn.Module, tuple]:
    vocabulary = _w(32_000, scale)
    return TiedLM(vocabulary, 256, 2), (torch.randint(0, vocabulary, (8, 128)),)


def _lstm(scale: float) -> tuple[nn.Module, tuple]:
    return Recurrent(_w(512, scale), _w(1024, scale)), (torch.randn(32, 64, _w(512, scale)),)


SGD, ADAM, ADAMW = torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW
CASES = [
    Case("mlp 8x2048", mlp(2048, 8, 64), SGD, {"lr": 0.01}),
    Case("mlp 8x2048", mlp(2048, 8, 64), SGD, {"lr": 0.01, "momentum": 0.9}),
    Case("mlp 8x2048", mlp(2048, 8, 64), ADAM, {"lr": 1e-3}),
    Case("mlp 3x4096", mlp(4096, 3, 64), ADAMW, {"lr": 1e-3, "weight_decay": 0.01}),
    Case("mlp 8x2048", mlp(2048, 8, 64), torch.optim.Adagrad, {"lr": 0.01}),
    Case(
        "mlp 8x2048", mlp(2048, 8, 64), torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}
    ),
    Case("mlp 8x1024, batch 4096", mlp(1024, 8, 4096), SGD, {"lr": 0.01}),
    Case("convnet+BatchNorm", convnet(64, 32, 64), SGD, {"lr": 0.01, "momentum": 0.9}),
    Case("convnet+BatchNorm", convnet(128, 16, 64), ADAM, {"lr": 1e-3}),
    Case("transformer 6x512", transformer(512, 6, 16, 128), ADAM, {"lr": 1e-3}),
    Case("transformer 4x768", transformer(768, 4, 8, 256), ADAMW, {"lr": 1e-3, "weight_decay": 0.01}),
    Case("embedding 100k x 256", _bag, ADAM, {"lr": 1e-3}),
    Case("tied LM, 32k vocabulary", _tied, ADAMW, {"lr": 1e-3}),
    Case("LSTM 2x1024", _lstm, torch.optim.RMSprop, {"lr": 0.01}),
    Case("LSTM 2x1024", _lstm, torch.optim.Adagrad, {"lr": 0.01}),
]


def _label(case: Case) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in case.options.items() if k != "lr")
    return f"{case.optimizer.__name__}({settings})" if settings else case.optimizer.__name__


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status: this benchmark needs Linux")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # Linux: the peak resident set starts again from now


def _train(case: Case, scale: float, steps: int) -> tuple:
    """Build the model, set the allocator as an autoddp CPU worker does, wrap it, train ``steps``;
    the batch."""
    from autoddp.core.environment import hardware

    model, inputs = case.build(scale)
    hardware.keep_freed_memory()  # as in_rank.models.ddp.wrap on CPU
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = case.optimizer(ddp.parameters(), **case.options)
    targets = None
    for _ in range(steps):
        output = ddp(*inputs)
        if targets is None:  # (a few KiB: the data's, made once)
            targets = torch.randint(0, output.shape[-1], output.shape[:-1])
        loss = nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return inputs


def _allocator_peak(trace: str) -> int:
    """The most bytes torch's CPU allocator held at once while the profiler recorded, from its
    ``[memory]`` events (``Total Allocated``: allocated less freed since the profiler started)."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0)


def measure_case(index: int, scale: float, steps: int, allocator: bool = False) -> dict:
    """In this (fresh) process: the measured peak of ``steps`` steps of case ``index``, and the
    estimate; ``allocator``: torch's allocator's peak (the profiler's memory events), not the
    resident set's."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from autoddp.core.memory.estimate import estimate

    case = CASES[index]
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
        torch.manual_seed(0)
        _reset_peak()
        before_kb = _status_kb("VmRSS")
        if allocator:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
                inputs = _train(case, scale, steps)
            recorded.export_chrome_trace(f"{folder}/trace.json")
        else:
            inputs = _train(case, scale, steps)
        batch = sum(t.numel() * t.element_size() for t in inputs)  # the data's
        measured = (_status_kb("VmHWM") - before_kb) * 1024 - batch
        if allocator:
            measured = _allocator_peak(f"{folder}/trace.json") - batch
        dist.destroy_process_group()
    fresh, _ = case.build(scale)  # the estimate sees the model before any step, as autoddp does
    found = estimate(fresh, inputs, optimizer=case.optimizer, optimizer_kwargs=case.options, plan="ddp")
    parts = ("params", "grads", "activations")
    return {
        "model": case.name,
        "optimizer": _label(case),
        "parameters": sum(p.numel() for p in fresh.parameters()),
        **{part: getattr(found, part) for part in parts},
        "state": found.optimizer,
        "estimate": found.total,
        "measured": measured,
        "ratio": round(found.total / measured, 3),
        "notes": list(found.notes),
    }


#: glibc returning every block over 64 KiB to the kernel when freed: the resident set is then the
#: bytes in use (the live bytes the estimate tracks), with no freed block kept.
RETURNED = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def run_case(
    index: int,
    scale: float,
    steps: int,
    *,
    returned: bool = False,
    allocator: bool = False,
    timeout: float = 600,
) -> dict:
    """Case ``index`` in a fresh interpreter (nothing of another case's memory in its figures);
    ``returned``: with glibc returning freed blocks (``RETURNED``; autoddp's setting then stands
    down); ``allocator``: torch's allocator's peak instead of the resident set's."""
    arguments = ["--case", str(index), "--scale", str(scale), "--steps", str(steps)]
    arguments += ["--allocator"] if allocator else []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, **RETURNED} if returned else env,
    )
    if result.returncode != 0:
        raise RuntimeError(f"case {CASES[index].name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> list[str]:
    """The markdown table: model, optimizer, the estimate's parts (MiB), its peak, measured as an
    autoddp worker runs, with freed blocks returned, and by torch's allocator, and the ratios."""
    lines = [
        "| model | optimizer | params | grads | optimizer state | activations | estimate (peak) "
        "| measured (worker) | ratio | measured (blocks returned) | ratio "
        "| measured (torch's allocator) | ratio |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        figures = [row[k] / MiB for k in ("params", "grads", "state", "activations", "estimate", "measured")]
        cells = " | ".join(f"{value:.1f}" for value in figures)
        returned = f"{row['measured_returned'] / MiB:.1f} | {row['ratio_returned']:.2f}"
        allocated = f"{row['measured_allocator'] / MiB:.1f} | {row['ratio_allocator']:.2f}"
        first = f"| {row['model']} | {row['optimizer']} | {cells} | {row['ratio']:.2f}"
        lines.append(f"{first} | {returned} | {allocated} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated case numbers (0-based)")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--allocator", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case is not None:
        print(json.dumps(measure_case(args.case, args.scale, args.steps, args.allocator)))
        return 0
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(CASES))
    rows = []
    for i in chosen:
        row, returned = (run_case(i, args.scale, args.steps, returned=r) for r in (False, True))
        allocated = run_case(i, args.scale, args.steps, allocator=True)
        for name, other in (("returned", returned), ("allocator", allocated)):
            row[f"measured_{name}"] = other["measured"]
            row[f"ratio_{name}"] = round(row["estimate"] / other["measured"], 3)
        rows.append(row)
    print("\n".join(table(rows)))
    for note in sorted({note for row in rows for note in row["notes"]}):
        print(f"\nnote: {note}")
    ratios = [row["ratio"] for row in rows]
    within = sum(0.85 <= r <= 1.15 for r in ratios)
    returned = sum(0.85 <= row["ratio_returned"] <= 1.15 for row in rows)
    allocator = sum(0.85 <= row["ratio_allocator"] <= 1.15 for row in rows)
    print(
        f"\n{within} of {len(rows)} within ±15% of the worker's peak, {returned} of the peak with freed "
        f"blocks returned, {allocator} of torch's allocator's peak (ratio = estimate / measured)"
    )
    figures = {
        "within_15_percent": within,
        "within_15_percent_returned": returned,
        "within_15_percent_allocator": allocator,
    }
    print(json.dumps({"cases": rows, **figures, "ratio_min": min(ratios), "ratio_max": max(ratios)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
