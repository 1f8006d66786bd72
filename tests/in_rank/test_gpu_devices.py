"""Each rank computes on its own GPU: the caller's CUDA tensors and the single-GPU habits of its code.

No GPU here: the CUDA condition is imitated. A ``sitecustomize.py`` on the workers' PYTHONPATH makes
``torch.cuda.device_count()`` report two GPUs (``is_built()`` False, so that the group is gloo on
a CUDA build of torch too) and records the device arguments torch receives
(``torch.cuda.set_device``, ``Tensor.to``/``.cuda`` (where ``Module.to`` ends), ``DataParallel``'s
``device_ids``) and every CUDA storage location torch is asked to restore (a deserializer
registered with ``torch.serialization.register_package``), answering with CPU tensors. The
caller tags chosen storages ``"cuda:0"`` with a tagger of its own, as a CUDA tensor is saved.
The processes, their group (gloo) and torch's serialization are real.
"""

from __future__ import annotations

import json
import os
import sys

import numpy
import pytest
import torch

from autoddp.core import _compat
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import World
from autoddp.in_rank.capture.devices import Devices
from autoddp.in_rank.world import placement
from conftest import write

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: What the workers load first: two fake GPUs, and a record of what torch was asked to do with them.
SITECUSTOMIZE = """
import json, os

if os.environ.get("FAKE_GPUS"):  # (forked workers inherit it from the caller or the command)
    import torch
    import torch.serialization as serialization

    ON_GPU = set()  # storages restored "on a GPU" (CPU storages here)

    def record(kind, value):
        if "RANK" in os.environ:  # the workers' own records
            name = os.path.join(os.environ["FAKE_LOG"], f"rank{os.environ['RANK']}.jsonl")
            with open(name, "a") as log:
                log.write(json.dumps([kind, str(value)]) + "\\n")

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

    serialization.register_package(2, _tag, _restore)  # (the caller's test tagger: 1)
    torch.cuda.device_count = lambda: int(os.environ["FAKE_GPUS"])
    # gloo, as on a CPU build: a CUDA build would pick NCCL, which aborts a rank without a driver
    torch.backends.cuda.is_built = lambda: False
    torch.cuda.set_device = lambda device: record("set_device", device)

    _tensor_to = torch.Tensor.to

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

    torch.Tensor.to, torch.Tensor.cuda = tensor_to, tensor_cuda  # (Module.to and .cuda call them)
    _dp_init = torch.nn.DataParallel.__init__

    def dp_init(self, module, device_ids=None, output_device=None, dim=0):
        record("data_parallel", device_ids)
        _dp_init(self, module, device_ids, output_device, dim)

    torch.nn.DataParallel.__init__ = dp_init

    def storage_cuda(self, device=None, non_blocking=False):
        record("storage_cuda", device)
        return self

    torch.UntypedStorage.cuda = storage_cuda
    from autoddp.core import _compat
    if _compat.accelerator() is not None:  # (torch >= 2.6)
        _compat.accelerator().set_device_index = lambda device: record("set_device_index", device)
    import torch.utils._device as device_module
    _context_init = device_module.DeviceContext.__init__

    def context_init(self, device):  # set_default_device(d) and `with torch.device(d):`
        record("default_device", device)
        _context_init(self, _cpu(device))

    device_module.DeviceContext.__init__ = context_init
    _empty_like = torch.empty_like

    def empty_like(tensor, *args, device=None, **kwargs):  # (Module.to_empty's)
        if device is not None:
            record("empty_like", device)
        return _empty_like(tensor, *args, device=_cpu(device), **kwargs)

    torch.empty_like = empty_like
    torch.cuda.memory_allocated = lambda device=None: (record("memory_allocated", device), 0)[1]
    torch.cuda.synchronize = lambda device=None: record("synchronize", device)
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


@pytest.mark.unit
def test_the_own_gpu_is_the_worlds_else_the_local_rank_among_the_visible_ones():
    assert placement.own_gpu(World(local_rank=1, world_size=2, device="cuda:1"), 8) == 1
    assert placement.own_gpu(World(local_rank=3, world_size=4, device="cuda:0"), 1) == 0  # one per task
    assert placement.own_gpu(World(local_rank=1, world_size=2, device="cpu"), 2) == 1  # gloo beside GPUs
    assert placement.own_gpu(World(local_rank=3, world_size=4, device="cpu"), 1) == 0
    assert placement.own_gpu(World(local_rank=1, world_size=2, device="cpu"), 0) is None


@pytest.mark.unit
def test_gpu_0_and_the_local_rank_mean_the_own_gpu_another_ranks_is_an_error():
    world = World(rank=1, local_rank=1, world_size=2, device="cuda:1")
    assert placement.own_index(0, 1, world) == 1
    assert placement.own_index(1, 1, world) == 1
    task = World(rank=3, local_rank=3, world_size=4, device="cuda:0")  # --gpus-per-task=1
    assert placement.own_index(3, 0, task) == 0
    assert placement.own_index(0, 0, task) == 0
    with pytest.raises(ConfigurationError, match=r"cuda:1 is not this process's GPU: rank 0 of 2 computes"):
        placement.own_index(1, 0, World(rank=0, local_rank=0, world_size=2, device="cuda:0"))


@pytest.mark.unit
def test_capture_reads_the_device_arguments_by_the_same_rule():
    devices = Devices(World(rank=1, local_rank=1, world_size=2, device="cuda:1"), lambda: None)
    assert devices.device(0) == 1 and devices.device(1) == 1
    assert devices.device(-1) == -1  # torch.cuda.device_of(a CPU tensor)
    assert devices.device(numpy.int64(0)) == 1  # an index from NumPy, as torch takes it
    assert devices.device("cuda:0") == "cuda:1"
    assert devices.device(torch.device("cuda", 0)) == torch.device("cuda", 1)
    assert devices.device("cuda") == "cuda" and devices.device(torch.device("cuda")) == torch.device("cuda")
    assert devices.device("cpu") == "cpu" and devices.device(None) is None
    assert devices.map_location("cuda:0") == "cuda:1" and devices.map_location("cpu") == "cpu"
    with pytest.raises(ConfigurationError, match="cuda:2 is not this process's GPU"):
        devices.device("cuda:2")
    assert Devices(World(), lambda: None).own is None  # no GPU: nothing is installed


# --- the caller's CUDA tensors (item 1) and single-GPU habits on ranks 1..N-1 (item 5) -----

#: A single-GPU training step full of GPU-0 habits, as a script writes it.
HABITS = """
device = torch.device("cuda:0")
torch.cuda.set_device(0)
model = nn.DataParallel(nn.Linear(3, 2)).to(device)
model.module.load_state_dict(torch.load("ckpt.pt"))  # saved from cuda:0
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 3).cuda(0)
model(x.to(device)).sum().backward()
optimizer.step()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # torchrun-style code keeps working
if _compat.accelerator() is not None:  # (torch >= 2.6)
    torch.accelerator.set_device_index(0)  # pytorch/examples' imagenet
torch.load("ckpt.pt", map_location=lambda storage, location: storage.cuda(0))
torch.set_default_device("cuda:0")
torch.set_default_device(None)
with torch.device("cuda:0"):
    pass
with torch.device("meta"):
    later = nn.Linear(3, 2)
later.to_empty(device="cuda:0")  # a meta-built model's weights
nn.Linear(3, 2).cuda(numpy.int64(0))
torch.cuda.memory_allocated(0), torch.cuda.synchronize(0)
seen = {"context": torch.cuda.device(0).idx, "module": type(model.module).__name__}
torch.load("ckpt.pt", map_location="cuda:0")  # the user's own map_location, read the same way
torch.load("ckpt.pt", map_location={"cuda:0": "cuda:0"})
seen["theirs"] = []  # a function of the user's is told the own GPU's location
torch.load("ckpt.pt", map_location=lambda storage, location: seen["theirs"].append(location) or storage)
try:
    torch.zeros(1).to("cuda:1")  # rank 1's GPU: on rank 0 a clear error
except Exception as error:
    seen["error"] = f"{type(error).__name__}: {error}"
with open(f"seen{os.environ['RANK']}.json", "w") as file:
    json.dump(seen, file)
"""

#: A caller that touched CUDA: its tensors and a checkpoint are "on cuda:0" (tagged so when saved).
CALLER = """
import json, os
import numpy
import torch
import torch.serialization as serialization
from torch import nn
import autoddp
from autoddp.core import _compat

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

state = nn.Linear(3, 2).state_dict()
weights, bias = torch.arange(6.0), torch.ones(2)
ON_GPU.update(t.untyped_storage().data_ptr() for t in (*state.values(), weights, bias))
torch.save(state, "ckpt.pt")
parallel = nn.DataParallel(nn.Linear(3, 2))  # as its __init__ leaves it on a machine of 2 GPUs:
parallel.device_ids, parallel.output_device, parallel.src_device_obj = [0, 1], 0, torch.device("cuda", 0)

@autoddp.distributed(nproc=2, start_method="spawn")  # (what CUDA in the caller makes it choose)
def train(weights, bias, parallel):
BODY
    with open(f"parallel{os.environ['RANK']}.json", "w") as file:
        json.dump([parallel.device_ids, parallel.output_device, str(parallel.src_device_obj)], file)
    return Box(weights), float(weights.sum() + bias.sum())

box, total = train(weights, bias, parallel)
print(json.dumps({"total": total, "restored_in_caller": RESTORED, "device": str(box.tensor.device)}))
"""


def _check_ranks(tmp_path, result, how: str) -> None:
    """Rank r pinned cuda:r before restoring anything, and asked torch for cuda:r only."""
    assert result.returncode == 0, f"{how}: {result.stderr}"
    assert "nn.DataParallel (" in result.stderr and "own GPU only (device_ids=[0])" in result.stderr
    for rank in (0, 1):
        records = _records(tmp_path, rank)
        kinds = {kind for kind, _ in records}
        assert {"set_device", "to", "cuda", "restore", "data_parallel"} <= kinds, (how, records)
        more = {"storage_cuda", "default_device", "empty_like", "memory_allocated"}
        more |= {"set_device_index"} if _compat.accelerator() is not None else set()
        assert more | {"synchronize"} <= kinds, (how, records)
        indices = {int(digit) for _, value in records for digit in value if digit.isdigit()}
        assert indices == {rank}, (how, rank, records)  # rank r asks for cuda:r only
        first_restore = next(i for i, (kind, _) in enumerate(records) if kind == "restore")
        assert ("set_device", str(rank)) in records[:first_restore], (how, records)
        seen = json.loads((tmp_path / f"seen{rank}.json").read_text())
        assert seen["context"] == rank and seen["module"] == "Linear", (how, seen)
        assert seen["theirs"] and set(seen["theirs"]) == {f"cuda:{rank}"}, (how, seen)
        restores = [kind for kind, _ in records if kind == "restore"]
        assert len(restores) >= 6, (how, records)  # the checkpoint's 2 storages, 3 loads onto a GPU
        if rank == 0:
            assert seen["error"].startswith("ConfigurationError: cuda:1 is not this process's GPU"), seen
        else:
            assert "error" not in seen, seen
        (tmp_path / "log" / f"rank{rank}.jsonl").unlink()


def test_each_rank_restores_the_callers_cuda_tensors_and_runs_gpu0_habits_on_its_own_gpu(tmp_path):
    """Fresh-interpreter workers of a caller that touched CUDA pin their GPU, then restore the
    caller's "cuda:0" storages there (not N copies on GPU 0); rank 0's result comes back on the
    CPU, a tensor inside an object of the user's too. The same GPU-0 habits then run on each
    rank's own GPU under the decorator and under the command (a forked worker)."""
    env = _fake_gpus(tmp_path)
    body = "".join(f"    {line}\n" for line in HABITS.strip().splitlines())
    write(tmp_path / "caller.py", CALLER.replace("BODY\n", body))
    result = _run(tmp_path, ["caller.py"], env)
    _check_ranks(tmp_path, result, "decorator")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"total": 17.0, "restored_in_caller": [], "device": "cpu"}
    for rank in (0, 1):  # a DataParallel made in the caller runs on each rank's own GPU only
        assert json.loads((tmp_path / f"parallel{rank}.json").read_text()) == [[rank], rank, f"cuda:{rank}"]
    assert "nn.DataParallel now runs on each process's own GPU only" in result.stderr

    imports = (
        "import json, os\nimport numpy\nimport torch\nfrom torch import nn\n"
        "from autoddp.core import _compat\n"
    )
    write(tmp_path / "train.py", imports + HABITS)
    result = _run(tmp_path, ["-m", "autoddp.cli", "-n", "2", "train.py"], env)
    _check_ranks(tmp_path, result, "command")
