"""The front doors' edges (issue 38): a worker that exits without a result, Ctrl-C twice on the
command, options that are no number of seconds, the script's ``__file__``, functions of modules
loaded under another name, standard input, and integer options of other types. Real processes."""

from __future__ import annotations

import os

import pytest

import autoddp
from autoddp import WorkerError

# --- a worker that ends without its function's result ----------------------------------------


def _exits_on(ranks: str) -> None:
    import torch.distributed as dist

    if ranks == "all" or dist.get_rank() == int(ranks):
        os._exit(0)
    dist.barrier()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("ranks", ["all", "1", "0"])
def test_a_worker_that_exits_with_status_0_before_returning_is_a_worker_error(start_method, ranks):
    call = autoddp.distributed(nproc=2, start_method=start_method)(_exits_on)
    with pytest.raises(WorkerError, match="exited with status 0 before your function returned") as raised:
        call(ranks)
    said = str(raised.value)
    if ranks != "all":
        assert said.startswith(f"rank {ranks} of 2"), said
    assert raised.value.exitcode == 0
    assert "ended well" not in "\n".join(getattr(raised.value, "__notes__", []))
