"""Where-am-I detection in real processes: the report, and real in-place worlds (each launcher's
variables as it sets them: tests/unit/test_environment_variables.py)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import uuid

import pytest
from helpers import open_mpi_rank, srun_task

from autoddp.command.report import describe
from autoddp.core.environment import (
    PORT_SPAN,
    OpenMPI,
    SlurmStep,
    detect,
    hardware,
    shared_port,
    slurm_port,
)
from conftest import LAUNCHER_NAMES, LAUNCHER_PREFIXES, run_python, write


def test_detection_never_writes_the_environment():
    before = dict(os.environ)
    detect()
    describe(name_gpus=False)
    describe({**srun_task(0, ntasks=2)}, name_gpus=False)
    assert dict(os.environ) == before


# -- the report ------------------------------------------------------------------------------


def plain_environ() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_NAMES
    }


def flat(text: str) -> str:
    """The report with its line wrapping undone."""
    return " ".join(text.split())


def test_report_in_a_plain_process():
    text = describe(plain_environ(), name_gpus=False)  # this test process keeps CUDA untouched
    labels = {line.split()[0] for line in text.splitlines()[1:] if line[:1].strip() or line[2:3].strip()}
    assert {"python", "torch", "CUDA", "NCCL", "GPUs", "environment", "backend", "start", "port"} <= labels
    gpus = hardware.gpu_count()
    assert ("GPUs none" if gpus == 0 else f"GPUs {gpus} (names not read") in flat(text)
    assert "environment plain process; @distributed starts its own workers" in flat(text)
    assert "why no launcher variables set" in flat(text)
    assert "free port the operating system picks" in flat(text)
    assert "start method fork" in flat(text) or "start method spawn" in flat(text)


def test_report_under_slurm_names_the_step_and_why():
    text = flat(describe({**plain_environ(), **srun_task(1, ntasks=2, job_id=31337)}, name_gpus=False))
    assert "environment SLURM step (srun); launched: @distributed runs in place" in text
    assert "why SLURM_PROCID=1" in text and "SLURM_STEP_NUM_TASKS=2" in text
    assert "rank 1 of 2" in text and "rank 0 at localhost:21337" in text
    assert "port policy 21337 (20000 + SLURM_JOB_ID % 10000)" in text


@pytest.mark.parametrize(
    "env", [{"RANK": "1"}, {"RANK": "x", "WORLD_SIZE": "2"}, open_mpi_rank(5, size=8, local_size=4)]
)
def test_report_never_raises(env):
    text = describe({**plain_environ(), **env}, name_gpus=False)
    assert "broken" in text.lower()


# -- real processes: the launcher's variables, no launcher -------------------------------------

IN_PLACE = """
    import json, os
    import psutil, torch, torch.distributed as dist
    import autoddp
    from autoddp.core import environment

    @autoddp.distributed(backend="gloo", timeout=30)  # gloo: the same world with or without GPUs
    def train():
        t = torch.tensor([float(autoddp.rank() + 1)])
        dist.all_reduce(t)
        return {"pid": os.getpid(), "rank": autoddp.rank(), "world": autoddp.world_size(),
                "sum": t.item(), "children": len(psutil.Process().children(recursive=True))}

    env = environment.detect()
    print(json.dumps({**train(), "main_pid": os.getpid(), "env": env.name}), flush=True)
"""


def _child_env(variables: dict[str, str]) -> dict[str, str]:
    return {**plain_environ(), "OMP_NUM_THREADS": "1", **variables}


def _run_together(script, envs: list[dict[str, str]], timeout: float = 60) -> list[dict]:
    """Start one plain ``python script`` per environment at once, as a launcher would; their results."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def _free_derived_port(candidates) -> tuple[int, object]:
    """The first candidate whose derived port is free here now (parallel test runs use others)."""
    for candidate, port in candidates:
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        return port, candidate
    raise AssertionError("no free port in the derived range")  # pragma: no cover


def _check_in_place(results: list[dict], name: str) -> None:
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert result["env"] == name
        assert result["world"] == 2 and result["sum"] == 3.0  # 1 + 2: both processes took part
        assert result["pid"] == result["main_pid"]  # ran in place
        assert result["children"] == 0  # and started no process


def test_two_srun_tasks_form_a_world_in_place(tmp_path):
    jobs = (
        (job, slurm_port(str(job)))
        for job in (random.randrange(1, 9999) * PORT_SPAN + n for n in range(9999))
    )
    _, job_id = _free_derived_port(random.sample(list(jobs), 200))
    script = write(tmp_path / "train.py", IN_PLACE)
    envs = [_child_env(srun_task(rank, ntasks=2, job_id=job_id)) for rank in (0, 1)]
    _check_in_place(_run_together(script, envs), SlurmStep.name)


def test_two_open_mpi_ranks_form_a_world_in_place(tmp_path):
    spaces = (f"prterun-test-{uuid.uuid4().hex}@1" for _ in range(200))
    _, namespace = _free_derived_port((space, shared_port(space)) for space in spaces)
    script = write(tmp_path / "train.py", IN_PLACE)
    envs = [_child_env(open_mpi_rank(rank, size=2, local_size=2, namespace=namespace)) for rank in (0, 1)]
    _check_in_place(_run_together(script, envs), OpenMPI.name)


SINGLE_TASK = """
    import json, os
    import autoddp
    from autoddp.command.report import describe

    @autoddp.distributed(backend="gloo")  # one CPU process unless told otherwise, GPUs or not
    def alone():
        return os.getpid(), autoddp.world_size()

    @autoddp.distributed(nproc=2, backend="gloo")
    def pair():
        return os.getpid(), autoddp.world_size()

    result = {"main": os.getpid(), "alone": alone(), "pair": pair(), "report": describe()}
    print(json.dumps(result), flush=True)
"""


def test_single_task_allocation_runs_as_one_process(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES:
            monkeypatch.delenv(name)
    for name, value in srun_task(0, ntasks=1, job_id=55).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = write(tmp_path / "single.py", SINGLE_TASK)
    proc = run_python([str(script)], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["alone"] == [out["main"], 1]  # in this process, alone
    pair_pid, pair_world = out["pair"]
    assert pair_world == 2 and pair_pid != out["main"]  # not launched: autoddp started its own workers
    assert "environment SLURM allocation, single process" in flat(out["report"])
    assert "a single-task srun step (SLURM_STEP_NUM_TASKS=1)" in flat(out["report"])
