"""Each rank computes on its own GPU: the caller's CUDA tensors and the single-GPU habits of its code.

No GPU here: the CUDA condition is imitated. A ``sitecustomize.py`` on the workers' PYTHONPATH makes
``torch.cuda.device_count()`` report two GPUs and records the device arguments torch receives
(``torch.cuda.set_device``, ``Tensor.to``/``.cuda``, ``Module.to``, ``DataParallel``'s
``device_ids``) and every CUDA storage location torch is asked to restore (a deserializer
registered with ``torch.serialization.register_package``), answering with CPU tensors. The
caller tags chosen storages ``"cuda:0"`` with a tagger of its own, as a CUDA tensor is saved.
The processes, their group (gloo) and torch's serialization are real.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from autoddp import placement
from autoddp.errors import ConfigurationError
from autoddp.state import World
from conftest import write

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What the workers load first: two fake GPUs, and a record of what torch was asked to do with them.
SITECUSTOMIZE = """
import json, os

if os.environ.get("FAKE_GPUS") and "RANK" in os.environ:  # the workers only
    import torch
    import torch.serialization as serialization

    _log = open(os.path.join(os.environ["FAKE_LOG"], f"rank{os.environ['RANK']}.jsonl"), "a", buffering=1)
    ON_GPU = set()  # storages restored "on a GPU" (CPU storages here)

    def record(kind, value):
        _log.write(json.dumps([kind, str(value)]) + "\\n")

    def _cpu(device):
        is_device = isinstance(device, (str, int, torch.device))
        return "cpu" if is_device and (isinstance(device, int) or "cuda" in str(device)) else device

    def _restore(storage, location):
        if location.startswith("cuda"):
            record("restore", location)
            ON_GPU.add(storage.data_ptr())
            return storage

    def _tag(storage):  # rank 0's result: what was restored on a GPU is saved from cuda:0
        return "cuda:0" if storage.data_ptr() in ON_GPU else None

    serialization.register_package(1, _tag, _restore)
    torch.cuda.device_count = lambda: int(os.environ["FAKE_GPUS"])
    torch.cuda.set_device = lambda device: record("set_device", device)

    _tensor_to, _module_to = torch.Tensor.to, torch.nn.Module.to

    def tensor_to(self, *args, **kwargs):
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor)):
            record("to", args[0])
            args = (_cpu(args[0]), *args[1:])
        if "device" in kwargs:
            record("to", kwargs["device"])
            kwargs["device"] = _cpu(kwargs["device"])
        return _tensor_to(self, *args, **kwargs)

    def tensor_cuda(self, device=None, non_blocking=False):
        record("cuda", device)
        return self

    def module_to(self, *args, **kwargs):
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor)):
            record("to", args[0])
            args = (_cpu(args[0]), *args[1:])
        return _module_to(self, *args, **kwargs)

    torch.Tensor.to, torch.Tensor.cuda, torch.nn.Module.to = tensor_to, tensor_cuda, module_to
    _dp_init = torch.nn.DataParallel.__init__

    def dp_init(self, module, device_ids=None, output_device=None, dim=0):
        record("data_parallel", device_ids)
        _dp_init(self, module, device_ids, output_device, dim)

    torch.nn.DataParallel.__init__ = dp_init
"""


def _fake_gpus(tmp_path, gpus: int = 2) -> dict[str, str]:
    """The environment that gives the workers ``gpus`` fake GPUs, logging under tmp_path/log."""
    site = tmp_path / "site"
    site.mkdir()
    write(site / "sitecustomize.py", SITECUSTOMIZE)
    (tmp_path / "log").mkdir()
    path = os.pathsep.join([str(site), REPO, os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "FAKE_GPUS": str(gpus), "FAKE_LOG": str(tmp_path / "log")}


def _records(tmp_path, rank: int) -> list[tuple[str, str]]:
    lines = (tmp_path / "log" / f"rank{rank}.jsonl").read_text().splitlines()
    return [tuple(json.loads(line)) for line in lines]


def _run(tmp_path, args: list[str], env: dict[str, str]):
    import subprocess

    return subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, **env},
    )


# --- the rules, fed the facts --------------------------------------------------------------


def test_the_own_gpu_is_the_worlds_else_the_local_rank_among_the_visible_ones():
    assert placement.own_gpu(World(local_rank=1, world_size=2, device="cuda:1"), 8) == 1
    assert placement.own_gpu(World(local_rank=3, world_size=4, device="cuda:0"), 1) == 0  # one per task
    assert placement.own_gpu(World(local_rank=1, world_size=2, device="cpu"), 2) == 1  # gloo beside GPUs
    assert placement.own_gpu(World(local_rank=3, world_size=4, device="cpu"), 1) == 0
    assert placement.own_gpu(World(local_rank=1, world_size=2, device="cpu"), 0) is None


def test_gpu_0_and_the_local_rank_mean_the_own_gpu_another_ranks_is_an_error():
    world = World(rank=1, local_rank=1, world_size=2, device="cuda:1")
    assert placement.own_index(0, 1, world) == 1
    assert placement.own_index(1, 1, world) == 1
    task = World(rank=3, local_rank=3, world_size=4, device="cuda:0")  # --gpus-per-task=1
    assert placement.own_index(3, 0, task) == 0
    assert placement.own_index(0, 0, task) == 0
    with pytest.raises(ConfigurationError, match=r"cuda:1 is not this process's GPU: rank 0 of 2 computes"):
        placement.own_index(1, 0, World(rank=0, local_rank=0, world_size=2, device="cuda:0"))


# --- item 1: the caller's CUDA tensors -----------------------------------------------------


def test_fresh_workers_restore_the_callers_cuda_tensors_on_their_own_gpu_pinned_first(tmp_path):
    """A caller that touched CUDA sends its tensors to fresh interpreters: rank r pins cuda:r, then
    restores every "cuda:0" storage there (not 8 copies on GPU 0); rank 0's result comes back to
    the caller on the CPU, a tensor inside an object of the user's too."""
    script = write(
        tmp_path / "caller.py",
        """
        import json, sys
        import torch
        import torch.serialization as serialization
        import autoddp

        ON_GPU, RESTORED = set(), []

        def tag(storage):
            return "cuda:0" if storage.data_ptr() in ON_GPU else None

        def restore(storage, location):
            if location.startswith("cuda"):
                RESTORED.append(location)
                return storage

        serialization.register_package(1, tag, restore)

        class Box:
            def __init__(self, tensor):
                self.tensor = tensor

        weights, bias = torch.arange(6.0), torch.ones(2)
        ON_GPU.update({weights.untyped_storage().data_ptr(), bias.untyped_storage().data_ptr()})

        @autoddp.distributed(nproc=2, start_method="spawn")
        def train(weights, bias):
            return Box(weights), float(weights.sum() + bias.sum())

        box, total = train(weights, bias)
        print(json.dumps({"total": total, "restored_in_caller": RESTORED, "device": str(box.tensor.device)}))
        """,
    )
    result = _run(tmp_path, [str(script)], _fake_gpus(tmp_path))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"total": 17.0, "restored_in_caller": [], "device": "cpu"}
    for rank in (0, 1):
        records = _records(tmp_path, rank)
        restores = [value for kind, value in records if kind == "restore"]
        assert restores and set(restores) == {f"cuda:{rank}"}, records
        first_restore = next(i for i, (kind, _) in enumerate(records) if kind == "restore")
        assert ("set_device", str(rank)) in records[:first_restore], records
        assert {value for kind, value in records if kind == "set_device"} == {str(rank)}, records
