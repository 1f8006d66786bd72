"""The same training as ``train_torchrun.py``, written for autoddp: plain code plus one decorator.

    python benchmarks/train_autoddp.py STAMP_FILE [NPROC]

Each rank appends a ``first_step`` line to STAMP_FILE right after its first optimizer step and a
``done`` line with its memory use at the end (see ``common.record``).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import autoddp

from common import (
    BATCH_SIZE,
    FIRST_STEP_MODEL,
    FIRST_STEP_STEPS,
    make_dataset,
    make_model,
    memory_kb,
    record,
    use_cuda,
)

NPROC = int(sys.argv[2]) if len(sys.argv) > 2 else 2


# One GPU per process on NCCL where there are enough GPUs, else CPU processes on gloo.
@autoddp.distributed(nproc=NPROC, backend=None if use_cuda(NPROC) else "gloo")
def train(model: torch.nn.Module, loader: DataLoader, stamp_file: str) -> float:
    """Plain single-device training; autoddp hands it a DDP model and a sharded loader."""
    device = autoddp.device()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0:
            record(stamp_file, "first_step", autoddp.rank())
        if step + 1 == FIRST_STEP_STEPS:
            break
    record(stamp_file, "done", autoddp.rank(), **memory_kb())
    return loss.item()


if __name__ == "__main__":
    torch.manual_seed(0)
    model = make_model(FIRST_STEP_MODEL)
    loader = DataLoader(make_dataset(FIRST_STEP_MODEL), batch_size=BATCH_SIZE, shuffle=True)
    train(model, loader, sys.argv[1])  # runs on NPROC processes; returns rank 0's last loss
