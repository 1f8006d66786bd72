"""What every benchmark contender shares: the models, the data, the batch, and the measurements.

Imported by the per-contender training scripts (``train_autoddp.py``, ``train_torchrun.py``) and by
``steady_state.py``, so that the contenders differ only in how they launch and distribute.
"""

from __future__ import annotations

import json
import os
import resource
import time

import torch
from torch.utils.data import TensorDataset

BATCH_SIZE = 64  # per process
SAMPLES = 4096  # in the whole data set; each of 2 processes gets 2048 (32 batches) per epoch
FIRST_STEP_MODEL = "medium"
FIRST_STEP_STEPS = 20  # steps the launch benchmarks train for before they exit
FEATURES = {"small": 16, "medium": 256, "deep": 16}
CLASSES = {"small": 4, "medium": 10, "deep": 4}
DEEP_LAYERS = 24


def make_model(size: str) -> torch.nn.Module:
    """``small``: one Linear 16->4, where wrapper overhead shows most; ``medium``: an MLP (~400k params);
    ``deep``: 24 small Linear layers (16 wide), where a cost per submodule shows."""
    if size == "small":
        return torch.nn.Linear(FEATURES["small"], CLASSES["small"])
    if size == "medium":
        return torch.nn.Sequential(
            torch.nn.Linear(FEATURES["medium"], 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, CLASSES["medium"]),
        )
    if size == "deep":
        layers: list[torch.nn.Module] = []
        for _ in range(DEEP_LAYERS - 1):
            layers += [torch.nn.Linear(FEATURES["deep"], FEATURES["deep"]), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(FEATURES["deep"], CLASSES["deep"]))
    raise ValueError(f"unknown model size {size!r}: use 'small', 'medium' or 'deep'")


def make_dataset(size: str, seed: int = 0) -> TensorDataset:
    """Random features and labels, the same on every process (drawn from their own generator)."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(SAMPLES, FEATURES[size], generator=generator)
    labels = torch.randint(0, CLASSES[size], (SAMPLES,), generator=generator)
    return TensorDataset(features, labels)


def use_cuda(nproc: int) -> bool:
    """Whether a run of ``nproc`` processes gets one GPU each (counted without initialising CUDA)."""
    return torch.backends.cuda.is_built() and torch.cuda.device_count() >= nproc


def memory_kb() -> dict[str, int]:
    """This process's memory, in KiB.

    ``hwm_kb``: the peak resident set of this process's own address space (``VmHWM``). It is the
    comparable figure: ``ru_maxrss`` (also reported, as ``maxrss_kb``) of a process started by
    fork+exec also counts the peak of the process that started it (Linux keeps the larger of
    the two across exec), so under torchrun it can report the agent's memory. ``pss_kb`` is the
    proportional share now, where pages shared with other processes (after a fork) count in part.
    """
    result = {"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "hwm_kb": 0, "pss_kb": 0}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    result["hwm_kb"] = int(line.split()[1])
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    result["pss_kb"] = int(line.split()[1])
    except OSError:  # not Linux: only ru_maxrss (bytes on macOS, but the ratio still holds)
        result["hwm_kb"] = result["maxrss_kb"]
    return result


def record(path: str, event: str, rank: int, **extra: object) -> None:
    """Append one JSON line (event, rank, wall-clock time, extras) to ``path`` in a single write."""
    line = json.dumps({"event": event, "rank": rank, "time": time.time(), **extra}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
