"""How often a script that leaves its process group open exits cleanly: autoddp against torchrun.

``python benchmarks/clean_exits.py [--runs 50] [--only autoddp|torchrun]`` runs ``leaves_open.py``
(an all-reduce, a DDP step, no ``destroy_process_group``: what PyTorch Lightning's Trainer
leaves behind) on 2 gloo processes, again and again, under ``autoddp -n 2``
and ``torchrun --standalone --nproc-per-node 2``, interleaved. It prints each failure's last
line, then one JSON object: clean exits per launcher. Left open, gloo's threads abort the exit
("terminate called without an active exception", SIGABRT) in about one run in eight.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

LEAVES_OPEN = """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
"""

LAUNCHERS = {
    "autoddp": [sys.executable, "-m", "autoddp.cli", "-n", "2"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
}


def once(launcher: str, script: str, timeout: float = 120) -> tuple[bool, str]:
    """One run: (clean exit, the last line of its output when not)."""
    try:
        done = subprocess.run([*LAUNCHERS[launcher], script], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"no exit within {timeout} s"
    clean = done.returncode == 0 and "terminate called" not in done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    telling = [line for line in lines if "terminate called" in line or "Signal" in line or "SIG" in line]
    return clean, "" if clean else f"exit {done.returncode}: {(telling or lines or [''])[0].strip()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per launcher (default 50)")
    parser.add_argument("--only", choices=sorted(LAUNCHERS), help="run one launcher only")
    options = parser.parse_args(argv)
    launchers = [options.only] if options.only else sorted(LAUNCHERS)
    clean = dict.fromkeys(launchers, 0)
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "leaves_open.py")
        with open(script, "w") as handle:
            handle.write(textwrap.dedent(LEAVES_OPEN))
        for run in range(options.runs):
            for launcher in launchers:
                ok, why = once(launcher, script)
                clean[launcher] += ok
                if not ok:
                    print(f"run {run + 1}, {launcher}: {why}", file=sys.stderr, flush=True)
    print(json.dumps({"runs": options.runs, "clean_exits": clean}))
    return 0 if all(count == options.runs for name, count in clean.items() if name == "autoddp") else 1


if __name__ == "__main__":
    sys.exit(main())
