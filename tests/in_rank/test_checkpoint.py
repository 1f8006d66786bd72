"""save()/load(): real 2-process gloo runs; a worker killed in the middle of a save."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
from helpers import gather

import autoddp
from autoddp import WorkerError
from autoddp.core.errors import Rank0Error
from autoddp.in_rank.checkpoint.files import TEMPORARY_SUFFIX, load, save


def test_save_from_rank0_and_load_everywhere(tmp_path):
    path = str(tmp_path / "ckpt.pt")

    @autoddp.distributed(nproc=2)
    def train(prepared):  # a model argument: autoddp prepares (wraps) it
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()

        writes = []
        real_save = torch.save

        def counting_save(obj, f, *args, **kwargs):  # count the writes; rank 0 also takes its time
            writes.append(type(obj).__name__)
            time.sleep(0.3)
            return real_save(obj, f, *args, **kwargs)

        torch.save = counting_save
        try:
            missing = load(path, default=None)
            save({"model": model, "optimizer": optimizer, "epoch": 3, "nested": [model, prepared]}, path)
            # Every rank returns only once the file is complete: rank 1 reads it at once.
            state = load(path)
            inode = os.stat(path).st_ino
            try:
                save(model, os.path.join(path + ".d", "x.pt"))
                failure = None
            except Exception as exc:  # rank 0: FileNotFoundError; rank 1: Rank0Error
                failure = [type(exc).__name__, str(exc)]
        finally:
            torch.save = real_save
        leftovers = sorted(os.listdir(os.path.dirname(path)))
        return gather(
            {
                "missing": missing,
                "failure": failure,
                "writes": writes,
                "keys": sorted(state["model"]),
                "epoch": state["epoch"],
                "same_weights": torch.equal(state["model"]["weight"], model.module.weight),
                "optimizer_momentum": bool(state["optimizer"]["state"]),
                "nested_keys": sorted(state["nested"][0]),
                "prepared_keys": sorted(state["nested"][1]),
                "inode": inode,
                "leftovers": leftovers,
            }
        )

    r0, r1 = train(torch.nn.Linear(4, 3))
    assert r0["writes"] == ["dict"] and r1["writes"] == []  # written once, by rank 0
    assert r0["missing"] is None and r1["missing"] is None
    assert r0["failure"][0] == "FileNotFoundError" and "does not exist; create it" in r0["failure"][1]
    assert r1["failure"][0] == Rank0Error.__name__
    assert re.search(r"autoddp.save\(.*x.pt.\) failed on rank 0 with FileNotFoundError", r1["failure"][1])
    for r in (r0, r1):
        assert r["keys"] == r["nested_keys"] == r["prepared_keys"] == ["bias", "weight"]  # no module.
        assert r["epoch"] == 3 and r["same_weights"] and r["optimizer_momentum"]
        assert r["leftovers"] == ["ckpt.pt"]
    assert r0["inode"] == r1["inode"]

    plain = torch.nn.Linear(4, 3)  # the state loads into the undecorated model
    plain.load_state_dict(load(path)["model"])
    assert load(str(tmp_path / "nope.pt"), default=None) is None
    with pytest.raises(FileNotFoundError, match=r"nope\.pt.*default=None"):
        load(tmp_path / "nope.pt")


@pytest.mark.unit
def test_plain_process_round_trip(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    save((model, {"step": 7}), tmp_path / "c.pt")
    state, extra = load(tmp_path / "c.pt")
    assert extra == {"step": 7}
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    fresh.load_state_dict(state)  # metadata and buffers included
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )
    assert os.listdir(tmp_path) == ["c.pt"]


def test_killed_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save({"version": 1, "weights": torch.arange(4.0)}, path)

    @autoddp.distributed(nproc=2)
    def train():
        if autoddp.rank() == 0:

            def kill_once_the_new_file_grows():
                while True:
                    with os.scandir(os.path.dirname(path)) as entries:
                        for entry in entries:
                            if entry.name.endswith(TEMPORARY_SUFFIX) and entry.stat().st_size > 1 << 20:
                                os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(0.0005)

            threading.Thread(target=kill_once_the_new_file_grows, daemon=True).start()
        big = [torch.full((1 << 20,), float(i)) for i in range(64)]  # 64 x 4 MiB, written one by one
        save({"version": 2, "weights": big}, path)
        return "finished"

    with pytest.raises(WorkerError, match="rank 0 .*SIGKILL"):
        train()
    state = load(path)
    assert state["version"] == 1 and torch.equal(state["weights"], torch.arange(4.0))
    stale = [name for name in os.listdir(tmp_path) if name.endswith(TEMPORARY_SUFFIX)]
    assert len(stale) == 1 and stale[0].startswith(".ckpt.pt.")  # recognisable leftover
    save({"version": 3}, path)  # the next successful save cleans it up
    assert os.listdir(tmp_path) == ["ckpt.pt"] and load(path) == {"version": 3}
