"""Shared by the tests that run real launchers and networks (tests/test_clusters_*.py).

``tests/clusters/setup.sh start`` (as root) installs Debian's SLURM, munge, Open MPI and MPICH,
starts a one-node SLURM cluster and makes two network namespaces joined by a veth pair; ``.ci/run``
runs it. Each test here skips, saying what is missing and how to get it, where that was not done.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
