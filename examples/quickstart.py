"""The smallest autoddp program: a plain single-GPU train function, run once per device.

    python examples/quickstart.py             # one process per GPU (1 on a CPU-only machine)
    python examples/quickstart.py --nproc 2   # two processes; gloo on CPU is fine

The function below is ordinary single-device code. autoddp hands it the model wrapped in DDP and
the loader sharded with a DistributedSampler whose epoch advances by itself, so every process
trains on its own share of each batch and all end with the same weights.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoddp


def train(model: nn.Module, loader: DataLoader, epochs: int = 20) -> dict:
    device = autoddp.device()  # this process's GPU, or the CPU
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(epochs):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x.to(device)).squeeze(-1), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        if autoddp.is_main() and epoch % 5 == 4:
            print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)
    return {"world_size": autoddp.world_size(), "loss": loss.item(), "weights": model.weight}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: one per GPU, else 1)")
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x @ torch.arange(1.0, 9.0) + 0.5
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)  # per process

    result = autoddp.distributed(nproc=args.nproc)(train)(nn.Linear(8, 1), loader)
    print(f"trained on {result['world_size']} process(es); final loss {result['loss']:.4f}")
    print("weights:", [round(w, 2) for w in result["weights"].flatten().tolist()])
