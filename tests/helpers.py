"""Helpers several test files share: one copy each (the fixtures and run helpers are conftest's).

Three parts: processes and launcher variables; the real launchers and networks of tests/clusters/;
what a forked worker's patches look like (``inspected``, ``signature_faults``).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from autoddp.core import _patches


def free_port() -> int:
    """A TCP port free on loopback now (a rendezvous for a test's own processes)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def gather(value):
    """Every rank's ``value``, in rank order (inside a distributed run)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def interleave(shares):
    """The global order whose position i * W + r is rank r's i-th item."""
    return [share[i] for i in range(len(shares[0])) for share in shares]


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (ended, waiting to be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pids: list[int], timeout: float = 10, *, kill: bool = False) -> bool:
    """Whether every process of ``pids`` ends within ``timeout`` seconds; ``kill``: those that
    did not are killed then (the test failed, and leaves nothing behind)."""
    deadline = time.monotonic() + timeout
    while any(running(pid) for pid in pids):
        if time.monotonic() > deadline:
            for pid in pids if kill else ():
                if running(pid):
                    os.kill(pid, signal.SIGKILL)
            return False
        time.sleep(0.1)
    return True


def torchrun_worker(rank: int, world_size: int = 8, local_world_size: int = 4) -> dict[str, str]:
    """The variables torchrun gives worker ``rank`` (ranks placed node by node)."""
    return {
        "TORCHELASTIC_RUN_ID": "job-1",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(rank // local_world_size),
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "29400",
    }


def srun_task(
    rank: int,
    ntasks: int = 2,
    nodes: list[str] | None = None,
    job_id: int = 4242,
    job_nodelist: str | None = None,
    **extra: str,
) -> dict[str, str]:
    """The SLURM variables srun gives task ``rank`` of a step (block distribution, as srun's default)."""
    nodes = nodes or ["localhost"]
    per_node = [ntasks // len(nodes) + (1 if i < ntasks % len(nodes) else 0) for i in range(len(nodes))]
    node, first = 0, 0
    while rank >= first + per_node[node]:
        first += per_node[node]
        node += 1
    compact = ",".join(str(n) for n in per_node)
    nodelist = job_nodelist or ",".join(nodes)
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(len(nodes)),
        "SLURM_NNODES": str(len(nodes)),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_TASKS_PER_NODE": compact,
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": str(len(nodes)),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_TASKS_PER_NODE": compact,
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank - first),
        "SLURM_NODEID": str(node),
        "SLURMD_NODENAME": nodes[node],
        "SLURM_CPUS_ON_NODE": "8",
        **extra,
    }


def open_mpi_rank(
    rank: int, size: int = 4, local_size: int = 4, namespace: str = "prterun-host-4711@1", **extra: str
) -> dict[str, str]:
    """The variables Open MPI's mpirun gives a rank (ranks placed node by node), and ``extra``."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank % local_size),
        "OMPI_UNIVERSE_SIZE": str(size),
        "OMPI_FIRST_RANKS": "0",
        "OMPI_APP_CTX_NUM_PROCS": str(size),
        "PMIX_RANK": str(rank),
        "PMIX_NAMESPACE": namespace,
        "OMPI_MCA_ess_base_vpid": str(rank),
        **extra,
    }


def fork_or_skip() -> None:
    """Skip a test that needs workers forked from this process where autoddp (rightly) refuses
    fork here: torch's CUDA builds, after an earlier test's torch.compile and backward in this
    process started autograd's device threads. The reason is autoddp's own."""
    import pytest

    from autoddp.core.errors import ConfigurationError
    from autoddp.launch.start_method import choose_start_method

    try:
        choose_start_method("fork")
    except ConfigurationError as refused:
        pytest.skip(str(refused))


# --- real launchers and networks ----------------------------------------------------------------
# Shared by the tests that run real launchers and networks (tests/clusters/test_clusters_*.py).
#
# ``tests/clusters/setup.sh start`` (as root) installs Debian's SLURM, munge, Open MPI and MPICH,
# starts a one-node SLURM cluster and makes two network namespaces joined by a veth pair; ``.ci/run``
# runs it. Each test here skips, saying what is missing and how to get it, where that was not done.

SETUP = "tests/clusters/setup.sh start (as root)"
#: The two "hosts": network namespace, address, the name each host's /etc/hosts gives the pair.
HOSTS = (("autoddp-h0", "10.213.13.1", "autoddp-node0"), ("autoddp-h1", "10.213.13.2", "autoddp-node1"))

#: A plain script written for torchrun: init from env://, an all-reduce, then it leaves the group open.
TORCHRUN_STYLE = """
    import json, os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    found = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
             "local_rank": int(os.environ["LOCAL_RANK"]), "master": os.environ["MASTER_ADDR"],
             "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    sys.stdout.write("RESULT " + json.dumps(found) + "\\n")  # one write: ranks share the output
"""

#: A decorated function; ``python decorated.py [NPROC]``. Prints what the caller got back.
#: (Each script writes its line at once: PYTHONUNBUFFERED=1 makes print() two writes, which
#: ranks sharing one output could interleave.)
DECORATED = """
    import json, os, sys, torch, torch.distributed as dist, autoddp
    from autoddp.core import environment

    @autoddp.distributed(backend="gloo", nproc=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    def train():
        t = torch.ones(1) * (autoddp.rank() + 1)
        dist.all_reduce(t)
        return {"rank": autoddp.rank(), "world": autoddp.world_size(), "sum": t.item(), "pid": os.getpid()}

    where = environment.detect().name
    found = {"caller": os.getpid(), "env": where, "result": train()}
    sys.stdout.write("RESULT " + json.dumps(found) + "\\n")  # one write: ranks share the output
"""


#: Each rank says its global rank on stdout and on stderr; with ``fails`` ranks 2 and 3 (node 1's,
#: two workers a node) then raise at once, and the other ranks lose their peers.
SPEAK = """
rank = dist.get_rank()
sys.stdout.write(f"out of rank {rank}\\n")
sys.stdout.flush()
sys.stderr.write(f"err of rank {rank}\\n")
sys.stderr.flush()
dist.barrier()
if fails and rank >= 2:
    raise ValueError(f"bad batch on rank {rank}")
dist.barrier()
"""

#: ``SPEAK`` in a function decorated for two nodes of two workers with ``ranks="all"`` and a
#: ``log_dir``; ``python speaks_decorated.py NODE MASTER LOG_DIR [fail]`` prints what its caller got.
SPEAK_DECORATED = """
import json, sys, torch.distributed as dist, autoddp

node, master, logs = int(sys.argv[1]), sys.argv[2], sys.argv[3]

@autoddp.distributed(nproc=2, nnodes=2, node_rank=node, master=master, ranks="all", log_dir=logs)
def speak(fails):
{body}
try:
    speak(len(sys.argv) > 4)
except Exception as error:
    from autoddp.core._warn import one_line  # (its type, [rank R of N] and first line, as the command says)
    found = {{"type": type(error).__name__, "first": one_line(error), "notes": error.__notes__}}
    sys.stdout.write("FAILED " + json.dumps(found) + "\\n")
"""


def speaking(folder: Path) -> tuple[Path, Path]:
    """Write ``SPEAK`` as a torchrun-style script (``speaks.py [fail]``) and as a decorated
    function (``speaks_decorated.py``, see ``SPEAK_DECORATED``) into ``folder``; their paths."""
    plain = folder / "speaks.py"
    plain.write_text(
        'import sys, torch.distributed as dist\ndist.init_process_group("gloo")\n'
        "fails = len(sys.argv) > 1" + SPEAK
    )
    decorated = folder / "speaks_decorated.py"
    decorated.write_text(SPEAK_DECORATED.format(body=textwrap.indent(SPEAK, "    ")))
    return plain, decorated


def scripts(folder: Path) -> dict[str, Path]:
    """Write the test scripts into ``folder``; their paths by name."""
    paths = {}
    for name, text in (("torchrun_style", TORCHRUN_STYLE), ("decorated", DECORATED)):
        path = folder / f"{name}.py"
        path.write_text(textwrap.dedent(text))
        paths[name] = path
    return paths


def results(output: str) -> list[dict]:
    """The ``RESULT {...}`` lines of ``output`` (also behind a ``[rank N]`` prefix), in order."""
    return [json.loads(m[1]) for m in re.finditer(r"^(?:\[rank \d+\] )?RESULT (.*)$", output, re.MULTILINE)]


def child_env(**extra: str) -> dict[str, str]:
    """This environment (launcher variables already removed by conftest) with this venv first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra)
    return env


def run(command: list[str], *, timeout: float = 90, cwd: Path | None = None, **extra: str):
    """Run ``command`` to the end and capture its output; on a timeout its process group is killed."""
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=child_env(**extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"{command} did not end within {timeout} s:\n{out}\n{err}")
        return subprocess.CompletedProcess(command, process.returncode, out, err)


def need_programs(*programs: str, packages: str) -> None:
    """Skip unless every program is on PATH."""
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian: {packages}); {SETUP} installs it")


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (run the tests as root after {SETUP})")


# --- patches seen inside a forked worker ---------------------------------------------------------
# See, inside a forked worker, what autoddp's patches look like after the user's function returned.
#
# A worker's last Python code after the user's function is ``running.portable`` on its result,
# outside capture and the hang marks, on every rank: a result made by ``inspected`` runs its check
# there, at its ``detach()``, and writes what it found to ``FOLDER/rank{R}.json``; the result
# travels on as a plain tensor. The default check: which attributes autoddp ever patched in that
# worker, which a unit replaces now, and which do not hold their original.


def registry_report() -> dict[str, list[str]]:
    """The engine's own account of this process's patches."""
    return {
        "patched": sorted(_patches.label(owner, name) for owner, name, _ in _patches.ever_patched()),
        "active": sorted(_patches.label(owner, name) for owner, name in _patches.active()),
        "unrestored": _patches.unrestored(),
    }


class Inspected(torch.Tensor):
    """A result that runs its check when autoddp readies it to travel."""

    folder = ""  # set in the worker, by ``inspected``
    check: Callable[[], Any] = staticmethod(registry_report)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            with open(os.path.join(cls.folder, f"rank{os.environ['RANK']}.json"), "w") as file:
                json.dump(cls.check(), file)
            return args[0].as_subclass(torch.Tensor).detach()
        return super().__torch_function__(func, types, args, kwargs or {})


def inspected(folder: str, check: Callable[[], Any] = registry_report) -> torch.Tensor:
    """A result whose workers write ``check()`` to ``folder`` after the call (make it in the function)."""
    Inspected.folder, Inspected.check = folder, staticmethod(check)
    return torch.zeros(1).as_subclass(Inspected)


def reports(folder: str, ranks: int = 2) -> list[Any]:
    """What each rank's worker found."""
    found = []
    for rank in range(ranks):
        with open(os.path.join(folder, f"rank{rank}.json")) as file:
            found.append(json.load(file))
    return found


# --- every wrapper takes the calls its original takes ---------------------------------------------


def defining_value(owner: Any, name: str, own: Any) -> Any:
    """What ``owner.name`` was before any patch: its own entry, else the one it inherited."""
    if own is not _patches.MISSING:
        return own
    for cls in owner.__mro__[1:] if isinstance(owner, type) else ():
        if name in vars(cls):
            return vars(cls)[name]
    return _patches.MISSING


def _calls(signature: inspect.Signature, method: bool) -> dict[str, tuple[tuple, dict]]:
    """The ways a caller calls a function of ``signature``, with one distinct value per parameter:
    every parameter by keyword (where it may be), every one by position, the required ones only."""
    shapes: dict[str, tuple[list, dict]] = {
        "by keyword": ([], {}),
        "by position": ([], {}),
        "required": ([], {}),
    }
    for index, parameter in enumerate(signature.parameters.values()):
        value = object()
        kind = parameter.kind
        if kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        positional = kind is parameter.POSITIONAL_ONLY or (method and index == 0)
        for shape, (args, kwargs) in shapes.items():
            if shape == "required" and parameter.default is not parameter.empty:
                continue
            if positional or (shape != "by keyword" and kind is parameter.POSITIONAL_OR_KEYWORD):
                args.append(value)
            else:
                kwargs[parameter.name] = value
    return {shape: (tuple(args), kwargs) for shape, (args, kwargs) in shapes.items()}


def _same(ours: Any, theirs: Any) -> bool:
    """The same value: the caller's own (one object per parameter), or equal defaults (a builtin's
    signature makes its own copy of ``open``'s ``"r"``)."""
    if ours is theirs:
        return True
    return type(ours) is type(theirs) and isinstance(ours, (str, int, float, bool, bytes)) and ours == theirs


def signature_faults(owner: Any, name: str, replacement: Any, original: Any) -> list[str]:
    """Where ``replacement`` (autoddp's wrapper of ``owner.name``) does not take a call exactly as
    ``original`` does: a parameter of its own that a caller's keyword collides with (the wrapper's
    ``module`` against ``DistributedDataParallel(module=...)``), a call it refuses, or a named
    parameter that receives another value than the original's parameter of that name."""
    where = _patches.label(owner, name)
    if not callable(replacement) or isinstance(replacement, property):
        return []  # (an attribute read or set: Parameter.data)
    if inspect.isbuiltin(replacement):
        return []  # (torch's own put back for a while: DTensor's handler during a step)
    method = isinstance(owner, type) and not isinstance(original, staticmethod)
    original = getattr(original, "__func__", original)  # a staticmethod's or classmethod's function
    ours = inspect.signature(replacement, follow_wrapped=False)
    named = [p for p in ours.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    faults = []
    first = next(iter(ours.parameters.values()), None)
    if method and first is not None and first.kind is first.POSITIONAL_OR_KEYWORD:
        faults.append(
            f"{where}: the wrapper's first parameter {first.name!r} (the instance) is not positional-only"
        )
    try:
        theirs = inspect.signature(original)
    except (TypeError, ValueError):  # a builtin without a signature: the wrapper must name nothing
        callers = [p.name for p in named if p.kind is not p.POSITIONAL_ONLY]
        if callers:
            faults.append(f"{where}: the original has no signature, yet the wrapper names {callers}")
        return faults
    for shape, (args, kwargs) in _calls(theirs, method).items():
        expected = theirs.bind(*args, **kwargs)
        expected.apply_defaults()
        try:
            got = ours.bind(*args, **kwargs)
        except TypeError as error:
            faults.append(f"{where}: a call {shape} fails at the wrapper, not at the original: {error}")
            continue
        got.apply_defaults()
        for parameter in named:
            if parameter.kind is parameter.POSITIONAL_ONLY:
                continue
            if parameter.name not in expected.arguments:
                faults.append(f"{where}: the wrapper's {parameter.name!r} is no parameter of the original")
            elif not _same(got.arguments[parameter.name], expected.arguments[parameter.name]):
                faults.append(
                    f"{where}: the wrapper's {parameter.name!r} gets another value than the original's"
                )
    return list(dict.fromkeys(faults))  # (one line per fault, whatever the calls that show it)
