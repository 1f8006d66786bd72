"""Issue 20, the process group before the first GPU: several decorated calls in place, the
timeout and NCCL diagnostics a GPU run gets, and a gloo group that connects only when used.

One unchanged script runs under the ``autoddp`` command and under torchrun; each rank writes what
it saw to a file. The decisions (timeout, variables) are pure functions, tested with the facts.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_python, write

SCRIPT = """
    import json, os, sys, time
    import torch, torch.distributed as dist
    import autoddp

    @autoddp.distributed
    def train(scale):
        t = torch.tensor([float(dist.get_rank() + 1) * scale])
        dist.all_reduce(t)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, dist.get_rank())  # an object collective on the group's gloo
        return t.item(), ranks

    @autoddp.distributed
    def evaluate():
        t = torch.tensor([10.0 * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    def late(call, *args):  # rank 0 arrives last, as a GPU rank still saving would
        if os.environ["RANK"] == "0":
            time.sleep(0.5)
        return call(*args)

    seen = {"first": train(1.0), "evaluate": late(evaluate), "again": late(train, 2.0)}
    seen["open_after"] = dist.is_initialized()
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as out:
        json.dump(seen, out)
"""


def _ran(tmp_path, launcher: list[str]) -> dict[int, dict]:
    script = write(tmp_path / "three_calls.py", SCRIPT)
    result = run_python([*launcher, str(script), str(tmp_path)], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}


@pytest.mark.parametrize(
    "launcher",
    [["-m", "autoddp.cli", "-n", "2"], ["-m", "torch.distributed.run", "--nproc-per-node", "2"]],
    ids=["autoddp", "torchrun"],
)
def test_three_decorated_calls_in_a_row_each_get_a_group_of_their_own(tmp_path, launcher):
    seen = _ran(tmp_path, launcher)
    for rank in range(2):
        assert seen[rank]["first"] == [3.0, [0, 1]]
        assert seen[rank]["evaluate"] == 30.0
        assert seen[rank]["again"] == [6.0, [0, 1]]
        assert seen[rank]["open_after"] is False  # each call's group ended with the call
