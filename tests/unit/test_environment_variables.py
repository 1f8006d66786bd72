"""Where-am-I detection: each launcher's variables as it sets them (the real in-place worlds:
tests/core/test_environment.py)."""

from __future__ import annotations

import time
import types

import pytest
from helpers import open_mpi_rank, srun_task, torchrun_worker

from autoddp import ConfigurationError
from autoddp.core import environment
from autoddp.core.environment import (
    MPICH,
    PORT_BASE,
    PORT_SPAN,
    AutoDDPWorker,
    OpenMPI,
    Plain,
    RankEnv,
    SlurmAllocation,
    SlurmStep,
    TorchElastic,
    detect,
    first_host,
    hardware,
    shared_port,
    slurm_port,
)
from autoddp.core.environment._hostlist import hosts

pytestmark = pytest.mark.unit  # every test here starts no process


def _read_only(env: dict[str, str]) -> types.MappingProxyType:
    """Detection gets a read-only mapping: nothing may write to the environment it reads."""
    return types.MappingProxyType(dict(env))


def found(env: dict[str, str]) -> environment.Environment:
    return detect(_read_only(env))


def salloc_shell(ntasks: int = 4, job_id: int = 777) -> dict[str, str]:
    """What an ``salloc -n 4`` shell sees: the allocation, no step, no task id."""
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NAME": "interactive",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_NODELIST": "gpu[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_TASKS_PER_NODE": "2(x2)",
    }


def hydra_rank(rank: int, size: int = 4, local_size: int = 4, **extra: str) -> dict[str, str]:
    """The variables MPICH's / Intel MPI's Hydra mpiexec gives a rank."""
    return {
        "PMI_RANK": str(rank),
        "PMI_SIZE": str(size),
        "PMI_FD": "6",
        "MPI_LOCALRANKID": str(rank % local_size),
        "MPI_LOCALNRANKS": str(local_size),
        **extra,
    }


# -- SLURM -----------------------------------------------------------------------------------


def test_slurm_multitask_step_over_two_nodes():
    env = found(srun_task(3, ntasks=4, nodes=["gpu07", "gpu08"], job_id=1234567, job_nodelist="gpu[07-08]"))
    assert isinstance(env, SlurmStep) and env.launched
    world = env.world()
    assert (world.rank, world.local_rank, world.world_size) == (3, 1, 4)
    assert (world.local_world_size, world.node_rank) == (2, 1)
    assert (world.master_addr, world.master_port) == ("gpu07", 24567)
    explanation = env.explain()
    assert "SLURM_PROCID=3" in explanation and "srun step of 4 tasks" in explanation
    assert (
        "first host of SLURM_STEP_NODELIST" in explanation and "20000 + SLURM_JOB_ID % 10000" in explanation
    )


def test_slurm_uneven_tasks_per_node():
    # 5 tasks on 2 nodes: srun writes SLURM_STEP_TASKS_PER_NODE=3,1 -> here "3,2" (block layout)
    env = found(srun_task(4, ntasks=5, nodes=["a1", "a2"]))
    world = env.world()
    assert (world.node_rank, world.local_rank, world.local_world_size) == (1, 1, 2)
    compact = found(
        {**srun_task(7, ntasks=8, nodes=["a1", "a2", "a3"]), "SLURM_STEP_TASKS_PER_NODE": "3(x2),2"}
    )
    assert compact.world().local_world_size == 2


def test_every_task_of_a_step_agrees_on_rank_zero():
    worlds = [found(srun_task(r, ntasks=4, nodes=["n1", "n2"], job_id=98765)).world() for r in range(4)]
    assert {(w.master_addr, w.master_port, w.world_size) for w in worlds} == {("n1", 28765, 4)}
    assert sorted(w.rank for w in worlds) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "env, why",
    [
        (salloc_shell(), "salloc shell"),
        # the batch script itself: slurmstepd gives it task variables but it is no srun step
        ({**salloc_shell(), "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}, "batch script"),
        (
            {**srun_task(0, ntasks=4), "SLURM_STEP_ID": "4294967294", "SLURM_STEPID": "4294967294"},
            "batch script",
        ),
        (
            {**srun_task(0, ntasks=4), "SLURM_STEP_ID": "4294967290", "SLURM_STEPID": "4294967290"},
            "interactive",
        ),
        (srun_task(0, ntasks=1), "single-task srun step"),  # srun --pty bash, srun -n1 python ...
    ],
    ids=["salloc", "batch-script", "batch-step-id", "interactive-step", "one-task-step"],
)
def test_slurm_allocation_without_a_multitask_step_is_not_launched(env, why):
    found_env = found(env)
    assert isinstance(found_env, SlurmAllocation) and not found_env.launched
    assert found_env.world().world_size == 1
    explanation = found_env.explain()
    assert why in explanation
    assert "Not a multi-task step" in explanation and "starts its own workers" in explanation


def test_salloc_with_many_tasks_says_how_to_use_them():
    explanation = found(salloc_shell(ntasks=4)).explain()
    assert "SLURM_NTASKS=4" in explanation and "only srun starts them" in explanation


@pytest.mark.parametrize(
    "text, expected",
    [
        ("localhost", ["localhost"]),
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("gpu[009-011]-ib", ["gpu009-ib", "gpu010-ib", "gpu011-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        (" a1 , b[2] ,", ["a1", "b2"]),
        ("x-1.cluster,y[3,1]", ["x-1.cluster", "y3", "y1"]),
    ],
)
def test_hostlist_expansion(text, expected):
    assert list(hosts(text)) == expected
    assert first_host(text) == expected[0]


@pytest.mark.parametrize("text", ["node[01-03", "node]1", "node[a-b]", "node[3-1]", "node[]", "", " , "])
def test_bad_hostlist_names_the_fix(text):
    with pytest.raises(ConfigurationError, match="MASTER_ADDR"):
        first_host(text)


def test_first_host_does_not_expand_the_whole_list():
    start = time.monotonic()
    assert first_host("n[0-999999999],m1") == "n0"
    assert time.monotonic() - start < 1


def test_port_from_job_id_is_stable_and_in_range():
    assert slurm_port("1234567") == 24567 == slurm_port("1234567")
    ports = [slurm_port(str(job)) for job in range(5_000_000, 5_010_000)]
    assert len(set(ports)) == PORT_SPAN  # consecutive jobs sharing a node never collide
    assert min(ports) == PORT_BASE and max(ports) == PORT_BASE + PORT_SPAN - 1 < 32768
    assert PORT_BASE >= 1024
    with pytest.raises(ConfigurationError, match="MASTER_PORT"):
        slurm_port("12_3")


def test_shared_port_is_stable_and_in_range():
    keys = [f"prterun-host-{n}@1" for n in range(2000)]
    ports = [shared_port(key) for key in keys]
    assert ports == [shared_port(key) for key in keys]
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert len(set(ports)) > 1800


def test_master_addr_and_port_override_slurm():
    env = found(srun_task(1, ntasks=2, MASTER_ADDR="10.0.0.5", MASTER_PORT="31000"))
    assert isinstance(env, SlurmStep)
    world = env.world()
    assert (world.master_addr, world.master_port) == ("10.0.0.5", 31000)
    assert "MASTER_ADDR=10.0.0.5" in env.explain() and "31000 (MASTER_PORT)" in env.explain()
    for bad in ("http", "70000", "0"):
        with pytest.raises(ConfigurationError, match="MASTER_PORT"):
            found(srun_task(1, ntasks=2, MASTER_PORT=bad)).world()


def test_slurm_step_without_job_id_or_nodelist_names_the_fix():
    env = srun_task(0, ntasks=2)
    for name in ("SLURM_JOB_ID", "SLURM_JOBID"):
        del env[name]
    with pytest.raises(ConfigurationError, match="set MASTER_PORT"):
        found(env).world()
    env = srun_task(0, ntasks=2)
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        del env[name]
    with pytest.raises(ConfigurationError, match="set MASTER_ADDR"):
        found(env).world()


def test_impossible_slurm_task_ids_are_refused():
    with pytest.raises(ConfigurationError, match="start the job with srun"):
        found({**srun_task(1, ntasks=2), "SLURM_PROCID": "5"}).world()


# -- MPI -------------------------------------------------------------------------------------


def test_open_mpi_on_one_node_uses_loopback_and_a_shared_port():
    worlds = [found(open_mpi_rank(r)) for r in range(4)]
    assert all(isinstance(env, OpenMPI) and env.launched for env in worlds)
    ranks = [env.world() for env in worlds]
    assert [(w.rank, w.local_rank, w.world_size, w.local_world_size) for w in ranks][2] == (2, 2, 4, 4)
    assert {(w.master_addr, w.master_port) for w in ranks} == {
        ("127.0.0.1", shared_port("prterun-host-4711@1"))
    }
    assert "crc32(PMIX_NAMESPACE)" in worlds[0].explain()


def test_open_mpi_4_job_id_also_gives_a_port():
    env = open_mpi_rank(1, size=2, local_size=2)
    del env["PMIX_NAMESPACE"]
    env["OMPI_MCA_orte_hnp_uri"] = "2473721856.0;tcp://10.1.1.1:40433"
    assert found(env).world().master_port == shared_port(env["OMPI_MCA_orte_hnp_uri"])


def test_mpich_and_intel_mpi():
    env = found(hydra_rank(1, size=2, local_size=2, PMI_PORT="host1:41234"))
    assert isinstance(env, MPICH) and env.launched
    world = env.world()
    assert (world.rank, world.local_rank, world.world_size) == (1, 1, 2)
    assert (world.master_addr, world.master_port) == ("127.0.0.1", shared_port("host1:41234"))
    with pytest.raises(ConfigurationError, match=r"MASTER_PORT.*mpiexec -genv"):
        found(hydra_rank(1, size=2, local_size=2)).world()  # PMI_FD only: nothing shared to derive from
    fixed = found(hydra_rank(1, size=2, local_size=2, MASTER_PORT="29777")).world()
    assert (fixed.master_addr, fixed.master_port) == ("127.0.0.1", 29777)


def test_mpi_over_several_nodes_needs_master_addr():
    with pytest.raises(ConfigurationError, match=r"MASTER_ADDR.*mpirun -x MASTER_ADDR=") as info:
        found(open_mpi_rank(5, size=8, local_size=4)).world()
    assert "several machines" in str(info.value)
    with pytest.raises(ConfigurationError, match=r"MASTER_ADDR.*mpiexec -genv MASTER_ADDR"):
        found(hydra_rank(5, size=8, local_size=4)).world()
    assert "Broken:" in found(open_mpi_rank(5, size=8, local_size=4)).explain()
    world = found({**open_mpi_rank(5, size=8, local_size=4), "MASTER_ADDR": "node01"}).world()
    assert (world.master_addr, world.node_rank, world.local_rank) == ("node01", 1, 1)
    assert world.master_port == shared_port("prterun-host-4711@1")  # the namespace is job-wide


def test_pmi_without_local_ranks_names_the_fix():
    with pytest.raises(ConfigurationError, match="MPI_LOCALRANKID"):
        found({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}).world()


@pytest.mark.parametrize("env", [open_mpi_rank(0, size=1, local_size=1), hydra_rank(0, size=1, local_size=1)])
def test_mpi_world_of_one_process_is_plain(env):
    found_env = found(env)
    assert isinstance(found_env, Plain) and not found_env.launched
    assert "MPI world of one process" in found_env.explain()


def test_mpirun_inside_a_slurm_allocation_is_mpi():
    # mpirun started its daemons with srun (one task per node); the ranks inherit that step's variables
    daemons = srun_task(1, ntasks=2, nodes=["n1", "n2"])
    env = found({**daemons, **open_mpi_rank(6, size=8, local_size=4), "MASTER_ADDR": "n1"})
    assert isinstance(env, OpenMPI)
    assert env.world().world_size == 8
    assert "SLURM variables describe the step that started the MPI daemons" in env.explain()


def test_srun_direct_mpi_launch_is_slurm():
    # srun --mpi=pmi2: PMI variables describe the same world; SLURM's node list gives the address
    env = found({**srun_task(1, ntasks=2, nodes=["n1", "n2"]), **hydra_rank(1, size=2, local_size=1)})
    assert isinstance(env, SlurmStep)
    assert env.world().master_addr == "n1"


# -- torchrun, autoddp, operators, wrappers ----------------------------------------------------


def test_torchrun_inside_srun_is_torchrun():
    env = found({**srun_task(1, ntasks=2, nodes=["node01", "node02"]), **torchrun_worker(5)})
    assert isinstance(env, TorchElastic) and env.launched
    world = env.world()
    assert (world.rank, world.local_rank, world.world_size, world.node_rank) == (5, 1, 8, 1)
    assert (world.master_addr, world.master_port) == ("node01", 29400)
    assert "inside a SLURM step" in env.explain()


def test_autoddp_worker_inside_a_slurm_allocation():
    worker = {
        "AUTODDP_RUN_ID": "abc",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    env = found({**srun_task(0, ntasks=1), **worker, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "40000"})
    assert isinstance(env, AutoDDPWorker)
    world = env.world()
    assert (world.rank, world.world_size, world.master_addr, world.master_port) == (1, 2, "127.0.0.1", 40000)
    assert "operating system picked" in env.port_policy()


def test_kubeflow_pytorchjob_replica():
    pod = {
        "MASTER_ADDR": "mnist-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "3",
        "RANK": "2",
        "PYTHONUNBUFFERED": "1",
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    }
    env = found(pod)
    assert isinstance(env, RankEnv) and env.launched
    world = env.world()
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == (2, 3, 0, 1)
    assert (world.node_rank, world.master_addr, world.master_port) == (2, "mnist-master-0", 23456)
    assert "one process per pod" in env.explain()
    # a script on one machine that sets RANK/WORLD_SIZE only: local rank = rank, as before
    script = found({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}).world()
    assert (script.local_rank, script.local_world_size) == (1, 2)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
        ({**srun_task(1, ntasks=2), "RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
    ],
)
def test_half_set_rank_variables_are_refused(env, message):
    with pytest.raises(ConfigurationError, match=message):
        found(env)


def test_rank_set_by_a_wrapper_in_a_slurm_step():
    same = found({**srun_task(1, ntasks=2), "RANK": "1", "WORLD_SIZE": "2"})
    assert isinstance(same, SlurmStep) and same.world().master_addr == "localhost"
    # `export RANK=$SLURM_PROCID` in the batch script gave every task RANK=0: SLURM's rank is used
    stale = found({**srun_task(1, ntasks=2), "RANK": "0", "WORLD_SIZE": "2"})
    assert isinstance(stale, SlurmStep) and stale.world().rank == 1
    assert "RANK=0 disagrees with SLURM_PROCID=1" in stale.explain()
    # one task per node running its own per-GPU launcher: its world wins
    inner = found({**srun_task(1, ntasks=2, nodes=["n1", "n2"]), "RANK": "9", "WORLD_SIZE": "16"})
    assert isinstance(inner, RankEnv) and inner.world().world_size == 16
    assert "a launcher inside it set RANK/WORLD_SIZE" in inner.explain()


def test_plain_process():
    env = found({"HOME": "/root", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert isinstance(env, Plain) and not env.launched
    assert env.world().world_size == 1
    assert "no launcher variables set" in env.explain()


def test_gpu_assignment_and_idle_gpus(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_count", lambda: 1)  # --gpus-per-task=1: each task sees one GPU
    assert found(srun_task(3, ntasks=4)).world().device == "cuda:0"
    monkeypatch.setattr(hardware, "gpu_count", lambda: 4)  # every GPU of the node visible
    assert found(srun_task(3, ntasks=4)).world().device == "cuda:3"
    monkeypatch.setattr(hardware, "gpu_count", lambda: 8)  # one task per node on an 8-GPU node
    explanation = found(srun_task(1, ntasks=2, nodes=["n1", "n2"])).explain()
    assert "7 GPU(s) stay idle" in explanation and "--ntasks-per-node=8" in explanation
