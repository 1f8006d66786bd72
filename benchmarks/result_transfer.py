"""How long rank 0's return value takes to reach the caller, against torch.save + torch.load.

    python benchmarks/result_transfer.py [--mib N] [--repeats N]

Times ``@autoddp.distributed(nproc=2)`` calls that return an N MiB float32 tensor against the same
calls returning None (the launch itself), in turns; the difference is the transfer. The baseline
is ``torch.save`` of the same tensor to a file in the same temporary folder and ``torch.load`` of
it back, the fastest a user could hand a tensor over by hand. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import autoddp


@autoddp.distributed(nproc=2, start_method="fork")
def make(mib: int, send: bool) -> torch.Tensor | None:
    """Stands for a train function returning a large tensor (rank 0's comes back)."""
    tensor = torch.ones(mib * 2**20 // 4)
    return tensor if send else None


def torch_save_load_s(mib: int) -> float:
    """``torch.save`` then ``torch.load`` of an N MiB tensor, through a file."""
    tensor = torch.ones(mib * 2**20 // 4)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "t.pt")
        start = time.perf_counter()
        torch.save(tensor, path)
        back = torch.load(path)
        elapsed = time.perf_counter() - start
    assert back.shape == tensor.shape
    return elapsed


def main() -> None:
    """Time the transfer and the baseline in turns and print the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    transfer, baseline = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        make(args.mib, False)
        empty = time.perf_counter() - start
        start = time.perf_counter()
        result = make(args.mib, True)
        full = time.perf_counter() - start
        assert result is not None and result.numel() == args.mib * 2**20 // 4
        del result
        transfer.append(max(full - empty, 0.0))
        baseline.append(torch_save_load_s(args.mib))
    print(
        json.dumps(
            {
                "mib": args.mib,
                "transfer_s": transfer,
                "torch_save_load_s": baseline,
                "ratio": statistics.median(transfer) / statistics.median(baseline),
            }
        )
    )


if __name__ == "__main__":
    main()
