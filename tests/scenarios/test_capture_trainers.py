"""Other people's training code, unchanged, under the command: a minGPT-style trainer.

The trainer is written in the style of karpathy/minGPT's ``Trainer`` (our own code, the same
habits): the model makes its own optimizer (``configure_optimizers`` with decay groups), the
loader draws an endless ``RandomSampler(replacement=True, num_samples=int(1e10))``, the loop counts
iterations, and a callback saves a checkpoint. Under ``autoddp -n 2`` it must train with the
parameters identical on both ranks, each rank drawing its own part of one shared stream.
"""

from __future__ import annotations

import json

import torch

from conftest import run_python, write

MINGPT_STYLE = """
    import json, os, sys
    from collections import defaultdict

    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import Dataset
    from torch.utils.data.dataloader import DataLoader


    class SortDataset(Dataset):
        # the classic toy task: read a few digits, then emit them sorted
        def __init__(self, n=64, length=5, digits=3):
            g = torch.Generator().manual_seed(1)
            self.x = torch.randint(digits, (n, length), generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            cat = torch.cat((self.x[i], torch.sort(self.x[i])[0]))
            return i, cat[:-1], cat[1:]


    class TinyGPT(nn.Module):
        def __init__(self, vocab=3, block=9, dim=16):
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(block, dim)
            self.ln = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, idx, targets=None):
            h = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
            h = h + self.mlp(self.ln(h))
            logits = self.head(h)
            if targets is None:
                return logits, None
            return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

        def configure_optimizers(self, config):
            decay, no_decay = set(), set()
            for mn, m in self.named_modules():
                for pn, p in m.named_parameters(recurse=False):
                    name = f"{mn}.{pn}" if mn else pn
                    (decay if pn.endswith("weight") and isinstance(m, nn.Linear) else no_decay).add(name)
            params = dict(self.named_parameters())
            groups = [
                {"params": [params[n] for n in sorted(decay)], "weight_decay": config["weight_decay"]},
                {"params": [params[n] for n in sorted(no_decay)], "weight_decay": 0.0},
            ]
            return torch.optim.AdamW(groups, lr=config["lr"], betas=(0.9, 0.95))


    class Trainer:
        def __init__(self, config, model, dataset):
            self.config, self.model, self.dataset = config, model, dataset
            self.callbacks = defaultdict(list)
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model = self.model.to(self.device)
            self.seen = []

        def add_callback(self, event, callback):
            self.callbacks[event].append(callback)

        def run(self):
            model, config = self.model, self.config
            optimizer = model.configure_optimizers(config)
            loader = DataLoader(
                self.dataset,
                sampler=torch.utils.data.RandomSampler(self.dataset, replacement=True, num_samples=int(1e10)),
                shuffle=False,
                batch_size=config["batch_size"],
                num_workers=config["workers"],
            )
            model.train()
            self.iter_num = 0
            data_iter = iter(loader)
            while True:
                try:
                    batch = next(data_iter)
                except StopIteration:
                    data_iter = iter(loader)
                    batch = next(data_iter)
                idx, x, y = [t.to(self.device) for t in batch]
                self.seen.append(idx.tolist())
                logits, self.loss = model(x, y)
                model.zero_grad(set_to_none=True)
                self.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                for callback in self.callbacks["on_batch_end"]:
                    callback(self)
                self.iter_num += 1
                if self.iter_num >= config["max_iters"]:
                    break


    out = sys.argv[1]
    torch.manual_seed(0)
    trainer = Trainer(
        {"lr": 5e-3, "weight_decay": 0.1, "batch_size": 8, "workers": int(sys.argv[2]), "max_iters": 12},
        TinyGPT(),
        SortDataset(),
    )

    def checkpoint(trainer):
        if trainer.iter_num % 4 == 3:
            torch.save(trainer.model.state_dict(), os.path.join(out, "model.pt"))

    trainer.add_callback("on_batch_end", checkpoint)
    trainer.run()
    rank = os.environ.get("RANK", "0")
    weights = [p.detach().flatten().tolist() for p in trainer.model.parameters()]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"seen": trainer.seen, "weights": weights, "loss": trainer.loss.item()}, f)
"""


def test_a_mingpt_style_trainer_with_an_endless_sampler_trains_in_step(tmp_path):
    script = write(tmp_path / "mingpt_train.py", MINGPT_STYLE)
    result = run_python(["-m", "autoddp.cli", "-n", "2", str(script), str(tmp_path), "1"], timeout=110)
    assert result.returncode == 0, result.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # identical replicas
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == 12
    for step in range(12):  # each rank its own batch, never the same draws
        assert ranks[0]["seen"][step] != ranks[1]["seen"][step]
    assert "TinyGPT (mingpt_train.py:" in result.stderr and "sharded" in result.stderr
    state = torch.load(tmp_path / "model.pt")  # the callback's checkpoint: written once, complete
    final = torch.cat([torch.tensor(w) for w in ranks[0]["weights"]])
    torch.testing.assert_close(torch.cat([t.flatten() for t in state.values()]), final)
