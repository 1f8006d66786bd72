"""Hand-written DDP, as a torchrun user writes it: the baseline of the launch benchmarks.

    torchrun --standalone --nproc-per-node=2 benchmarks/train_torchrun.py STAMP_FILE
    autoddp -n 2 benchmarks/train_torchrun.py STAMP_FILE     (the autoddp command, same script)

Each rank appends a ``first_step`` line to STAMP_FILE right after its first optimizer step and a
``done`` line with its memory use at the end (see ``common.record``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

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


def main(stamp_file: str) -> None:
    """One rank of the job: join the group, train FIRST_STEP_STEPS steps, record, leave."""
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = use_cuda(int(os.environ["LOCAL_WORLD_SIZE"]))  # one GPU per process, else CPU on gloo
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")

    torch.manual_seed(0)
    model = DistributedDataParallel(
        make_model(FIRST_STEP_MODEL).to(device), device_ids=[local_rank] if cuda else None
    )
    dataset = make_dataset(FIRST_STEP_MODEL)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    sampler.set_epoch(0)
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0:
            record(stamp_file, "first_step", rank)
        if step + 1 == FIRST_STEP_STEPS:
            break

    record(stamp_file, "done", rank, **memory_kb())
    del model  # free DDP before its process group: the other order can deadlock gloo at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
