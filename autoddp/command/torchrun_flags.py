"""Every flag of ``torchrun --help`` (torch 2.13, and 2.15's new ``--log-line-prefix-template`` and
``--print-completion``) and what the ``autoddp`` command does with it.

A torchrun command pasted after ``autoddp`` either works as it did under torchrun or stops with one
line that names the flag as torchrun's and says what autoddp does instead: never a silent no-op,
never a "did you mean" pointing elsewhere. ``tests/launch/test_cli.py`` checks this table against
torchrun's own parser and against the table in docs/command.md.
"""

from __future__ import annotations

from collections.abc import Mapping

#: torchrun's flags the command takes, with what they do here (docs/command.md's table says the same).
TAKEN = {
    "--nnodes": "machines taking part, N or MIN:MAX",
    "--nproc-per-node": "processes on this machine: a number, gpu, cpu or auto",
    "--rdzv-backend": "static or c10d (etcd is refused with a line)",
    "--rdzv-endpoint": "node 0's HOST:PORT for the c10d rendezvous",
    "--rdzv-id": "the job id all nodes share",
    "--rdzv-conf": "KEY=VALUE,... for the rendezvous of several machines (one machine has none: refused)",
    "--standalone": "accepted: one machine is always standalone",
    "--max-restarts": "restart all workers this many times after a failure",
    "--monitor-interval": "seconds between health checks of the workers",
    "--start-method": "fork or spawn on one machine (forkserver refused); several machines: spawn",
    "--role": "the workers' ROLE_NAME",
    "--module": "run the script as a module (-m)",
    "--run-path": "accepted: autoddp always runs the script with runpy.run_path in the worker",
    "--log-dir": "every rank's stdout and stderr kept in files under it (no job sub-folder)",
    "--local-ranks-filter": "whose output reaches the console (also --ranks; all prefixes lines)",
    "--node-rank": "this machine's rank for the static rendezvous",
    "--master-addr": "node 0's address; on one machine the store listens there (an address of it)",
    "--master-port": "node 0's port; on one machine the store's port (workers' MASTER_PORT)",
    "--local-addr": "the address other machines reach this one by (several machines; one: refused)",
    "--print-completion": "torch >= 2.15: the command's completion script for bash, zsh or fish, then exit",
}

#: Short spellings torchrun has beside the long ones above.
SHORT = {"-m": "--module", "-r": "--redirects", "-t": "--tee"}

_FILTER = "autoddp keeps every rank's output in files under --log-dir; filter those instead"

#: torchrun's flags the command refuses: what autoddp does instead (the error's second half).
REFUSED = {
    "--event-log-handler": "autoddp emits no elastic events; drop it",
    "--no-python": "autoddp runs Python scripts and modules only; run a binary with torchrun",
    "--redirects": "autoddp keeps every rank's output in files under --log-dir and shows the ranks "
    "--ranks names; drop it",
    "--tee": "autoddp keeps every rank's output in files under --log-dir and also shows the ranks "
    "--ranks names (--ranks all: every rank); drop it",
    "--duplicate-stdout-filters": _FILTER,
    "--duplicate-stderr-filters": _FILTER,
    "--logs-specs": "autoddp routes output itself (--ranks, --log-dir); drop it",
    "--numa-binding": "autoddp binds no worker to CPUs; drop it, or bind with numactl inside the job",
    "--signals-to-handle": "autoddp stops every worker on SIGTERM, SIGINT, SIGHUP and SIGQUIT; drop it",
    "--shutdown-timeout": "autoddp gives workers 5 seconds after SIGTERM before SIGKILL; drop it",
    "--log-line-prefix-template": "torchrun prefixes the lines of --tee with it, and autoddp takes no "
    "--tee: --ranks all shows every rank, each line prefixed [rank N]; drop it",
    "--virtual-local-rank": "autoddp pins each process to its own GPU itself (LOCAL_RANK stays the GPU "
    "index); drop it",
}

#: Values of taken flags that autoddp does not take: (flag, value) -> what to use instead.
REFUSED_VALUES = {
    ("--rdzv-backend", "etcd"): "use c10d (torchrun's recommended rendezvous)",
    ("--rdzv-backend", "etcd-v2"): "use c10d (torchrun's recommended rendezvous)",
    ("--start-method", "forkserver"): "use fork or spawn",
    ("--nproc-per-node", "xpu"): "autoddp runs on CUDA GPUs or CPUs",
}


def canonical(argument: str) -> str:
    """The long, dashed name of a flag as written (``--tee=3``, ``-t3``, ``--no_python``)."""
    name = argument.split("=", 1)[0]
    if name.startswith("-") and not name.startswith("--") and len(name) > 2:
        name = name[:2]  # -t3, -r0:1
    name = SHORT.get(name, name)
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def environment_name(spellings: tuple[str, ...]) -> str | None:
    """``PET_<FLAG>``, where torchrun reads a flag's value when the command line does not give it
    (Kubeflow's PyTorchJob sets ``PET_NPROC_PER_NODE``, ``PET_NNODES``...); None for autoddp's own."""
    for spelling in spellings:
        name = canonical(spelling.split("/")[0])
        if name in TAKEN:
            return "PET_" + name[2:].replace("-", "_").upper()
    return None


def refused_in(environ: Mapping[str, str]) -> str | None:
    """The line for a ``PET_`` variable naming a flag autoddp refuses, if one is set."""
    for flag in REFUSED:
        variable = "PET_" + flag[2:].replace("-", "_").upper()
        if environ.get(variable):
            instead = REFUSED[flag].replace("drop it", "unset it")
            instead += "" if "unset it" in instead else "; unset it"
            return f"{variable} is torchrun's {flag}, which autoddp does not take: {instead}"
    return None


def refusal(argument: str) -> str | None:
    """The one line for a torchrun flag autoddp refuses (``--tee``, ``--tee=3``, ``-t3``), or None."""
    name = canonical(argument)
    if name not in REFUSED:
        return None
    return f"{name} is a torchrun flag that autoddp does not take: {REFUSED[name]}"
