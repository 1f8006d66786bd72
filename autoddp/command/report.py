"""``autoddp env``: one readable block about this machine and launch environment, for bug reports.

It says what autoddp would do here and why: versions, GPUs, the detected launcher and the
variables behind that decision, the world it implies, the backend, the start method and where
rank 0's port comes from. It reports problems instead of raising them.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import sys
import textwrap
from collections.abc import Callable, Mapping

import torch

from autoddp.core import _compat, backends, environment
from autoddp.core.environment import hardware, network
from autoddp.core.memory import budget
from autoddp.core.memory.sizes import format_bytes
from autoddp.core.state import World

_WIDTH = 100
_LABEL = 15

#: Variables worth seeing in a bug report when set (launcher variables are shown under "why").
_SETTINGS = (
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_DEBUG",
    "TORCH_DISTRIBUTED_DEBUG",
)


def describe(
    environ: Mapping[str, str] | None = None,
    *,
    name_gpus: bool = True,
    master: str | None = None,
    nproc: int | None = None,
) -> str:
    """The report for ``environ`` (default: this process's environment), ready to paste.

    ``master`` (``HOST:PORT`` of node 0, as ``--master`` takes it) adds which network interface
    a multi-node run would use from here. Versions and GPUs are this process's own. Naming the
    GPUs initialises CUDA here (a later ``@distributed`` call then starts workers as fresh
    interpreters, not by fork), so it is done last and only when a GPU is visible;
    ``name_gpus=False`` counts them only. ``nproc``: the processes the command was asked for
    (``autoddp -n N env``; default: what ``autoddp script.py`` would start here).
    """
    environ = os.environ if environ is None else environ
    try:
        gpus = hardware.gpu_count()
    except Exception:
        gpus = 0
    # Before anything that may initialise CUDA: the start method depends on it.
    backend = _safe(lambda: _backend(gpus))
    start = _safe(lambda: _start_method(gpus))
    launch = _launch_section(environ, gpus, backend, start, master)
    command = _safe(lambda: "\n".join(_command_section(environ, gpus, nproc)))
    versions = [
        ("python", _safe(_python)),
        ("platform", _safe(platform.platform)),
        ("torch", _safe(lambda: f"{torch.__version__} ({_compat.releases.support_verdict()})")),
        ("CUDA", _safe(_cuda_version)),
        ("NCCL", _safe(_nccl_version)),
        ("distributed", _safe(_distributed_backends)),
        ("GPUs", _safe(lambda: _gpus(gpus, name_gpus))),
        ("CPUs", _safe(lambda: f"{hardware.cpu_count()} usable by this process")),
    ]
    settings = ", ".join(f"{name}={environ[name]!r}" for name in _SETTINGS if name in environ)
    return "\n".join(
        [
            f"autoddp {_safe(_autoddp_version)} environment report",
            *_rows(versions, indent=2),
            *launch,
            command,
            *_rows([("settings", settings or "none of " + ", ".join(_SETTINGS) + " is set")], indent=0),
        ]
    )


def _launch_section(
    environ: Mapping[str, str], gpus: int, backend: str, start: str, master: str | None
) -> list[str]:
    try:
        env = environment.detect(environ)
    except Exception as error:  # a half-set environment: show it, do not raise
        return _rows(
            [
                ("environment", f"broken: {error}"),
                ("backend", backend),
                ("start method", start),
                ("network", _safe(lambda: _network(environ, None, master))),
            ],
            indent=0,
        )
    what = "launched: @distributed runs in place" if env.launched else "@distributed starts its own workers"
    rows = [("environment", f"{env.name}; {what}"), ("  why", _safe(env.explain))]
    world: World | None = None
    try:
        world = env.world()
    except Exception as error:
        rows.append(("  world", f"broken: {error}"))
    else:
        rows.append(
            (
                "  world",
                f"rank {world.rank} of {world.world_size}, local rank {world.local_rank} of "
                f"{world.local_world_size}, node {world.node_rank}, device {world.device}",
            )
        )
        if env.launched:
            address = (
                f"{world.master_addr}:{world.master_port}"
                if world.master_addr and world.master_port
                else f"unknown (MASTER_ADDR={world.master_addr}, MASTER_PORT={world.master_port}): "
                "set both for every process"
            )
            rows.append(("  rank 0 at", address))
        rows.append(("  processes", _processes(env.launched, world.world_size, gpus)))
    rows.append(("  backend", backend))
    if env.launched:
        start = f"{start}; not used here: the launcher started the processes"
    rows.append(("  start method", start))
    rows.append(("  port policy", _safe(env.port_policy)))
    rows.append(("  network", _safe(lambda: _network(environ, world if env.launched else None, master))))
    return _rows(rows, indent=0)


def _command_section(environ: Mapping[str, str], gpus: int, nproc: int | None) -> list[str]:
    """What ``autoddp script.py`` would do here: processes, threads, backend, start, network."""
    from autoddp.launch import start_method as launch

    env = environment.detect(environ)
    if env.launched:
        return _rows(
            [
                ("command", f"autoddp script.py here: runs the script in place in this {env.name} process"),
                ("  processes", "the launcher's; no second layer of workers, torchrun's variables given"),
            ],
            indent=0,
        )
    count = nproc or gpus or 1
    why = "asked for" if nproc else ("one per visible GPU" if gpus else "no GPU found: -n N for N on the CPU")
    threads = hardware.omp_threads(count, environ)
    threads = (
        f"{threads} per process ({hardware.cpu_count()} cores / {count}; OMP_NUM_THREADS to change)"
        if threads is not None
        else f"{environ['OMP_NUM_THREADS']} per process (OMP_NUM_THREADS, yours)"
    )
    backend = backends.resolve_backend(None, gpus)
    method, reason = launch.choose_start_method("auto", None)
    group = "NCCL for CUDA tensors, gloo for CPU ones" if backend.use_cuda else "gloo"
    rows = [
        ("command", f"autoddp script.py here: {count} process{'es' if count > 1 else ''} ({why})"),
        ("  threads", threads),
        ("  backend", f"{group}, in the group capture makes for a plain script (one per process)"),
        ("  start method", f"{method} ({reason})"),
        ("  network", "one machine: the store on 127.0.0.1 (--master-addr/--master-port to choose)"),
        ("  strategy", _strategy(gpus, count)),
    ]
    return _rows(rows, indent=0)


def _network(environ: Mapping[str, str], world: World | None, master: str | None) -> str:
    """Which interface gloo and NCCL would use to reach the other machines, and why."""
    if master:
        host = master.rpartition(":")[0] or master
        return f"to node 0 at {master}: {network.choose(host, environ).summary}"
    if world is not None and world.master_addr and world.local_world_size < world.world_size:
        return f"to rank 0 at {world.master_addr}: {network.choose(world.master_addr, environ).summary}"
    own = network.user_setting(environ)
    if own:
        return f"{own} set by you: autoddp leaves the network interface to it"
    text = (
        "one machine: loopback. Across machines autoddp names the interface that routes to node 0 "
        "(autoddp env --master HOST:PORT shows it)"
    )
    name = socket.gethostname()
    with contextlib.suppress(OSError):
        address = socket.gethostbyname(name)
        if address.startswith("127."):
            text += f"; this host name ({name}) resolves to {address}, which gloo alone would use"
    return text


def _strategy(gpus: int, count: int) -> str:
    """What strategy="auto" weighs a model's state against here (``core.memory.budget``)."""
    if count == 1:
        return "auto: one process, nothing to shard (DDP's path)"
    if gpus:
        share = f"{budget.GPU_MARGIN:.0%}"
        limit = f"the GPU's free memory less {share} of its size, read by each process when it first decides"
    else:
        available = budget.available_memory()
        known = (
            f"{format_bytes(budget.cpu_default(available, count))} per process" if available else "unknown"
        )
        limit = f"{known} (the available memory over {count} process{'es' if count > 1 else ''})"
    return f"auto: DDP where a model's state fits {limit}, else FSDP2 (a run's --device-memory sets it)"


def _processes(launched: bool, world_size: int, gpus: int) -> str:
    if launched:
        return f"{world_size}, started by the launcher; each runs the decorated function in place"
    if gpus > 1:
        return f"@distributed starts {gpus} workers, one per GPU (nproc= to change)"
    return "1: the decorated function runs in this process (nproc=N starts N workers)"


def _rows(rows: list[tuple[str, str]], indent: int) -> list[str]:
    out = []
    for label, value in rows:
        head = " " * indent + label
        first = head.ljust(_LABEL) if len(head) < _LABEL else head + " "
        wrapped = textwrap.wrap(
            str(value),
            width=_WIDTH,
            initial_indent=first,
            subsequent_indent=" " * _LABEL,
            break_long_words=False,
            break_on_hyphens=False,
        )
        out += wrapped or [first.rstrip()]
    return out


def _safe(fn: Callable[[], object]) -> str:
    """``str(fn())``, or a one-line description of its failure: the report must never raise."""
    try:
        return str(fn())
    except Exception as error:
        return f"unavailable ({type(error).__name__}: {error})"


def _autoddp_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autoddp")
    except PackageNotFoundError:
        return sys.modules["autoddp"].__version__  # (loaded before any of its modules)


def _python() -> str:
    return f"{platform.python_version()} ({platform.python_implementation()}) {sys.executable}"


def _cuda_version() -> str:
    if torch.version.cuda:
        return torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    return f"not built (ROCm/HIP {hip})" if hip else "not built"


def _nccl_version() -> str:
    import torch.distributed as dist

    if not torch.backends.cuda.is_built() or not dist.is_available() or not dist.is_nccl_available():
        return "not built"
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _distributed_backends() -> str:
    import torch.distributed as dist

    if not dist.is_available():
        return "not built into this torch"
    available = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    return "backends: " + ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in available.items())


def _gpus(count: int, name_gpus: bool) -> str:
    if count == 0:
        return "none (CUDA not built into this torch)" if not torch.backends.cuda.is_built() else "none"
    if not name_gpus:
        return f"{count} (names not read: that would initialise CUDA)"
    names = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        names.append(f"cuda:{index} {props.name} ({props.total_memory / 2**30:.0f} GiB)")
    return f"{count}: " + ", ".join(names)


def _backend(gpus: int) -> str:

    backend = backends.resolve_backend(None, gpus)
    why = "CUDA tensors on NCCL, CPU tensors on gloo" if backend.use_cuda else "no GPU: CPU processes"
    return f"{backend.label} ({why}; backend= to change)"


def _start_method(gpus: int) -> str:
    from autoddp.launch import start_method as launch

    method, reason = launch.choose_start_method("auto", backends.resolve_backend(None, gpus))
    return f"{method} ({reason})"
