"""Issue 20, items 9 and 11: ranks against GPUs under launchers, and the checks before NCCL's first call.

No GPU here: the decision functions are fed the facts (GPU counts, launcher variables, /dev/shm
sizes, compute modes), and real launches (torchrun, srun-style tasks, a decorated call) run
with a ``sitecustomize`` that makes torch see N GPUs and records what ``torch.cuda.set_device``
and ``init_process_group`` were called with (the recorder stops the process there: nothing
claims NCCL ran). /dev/shm is a real 64 MiB tmpfs in a mount namespace; the CUDA driver asked
for compute modes is a real shared library built here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import open_mpi_rank, torchrun_worker

from autoddp.core import environment
from autoddp.core.environment import preflight
from autoddp.core.errors import ConfigurationError
from conftest import write

MIB = 1 << 20

#: Makes torch see FAKE_CUDA_GPUS GPUs and records set_device / init_process_group calls.
SITECUSTOMIZE = """
import json, os
import wrapt

def _record(**entry):
    entry["rank"] = os.environ.get("SLURM_PROCID", os.environ.get("RANK"))
    with open(os.environ["FAKE_CUDA_RECORD"], "a") as handle:
        handle.write(json.dumps(entry) + "\\n")

@wrapt.when_imported("torch")
def _fake(torch):
    gpus = int(os.environ["FAKE_CUDA_GPUS"])
    torch.backends.cuda.is_built = lambda: True
    torch.cuda.device_count = lambda: gpus
    if os.environ.get("FAKE_CUDA_INITIALIZED"):
        torch.cuda.is_initialized = lambda: True
    torch.cuda.set_device = lambda device: _record(call="set_device", device=str(device))
    import torch.distributed as dist

    def init_process_group(backend=None, **kwargs):
        _record(call="init_process_group", backend=backend, device_id=str(kwargs.get("device_id")))
        raise SystemExit(97)  # recorded: the run stops before any collective

    dist.init_process_group = init_process_group
"""

SCRIPT = """
import autoddp

@autoddp.distributed
def train():
    return 1

train()
"""


def fake_cuda(folder, gpus: int, **extra: str) -> dict[str, str]:
    """An environment where torch sees ``gpus`` GPUs and records its calls in ``folder``."""
    site = folder.parent / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        FAKE_CUDA_GPUS=str(gpus),
        FAKE_CUDA_RECORD=str(folder / "calls.jsonl"),
        **extra,
    )
    return env


def recorded(folder) -> list[dict]:
    path = folder / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def slurm_task(rank: int, ntasks: int, nodes: int, **extra: str) -> dict[str, str]:
    """One task of ``srun -N nodes -n ntasks`` (tasks spread evenly), as srun sets its variables."""
    per_node = ntasks // nodes
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(rank // per_node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
        **extra,
    }


def facts(environ: dict[str, str], gpus: int) -> preflight.Placement:
    env = environment.detect(environ)
    return preflight.placement(env.world(), env, environ, gpus)


@pytest.mark.unit
def test_each_rank_gets_its_own_gpu_or_an_error_naming_the_numbers_and_the_flag():
    # torchrun --nproc-per-node 2 on one GPU: local rank 1 has no cuda:1, rank 0 would be alone
    with pytest.raises(ConfigurationError) as error:
        preflight.gpu_index(facts(torchrun_worker(1, 2, 2), gpus=1))
    text = str(error.value)
    assert "2 ranks run on node 0 but local rank 1 sees 1 GPU(s) (CUDA_VISIBLE_DEVICES unset)" in text
    assert "torchrun --nproc-per-node=1" in text and "invalid device ordinal" in text
    # srun --ntasks-per-node=16 on 8 GPUs, all visible: two ranks on each GPU
    task = slurm_task(9, 16, 1, SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    with pytest.raises(ConfigurationError) as error:
        preflight.gpu_index(facts(task, gpus=8))
    text = str(error.value)
    assert "16 ranks run on node 0" in text and "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in text
    assert "8 given to this step" in text and "srun --ntasks-per-node=8" in text
    assert "Duplicate GPU detected" in text
    # srun --ntasks-per-gpu=2: SLURM binds two tasks to each GPU
    task = slurm_task(1, 2, 1, SLURM_NTASKS_PER_GPU="2", SLURM_GPUS_ON_NODE="1", CUDA_VISIBLE_DEVICES="0")
    with pytest.raises(ConfigurationError, match="Duplicate GPU"):
        preflight.gpu_index(facts(task, gpus=1))
    # srun --gpus-per-task=1 with 8 tasks: each sees its own GPU as cuda:0, whatever LOCAL_RANK says
    for rank in range(8):
        task = slurm_task(
            rank, 8, 1, SLURM_GPUS_PER_TASK="1", SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES=str(rank)
        )
        assert preflight.gpu_index(facts(task, gpus=1)) == 0
    # the same binding told only by the counts (8 on the node, 1 visible to the task)
    assert preflight.gpu_index(facts(slurm_task(5, 8, 1, SLURM_STEP_GPUS="0,1,2,3,4,5,6,7"), gpus=1)) == 0
    # every GPU visible, one per rank: cuda:<local rank>
    assert [preflight.gpu_index(facts(torchrun_worker(r, 8, 8), gpus=8)) for r in range(8)] == list(range(8))
    # mpirun with a wrapper that gives each rank its GPU (CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK)
    assert preflight.gpu_index(facts(open_mpi_rank(3, 4, 4, CUDA_VISIBLE_DEVICES="3"), gpus=1)) == 0
    # mpirun -np 4 on a machine of 2 GPUs, nothing bound
    with pytest.raises(ConfigurationError, match=r"mpirun --map-by ppr:2:node"):
        preflight.gpu_index(facts(open_mpi_rank(0, 4, 4), gpus=2))


@pytest.mark.unit
def test_idle_gpus_are_said_with_the_flag_that_uses_them():
    # srun -N2 --ntasks-per-node=1 on nodes of 8 GPUs: a multi-task step, run in place, one rank a node
    for rank in range(2):
        p = facts(slurm_task(rank, 2, 2), gpus=8)
        assert preflight.gpu_index(p) == 0
        assert preflight.idle_notice(p) == (
            f"autoddp: node {rank}: 8 GPU(s) visible to the 1 rank(s) of node {rank}, 1 used: 7 stay idle. "
            "Start one rank per GPU: srun --ntasks-per-node=8"
        )
    assert preflight.idle_notice(facts(torchrun_worker(0, 2, 2), gpus=8)).endswith(
        "torchrun --nproc-per-node=8"
    )
    assert preflight.idle_notice(facts(torchrun_worker(1, 2, 2), gpus=8)) is None  # local rank 0 says it
    assert preflight.idle_notice(facts(torchrun_worker(0, 8, 8), gpus=8)) is None
    per_task = slurm_task(0, 8, 1, SLURM_GPUS_PER_TASK="1", SLURM_GPUS_ON_NODE="8")
    assert preflight.idle_notice(facts(per_task, gpus=1)) is None
    # srun -n 2 --gpus-per-task=4 on 8 GPUs: each task uses 1 of its 4
    wide = facts(slurm_task(0, 2, 1, SLURM_GPUS_PER_TASK="4", SLURM_GPUS_ON_NODE="8"), gpus=4)
    assert "4 GPU(s) visible to this task, 1 used: 3 stay idle" in preflight.idle_notice(wide)
    assert preflight.idle_notice(wide).endswith("srun --ntasks-per-node=8")


@pytest.mark.unit
def test_shm_below_nccls_advice_is_said_with_the_container_flags():
    note = preflight.shm_notice(64 * MIB, 64 * MIB, 8, {})
    assert note is not None and "64 MiB free of 64 MiB" in note and "8 ranks of this machine" in note
    assert "--shm-size=1g" in note and "--ipc=host" in note and "NCCL_SHM_DISABLE=1" in note
    assert "unhandled system error" in note
    assert preflight.shm_notice(24 << 30, 24 << 30, 8, {}) is None  # a host's /dev/shm: half its memory
    assert preflight.shm_notice(64 * MIB, 64 * MIB, 1, {}) is None  # one rank a machine: no peers
    assert preflight.shm_notice(64 * MIB, 64 * MIB, 8, {"NCCL_SHM_DISABLE": "1"}) is None
    assert preflight.shm_notice(4 << 30, 900 * MIB, 2, {}) is not None  # free space counts, not size


@pytest.mark.unit
def test_gpus_the_caller_holds_in_exclusive_mode_are_refused_before_workers_start():
    exclusive, default, prohibited = (
        preflight.COMPUTE_EXCLUSIVE_PROCESS,
        preflight.COMPUTE_DEFAULT,
        preflight.COMPUTE_PROHIBITED,
    )
    problem = preflight.compute_mode_problem({0: (exclusive, True), 1: (exclusive, False)}, nproc=2)
    assert problem is not None and "cuda:0" in problem and "cuda:1" not in problem
    assert "busy or unavailable" in problem and "nvidia-smi -i N -c DEFAULT" in problem
    assert preflight.compute_mode_problem({0: (default, True), 1: (default, True)}, nproc=2) is None
    assert preflight.compute_mode_problem({0: (exclusive, False)}, nproc=1) is None  # held by no one
    assert preflight.compute_mode_problem({0: (exclusive, True)}, nproc=0) is None
    assert "Prohibited" in preflight.compute_mode_problem({1: (prohibited, False)}, nproc=2)


FAKE_DRIVER = r"""
/* CUDA's driver API as far as autoddp asks it: 2 GPUs in Exclusive_Process mode, GPU 0 held. */
int cuDeviceGetCount(int *count) { *count = 2; return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
int cuDeviceGetAttribute(int *value, int attribute, int device) {
    *value = attribute == 20 ? 3 : 0; return 0; }
int cuDevicePrimaryCtxGetState(int device, unsigned *flags, int *active) {
    *flags = 0; *active = device == 0; return 0; }
"""

NOTEBOOK = """
import autoddp

@autoddp.distributed(nproc=2)
def train():
    open({marker!r}, "w").close()

try:
    train()
except autoddp.ConfigurationError as error:
    print("refused:", error)
"""

#: One machine's srun step: starts every task with its own variables (inside a mount namespace).
NODE = """
import json, subprocess, sys
tasks = json.load(open(sys.argv[1]))
procs = [subprocess.Popen([sys.executable, sys.argv[2]], env=t, stderr=subprocess.PIPE, text=True)
         for t in tasks]
errors = [p.communicate(timeout=80)[1] for p in procs]
print(json.dumps([{"code": p.returncode, "stderr": e} for p, e in zip(procs, errors)]))
"""


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True
    )
    return probe.returncode == 0


def start(tmp_path, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    (tmp_path / name).mkdir()
    return subprocess.Popen(
        argv, env=env, cwd=tmp_path / name, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_launches_on_fake_gpus_stop_or_place_before_nccl_and_say_what_slows_them(tmp_path):
    """Three real launches at once, each with torch seeing GPUs that are not there.

    torchrun --nproc-per-node 2 on 1 GPU: both ranks stop with the numbers, nothing pinned, no
    init_process_group. srun -n 2 on a node of 8 GPUs inside a container with a 64 MiB /dev/shm:
    cuda:0 and cuda:1, NCCL's group asked for on them, and local rank 0 says 6 GPUs stay idle and
    /dev/shm is small. A notebook that made a CUDA context on GPU 0 in Exclusive_Process mode
    (a real shared library in place of libcuda answers the driver's queries): refused before any
    worker starts.
    """
    script = write(tmp_path / "train.py", SCRIPT)
    runs = {}
    torchrun = fake_cuda(tmp_path / "torchrun", gpus=1)
    runs["torchrun"] = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        torchrun,
    )

    srun = fake_cuda(tmp_path / "srun", gpus=8)
    tasks = [
        {**srun, **slurm_task(rank, 2, 1, SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")}
        for rank in range(2)
    ]
    (tmp_path / "tasks.json").write_text(json.dumps(tasks))
    node = [sys.executable, str(write(tmp_path / "node.py", NODE)), str(tmp_path / "tasks.json"), str(script)]
    small_shm = _unshare_works()
    if small_shm:  # Docker's default: a 64 MiB /dev/shm
        node = [
            "unshare",
            "-rm",
            "sh",
            "-c",
            'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"',
            "-",
            *node,
        ]
    runs["srun"] = node, srun

    (tmp_path / "driver.c").write_text(FAKE_DRIVER)
    built = shutil.which("gcc") is not None
    if built:
        subprocess.run(
            ["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "driver.c")],
            check=True,
        )
        marker = tmp_path / "ran"
        notebook = write(tmp_path / "notebook.py", NOTEBOOK.format(marker=str(marker)))
        caller = fake_cuda(
            tmp_path / "notebook", gpus=2, FAKE_CUDA_INITIALIZED="1", LD_LIBRARY_PATH=str(tmp_path)
        )
        runs["notebook"] = [sys.executable, str(notebook)], caller

    procs = {name: start(tmp_path, name, argv, env) for name, (argv, env) in runs.items()}
    results = {name: (*proc.communicate(timeout=100), proc.returncode) for name, proc in procs.items()}

    out, err, code = results["torchrun"]
    assert code != 0, out + err
    # Each rank stops by itself; torchrun ends the other when the first fails, so on a loaded
    # machine the second may be gone before it printed: at least one says it, none says otherwise.
    said = [rank for rank in (0, 1) if f"2 ranks run on node 0 but local rank {rank} sees 1 GPU(s)" in err]
    assert said and "ConfigurationError: 2 ranks run on node 0" in err, err
    assert "torchrun --nproc-per-node=1" in err
    assert recorded(tmp_path / "torchrun") == []  # neither set_device nor init_process_group was called

    out, err, code = results["srun"]
    assert code == 0, err
    first, second = json.loads(out)
    assert [first["code"], second["code"]] == [97, 97]  # stopped by the recorder at init_process_group
    assert (
        "autoddp: node 0: 8 GPU(s) visible to the 2 rank(s) of node 0, 2 used: 6 stay idle" in first["stderr"]
    )
    assert "srun --ntasks-per-node=8" in first["stderr"]
    if small_shm:
        assert "autoddp: /dev/shm has 64 MiB free of 64 MiB, below the 1 GiB NCCL advises" in first["stderr"]
        assert "--shm-size=1g" in first["stderr"]
    assert "autoddp:" not in second["stderr"]  # local rank 0 says it for the machine
    calls = sorted(
        (c["rank"], c["call"], c.get("device"), c.get("device_id")) for c in recorded(tmp_path / "srun")
    )
    assert calls == [
        ("0", "init_process_group", None, "cuda:0"),
        ("0", "set_device", "0", None),
        ("1", "init_process_group", None, "cuda:1"),
        ("1", "set_device", "1", None),
    ]

    if built:
        out, err, code = results["notebook"]
        assert code == 0, err
        assert (
            "refused: this process already holds a CUDA context on cuda:0, in the 'Exclusive_Process'" in out
        )
        assert "busy or unavailable" in out
        assert not marker.exists() and recorded(tmp_path / "notebook") == []  # no worker started
    missing = [
        why for why, ok in (("unshare -rm for a 64 MiB /dev/shm", small_shm), ("gcc", built)) if not ok
    ]
    if missing:  # the rest was checked; say what was not
        pytest.skip(f"parts not checked here (need {', '.join(missing)})")
