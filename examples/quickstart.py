"""The smallest autoddp program: a plain train function, run once per device.

    python examples/quickstart.py          # one process per GPU (1 on a CPU-only machine)
    python examples/quickstart.py --nproc 2  # two processes, gloo on CPU is fine

Each process trains the same linear model on its own share of the data; DDP averages the
gradients, so every rank ends with identical weights, equal to one process on the whole batch.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import autoddp


@autoddp.distributed
def train(epochs: int = 20) -> dict:
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x @ torch.arange(1.0, 9.0) + 0.5
    data = TensorDataset(x, y)
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, shuffle=True))

    device = autoddp.device()
    model = nn.Linear(8, 1).to(device)
    if autoddp.world_size() > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb.to(device)).squeeze(-1), yb.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        if autoddp.is_main() and epoch % 5 == 4:
            print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)
    return {"world_size": autoddp.world_size(), "loss": loss.item(), "weights": autoddp.unwrap(model).weight}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: one per GPU, else 1)")
    args = parser.parse_args()
    run = train if args.nproc is None else autoddp.distributed(nproc=args.nproc)(train.__wrapped__)
    result = run()
    print(f"trained on {result['world_size']} process(es); final loss {result['loss']:.4f}")
    print("weights:", [round(w, 2) for w in result["weights"].flatten().tolist()])
