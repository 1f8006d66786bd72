"""Train a small CNN on scikit-learn's bundled 8x8 digits (no download) on every device.

    pip install -e ".[examples]"
    python examples/digits.py --nproc 2     # 2 processes (CPU is fine); default: one per GPU

`train` is plain single-GPU code: autoddp wraps the model in DDP, shards both loaders, gathers
the test predictions so every test image counts exactly once, and saves the checkpoint from
rank 0 only (to --checkpoint; by default into the system's temporary folder, not your checkout).
With --nproc 2 --batch-size 32 the run matches --nproc 1 --batch-size 64 (the same global
batch), up to the order in which the batches are drawn.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import autoddp


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def datasets() -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train_idx, test_idx = order[:1500], order[1500:]
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(
        images[test_idx], labels[test_idx]
    )


def train(
    model: nn.Module, train_loader: DataLoader, test_loader: DataLoader, epochs: int, checkpoint: str
) -> dict:
    device = autoddp.device()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(epochs):
        model.train()
        for x, y in train_loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        with autoddp.rank0():
            print(f"epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}", flush=True)

    model.eval()
    correct = []
    with torch.no_grad():
        for x, y in test_loader:
            correct.append(model(x.to(device)).argmax(1).cpu() == y)
    correct = autoddp.gather(torch.cat(correct), test_loader)  # every test image exactly once
    autoddp.save({"model": model, "optimizer": opt}, checkpoint)
    return {
        "accuracy": correct.float().mean().item(),
        "tested": len(correct),
        "world_size": autoddp.world_size(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: one per GPU, else 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="per process (global = this x processes)")
    parser.add_argument("--epochs", type=int, default=8)
    default = os.path.join(tempfile.gettempdir(), "autoddp-examples", "digits.pt")
    parser.add_argument("--checkpoint", default=default, help="where rank 0 saves (default: %(default)s)")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)

    torch.manual_seed(0)
    train_set, test_set = datasets()
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=128)
    start = time.perf_counter()
    result = autoddp.distributed(nproc=args.nproc)(train)(
        CNN(), train_loader, test_loader, args.epochs, args.checkpoint
    )
    seconds = time.perf_counter() - start
    print(
        f"test accuracy {result['accuracy']:.4f} on {result['tested']} images, "
        f"{result['world_size']} process(es), {seconds:.1f} s"
    )
    state = torch.load(args.checkpoint, weights_only=True)
    model = CNN()
    model.load_state_dict(state["model"])  # a plain CNN: no "module." prefix
    parameters = sum(p.numel() for p in model.parameters())
    print(f"checkpoint written to {args.checkpoint}, reloaded into a plain CNN ({parameters} parameters)")


if __name__ == "__main__":
    main()
