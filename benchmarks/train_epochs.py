"""A plain single-GPU-style training script, CPU-bound: a small conv net, timed epoch by epoch.

    python benchmarks/train_epochs.py [--epochs N] [--samples N]          # one process
    autoddp -n 2 benchmarks/train_epochs.py                               # unchanged, captured
    torchrun --standalone --nproc-per-node 2 benchmarks/train_epochs.py --hand-written-ddp

Without ``--hand-written-ddp`` nothing in it is distributed: under ``autoddp -n 2`` capture wraps
the model (found through the optimizer) and shards the shuffled loader. With the flag, the few
lines a torchrun user adds run as well (``init_process_group``, ``DistributedDataParallel``, a
``DistributedSampler`` with ``set_epoch``); the model, data, batch per process and steps per
epoch are the same either way. Rank 0 prints one line per epoch, timed inside the script:
``epoch 1 1.234s loss 2.3026 threads 1 cpu 1.201s faults 12345``: wall time, mean loss, the threads
torch computes with in this process, the CPU time of all its threads in the epoch, and its minor
page faults in the epoch (glibc returning the freed activations' pages to the system and taking
them back: kernel time that varies from run to run, whichever launcher runs the script).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

BATCH_SIZE = 32  # per process
CLASSES = 10


def make_model() -> torch.nn.Module:
    """Two conv layers and a linear head for 3x32x32 images (~26k parameters): convolutions are
    where the threads torch computes with show most."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, CLASSES),
    )


def make_dataset(samples: int) -> TensorDataset:
    """Random images and labels, the same in every process (drawn from their own generator)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 3, 32, 32, generator=generator)
    labels = torch.randint(0, CLASSES, (samples,), generator=generator)
    return TensorDataset(images, labels)


def main() -> None:
    """Train ``--epochs`` epochs with SGD, printing each one's wall time on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048, help="in the whole data set")
    parser.add_argument("--hand-written-ddp", action="store_true", help="torchrun-style DDP (for torchrun)")
    args = parser.parse_args()

    rank, sampler = 0, None
    torch.manual_seed(0)
    model = make_model()
    dataset = make_dataset(args.samples)
    if args.hand_written_ddp:  # the torchrun-style lines
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DistributedSampler

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = DistributedDataParallel(model)
        sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=sampler is None, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        start, start_cpu = time.perf_counter(), time.process_time()
        start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        total = 0.0
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start_faults
        if rank == 0:
            line = f"epoch {epoch + 1} {seconds:.3f}s loss {total / len(loader):.4f}"
            line += f" threads {torch.get_num_threads()} cpu {cpu_seconds:.3f}s faults {faults}"
            print(line, flush=True)

    if args.hand_written_ddp:
        del model  # free DDP before its process group: the other order can deadlock gloo at exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
