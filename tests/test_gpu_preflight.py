"""Issue 20, items 9 and 11: ranks against GPUs under launchers, and the checks before NCCL's first call.

No GPU here: the decision functions are fed the facts (GPU counts, launcher variables), and
real launches (torchrun, srun-style tasks) run with a ``sitecustomize`` that makes torch see N
GPUs and records what ``torch.cuda.set_device`` and ``init_process_group`` were called with
(the recorder stops the process there: nothing claims NCCL ran).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autoddp import environment, preflight
from autoddp.errors import ConfigurationError
from conftest import write

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


def torchrun_worker(local_rank: int, nproc: int) -> dict[str, str]:
    return {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": str(local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


def open_mpi_rank(local_rank: int, size: int, **extra: str) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(local_rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
        "PMIX_NAMESPACE": "job1",
        **extra,
    }


def test_each_rank_gets_its_own_gpu_or_an_error_naming_the_numbers_and_the_flag():
    # torchrun --nproc-per-node 2 on one GPU: local rank 1 has no cuda:1, rank 0 would be alone
    with pytest.raises(ConfigurationError) as error:
        preflight.gpu_index(facts(torchrun_worker(1, 2), gpus=1))
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
    assert [preflight.gpu_index(facts(torchrun_worker(r, 8), gpus=8)) for r in range(8)] == list(range(8))
    # mpirun with a wrapper that gives each rank its GPU (CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK)
    assert preflight.gpu_index(facts(open_mpi_rank(3, 4, CUDA_VISIBLE_DEVICES="3"), gpus=1)) == 0
    # mpirun -np 4 on a machine of 2 GPUs, nothing bound
    with pytest.raises(ConfigurationError, match=r"mpirun --map-by ppr:2:node"):
        preflight.gpu_index(facts(open_mpi_rank(0, 4), gpus=2))


def test_idle_gpus_are_said_with_the_flag_that_uses_them():
    # srun -N2 --ntasks-per-node=1 on nodes of 8 GPUs: a multi-task step, run in place, one rank a node
    for rank in range(2):
        p = facts(slurm_task(rank, 2, 2), gpus=8)
        assert preflight.gpu_index(p) == 0
        assert preflight.idle_notice(p) == (
            f"autoddp: node {rank}: 8 GPU(s) visible to the 1 rank(s) of node {rank}, 1 used: 7 stay idle. "
            "Start one rank per GPU: srun --ntasks-per-node=8, "
            "or --gpus-per-task=1 to give each task its own GPU"
        )
    assert preflight.idle_notice(facts(torchrun_worker(0, 2), gpus=8)).endswith("torchrun --nproc-per-node=8")
    assert preflight.idle_notice(facts(torchrun_worker(1, 2), gpus=8)) is None  # local rank 0 says it
    assert preflight.idle_notice(facts(torchrun_worker(0, 8), gpus=8)) is None
    per_task = slurm_task(0, 8, 1, SLURM_GPUS_PER_TASK="1", SLURM_GPUS_ON_NODE="8")
    assert preflight.idle_notice(facts(per_task, gpus=1)) is None


#: One machine's srun step: starts every task with its own variables (inside a mount namespace).
NODE = """
import json, subprocess, sys
tasks = json.load(open(sys.argv[1]))
procs = [subprocess.Popen([sys.executable, sys.argv[2]], env=t, stderr=subprocess.PIPE, text=True)
         for t in tasks]
errors = [p.communicate(timeout=80)[1] for p in procs]
print(json.dumps([{"code": p.returncode, "stderr": e} for p, e in zip(procs, errors)]))
"""


def start(tmp_path, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    (tmp_path / name).mkdir()
    return subprocess.Popen(
        argv, env=env, cwd=tmp_path / name, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_launches_on_fake_gpus_stop_or_place_before_nccl_and_say_what_slows_them(tmp_path):
    """Real launches at once, each with torch seeing GPUs that are not there.

    torchrun --nproc-per-node 2 on 1 GPU: both ranks stop with the numbers, nothing pinned, no
    init_process_group. srun -n 2 on a node of 8 GPUs: cuda:0 and cuda:1, NCCL's group asked for
    on them, and local rank 0 says 6 GPUs stay idle.
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
    runs["srun"] = node, srun

    procs = {name: start(tmp_path, name, argv, env) for name, (argv, env) in runs.items()}
    results = {name: (*proc.communicate(timeout=100), proc.returncode) for name, proc in procs.items()}

    out, err, code = results["torchrun"]
    assert code != 0, out + err
    for rank in (0, 1):
        assert f"ConfigurationError: 2 ranks run on node 0 but local rank {rank} sees 1 GPU(s)" in err
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
