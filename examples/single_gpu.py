"""A plain single-GPU training script, with nothing of autoddp in it.

    python examples/single_gpu.py              # one process, as written
    autoddp -n 2 examples/single_gpu.py        # the same file on 2 processes (or one per GPU)

Under ``autoddp`` the model its optimizer trains is wrapped in DDP, the shuffled training loader is
sharded (each process takes half of every epoch), the evaluation loader stays whole (so the
printed accuracy counts every test sample once) and ``torch.save`` writes the file once (to
--checkpoint; by default into the system's temporary folder, not your checkout).
"""

import argparse
import os
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser(description="A plain single-GPU training script.")
default = os.path.join(tempfile.gettempdir(), "autoddp-examples", "single_gpu.pt")
parser.add_argument("--checkpoint", default=default, help="where the weights go (default: %(default)s)")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

# Two Gaussian blobs: class 0 around -2, class 1 around +2.
x = torch.cat([torch.randn(512, 2) - 2, torch.randn(512, 2) + 2])
y = torch.cat([torch.zeros(512), torch.ones(512)]).long()
train_set = TensorDataset(x[::2], y[::2])
test_set = TensorDataset(x[1::2], y[1::2])

model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
train_loader = DataLoader(train_set, batch_size=32, shuffle=True)
test_loader = DataLoader(test_set, batch_size=128)

for epoch in range(5):
    for inputs, labels in train_loader:
        loss = nn.functional.cross_entropy(model(inputs.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch + 1}: loss {loss.item():.3f}")

correct = 0
with torch.no_grad():
    for inputs, labels in test_loader:
        correct += (model(inputs.to(device)).argmax(1).cpu() == labels).sum().item()
print(f"test accuracy {correct / len(test_set):.3f} on {len(test_set)} samples")
os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
torch.save(model.state_dict(), args.checkpoint)
print(f"weights written to {args.checkpoint}")
