"""Batches drawn by hand, split at the model's call: ``autoddp -n N`` against one process.

    python benchmarks/split_at_call.py [--rounds N] [--steps N] [--nproc N] [--vocab V] [--width W]

An unchanged nanoGPT-style script (batches drawn with ``torch.randint`` offsets into one tensor,
``logits, loss = model(x, y)``; an embedding, four MLP blocks, a head over ``--vocab`` tokens) runs
three ways, in turns, ``--rounds`` times each (the order rotating):

- ``one``: one process (``python script.py``) with every core's thread;
- ``one device``: one process with the threads autoddp gives each of its N processes (cores / N,
  ``OMP_NUM_THREADS``): what one device does alone, and what each process did before issue 41
  (every process ran the whole batch);
- ``autoddp``: ``autoddp -n N script.py``, each process running its rows of every batch.

Each run times ``--steps`` steps after 3 untimed ones and prints its seconds per step and its last
loss. Printed: per round the step times and the ratios of autoddp's to the others' (below 1:
faster), their medians, whether the losses are equal (they must be: the same run), and what the
split adds per step: the bytes each rank gathers (the logits of the other ranks' rows, ``B * T *
V`` floats) against the compute it saves. A larger ``--vocab`` makes the gather heavier for the
same compute. On a machine whose one process already uses every core, ``one`` is what N processes
share: N times faster is against ``one device``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

SCRIPT = """
    import sys, time, torch, torch.nn as nn, torch.nn.functional as F
    torch.manual_seed(1337)
    V, T, B, W, STEPS = {vocab}, 64, 32, {width}, {steps}
    data = torch.randint(0, V, (20000,))

    def get_batch():
        ix = torch.randint(len(data) - T - 1, (B,))
        return torch.stack([data[i:i + T] for i in ix]), torch.stack([data[i + 1:i + T + 1] for i in ix])

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, W)
            blocks = [nn.Sequential(nn.Linear(W, 4 * W), nn.GELU(), nn.Linear(4 * W, W)) for _ in range(4)]
            self.blocks = nn.Sequential(*blocks)
            self.head = nn.Linear(W, V)

        def forward(self, idx, targets=None):
            h = self.emb(idx)
            logits = self.head(h + self.blocks(h))
            loss = None if targets is None else F.cross_entropy(logits.view(-1, V), targets.view(-1))
            return logits, loss

    model = LM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS + 3):
        if step == 3:
            start = time.perf_counter()
        xb, yb = get_batch()
        logits, loss = model(xb, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    print(f"RESULT {{(time.perf_counter() - start) / STEPS:.6f}} {{loss.item():.6f}}")
"""


def _run(command: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    seconds, loss = done.stdout.split("RESULT ", 1)[1].split()
    return float(seconds), loss


def _same(losses: list[float]) -> bool:
    """The same run's loss, up to the order of float additions (the ranks' means weighed: 1e-5)."""
    return all(abs(loss - losses[0]) <= 1e-5 * abs(losses[0]) for loss in losses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=65)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "gpt.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(SCRIPT.format(vocab=args.vocab, width=args.width, steps=args.steps)))
        alone = [sys.executable, script]
        ours = [sys.executable, "-m", "autoddp.cli", "-n", str(args.nproc), "--no-step-report", script]
        threads = str(max(1, (os.cpu_count() or 1) // args.nproc))
        contenders = {
            "one": (alone, None),
            "one device": (alone, {**os.environ, "OMP_NUM_THREADS": threads}),
            "autoddp": (ours, None),
        }
        names = list(contenders)
        rounds = []
        for index in range(args.rounds):
            order = names[index % 3 :] + names[: index % 3]
            timed = {name: _run(*contenders[name]) for name in order}
            seconds = {name: timed[name][0] for name in names}
            rounds.append(
                {
                    **seconds,
                    "vs one": seconds["autoddp"] / seconds["one"],
                    "vs one device": seconds["autoddp"] / seconds["one device"],
                    "same_loss": _same([float(timed[name][1]) for name in names]),
                }
            )
            print(
                f"round {index + 1}: one process {seconds['one'] * 1e3:8.1f} ms/step, one device "
                f"({threads} thread(s)) {seconds['one device'] * 1e3:8.1f}, autoddp -n {args.nproc} "
                f"{seconds['autoddp'] * 1e3:8.1f}; losses {', '.join(timed[name][1] for name in names)}"
            )
    against_one = statistics.median(r["vs one"] for r in rounds)
    against_device = statistics.median(r["vs one device"] for r in rounds)
    rows = 32 * 64  # B * T tokens per batch
    gathered = rows * args.vocab * 4 * (args.nproc - 1) // args.nproc
    print(
        f"median ratio autoddp -n {args.nproc} / one process: {against_one:.3f}; "
        f"/ one device: {against_device:.3f}"
    )
    print(f"losses equal (1e-5) in every round: {all(r['same_loss'] for r in rounds)}")
    print(f"gathered per rank and step: {gathered / 2**20:.2f} MiB of logits (vocab {args.vocab})")
    figures = {"vs_one": against_one, "vs_one_device": against_device, "rounds": rounds}
    print(json.dumps({"nproc": args.nproc, "vocab": args.vocab, **figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
