"""Process-group lifecycle: pick the backend, pin the GPU, join the group, leave it cleanly."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
from typing import Any

import torch

from autoddp.core import _compat
from autoddp.core._compat import gloo_lines
from autoddp.core._warn import say
from autoddp.core.backends import Backend
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import CURRENT, RunOptions, World
from autoddp.in_rank.world import stdout


def comm_device(preferred: torch.device) -> torch.device:
    """``preferred`` if the default process group can communicate on it, else a device it can."""
    import torch.distributed as dist

    config = dist.get_backend_config()  # e.g. "cpu:gloo,cuda:gloo" or "cpu:gloo,cuda:nccl"
    if ":" in config:
        types = {pair.split(":")[0].strip() for pair in config.split(",")}
    else:
        types = {"cpu"} if "gloo" in config else {"cuda"}
    if preferred.type in types:
        return preferred
    if "cpu" in types:
        return torch.device("cpu")
    if "cuda" in types and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(CURRENT.world.device if CURRENT.world is not None else "cpu")


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def joined(
    world: World,
    backend: Backend,
    timeout: datetime.timedelta | None = None,
    options: RunOptions | None = None,
    announce: bool = True,
) -> contextlib.AbstractContextManager[World]:
    """Join the default process group for ``world`` (or reuse one the user made) for a ``with`` block.

    The GPU is pinned before anything touches CUDA (in a world of several processes; one process
    keeps CUDA's default device). A group created here is destroyed when the block ends
    normally; first every wrapped model lets go of the group (``Run.release_wrapped``: a DDP
    wrapper is dropped) and garbage is collected, so no DDP outlives the group (freeing one
    afterwards can deadlock gloo). After an error the group is left to the process's exit: the
    other ranks may still be inside a collective with it. On GPUs, ``environment.preflight.check`` runs
    first (``announce``: its notices printed, unless the caller printed them already).
    """
    return _GroupJoined(world, backend, timeout, options, announce)


class _GroupJoined:
    """The context manager of ``joined`` (a plain class: the one-process call path is hot)."""

    def __init__(
        self,
        world: World,
        backend: Backend,
        timeout: datetime.timedelta | None,
        options: RunOptions | None,
        announce: bool = True,
    ) -> None:
        self.world, self.backend, self.timeout, self.options = world, backend, timeout, options
        self.announce = announce
        self.created = False
        self.current: contextlib.AbstractContextManager[World] | None = None

    def __enter__(self) -> World:
        world, backend = self.world, self.backend
        if backend.use_cuda and world.world_size > 1 and not _group_exists():
            from autoddp.core.environment import preflight  # (the CUDA path only)

            # cuda:<local rank>, or the GPU a scheduler bound to this task; an error before NCCL's
            index = preflight.check(world, announce=self.announce)
            device = f"cuda:{index}"
        elif backend.use_cuda:
            index = int(world.device.split(":")[1]) if world.device.startswith("cuda:") else world.local_rank
            device = f"cuda:{index}"
        else:
            device = "cpu"
        if world.world_size > 1:
            if backend.use_cuda:
                torch.cuda.set_device(index)
            self.created = _init_group(world, backend, device, self.timeout)
        active = world if device == world.device else dataclasses.replace(world, device=device)
        self.current = CURRENT.entered(active, self.options, self.timeout)
        return self.current.__enter__()

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        assert self.current is not None
        try:
            if self.world.world_size == 1:
                CURRENT.release_wrapped()  # the caller's own models are plain again after the call
            elif self.created and exc_type is None:
                import torch.distributed as dist

                CURRENT.release_wrapped()
                gc.collect()
                if dist.is_initialized():  # (the function may have ended the group itself)
                    destroy_default_group()
        finally:
            self.current.__exit__(exc_type, *rest)


def _group_exists() -> bool:
    """True when a default process group exists already (the user's own: NCCL has run, or not here)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def leave_open_groups() -> bool:
    """Destroy the process groups a finished script left open; True if there were any.

    A script that never calls ``destroy_process_group`` (PyTorch Lightning's Trainer is one)
    leaves gloo's threads running into the interpreter's exit, where they abort the process
    ("terminate called without an active exception") in about one run in eight. Called after
    the script's last line, once its variables are gone: models autoddp wrapped let go first
    and garbage is collected, so that no DDP outlives its group (freeing one afterwards can
    deadlock gloo).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return False
    CURRENT.release_wrapped()
    gc.collect()
    destroy_default_group()
    return True


def destroy_default_group() -> None:
    """``destroy_process_group()``; before torch 2.8 its gloo backends outlive the group and end after
    it, with the GIL released (``_compat.backends_to_outlive``: else a deadlock with gloo's threads)."""
    import torch.distributed as dist

    outliving = _compat.backends_to_outlive(dist.group.WORLD)
    dist.destroy_process_group()
    outliving.clear()


def _init_group(world: World, backend: Backend, device: str, timeout: datetime.timedelta | None) -> bool:
    """Initialise the default process group for ``world`` unless one exists; True if it was made here."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if not world.master_addr or not world.master_port:
        raise ConfigurationError(
            f"this process is rank {world.rank} of {world.world_size}, but the address of rank 0 is "
            "unknown: set MASTER_ADDR (rank 0's host) and MASTER_PORT (a free port there) "
            "for every process"
        )
    if world.local_world_size < world.world_size:
        _name_interface(world)
    arguments = group_arguments(world, backend, device, timeout)
    gloo_lines.quiet_gloo_connections(stdout.without_lines)  # (the user's own groups too, from here on)
    try:
        dist.init_process_group(store=_fresh_store(world, arguments["timeout"]), **arguments)
    except _compat.store_address_in_use() as error:
        if "EADDRINUSE" not in str(error):
            raise
        raise ConfigurationError(
            f"rank 0 cannot listen on {world.master_addr}:{world.master_port}: the port is in use, by "
            "another job or another step of this job. Set MASTER_PORT to a free port, the same for "
            "every process"
        ) from None
    return True


def group_arguments(
    world: World, backend: Backend, device: str, timeout: datetime.timedelta | None
) -> dict[str, Any]:
    """What ``init_process_group`` receives besides the store: a pure function of the facts."""
    arguments: dict[str, Any] = {
        "backend": backend.name,
        "rank": world.rank,
        "world_size": world.world_size,
        "timeout": group_timeout(backend, timeout),
    }
    if backend.use_cuda:
        arguments["device_id"] = torch.device(device)
    return arguments


#: NCCL's default timeout, as torch documents it (its constant exists on CUDA builds only).
NCCL_TIMEOUT = datetime.timedelta(minutes=10)


def group_timeout(backend: Backend, timeout: datetime.timedelta | None) -> datetime.timedelta:
    """The user's timeout, else NCCL's 10 minutes on GPUs and torch's default (30) for gloo.

    torch picks NCCL's default only for the backend string "nccl": for "cpu:gloo,cuda:nccl" it
    would give 30 minutes, three times what a GPU run of torchrun style waits.
    """
    from torch.distributed import constants

    if timeout is not None:
        return timeout
    if backend.use_cuda or backend.name == "nccl":
        return constants.default_pg_nccl_timeout or NCCL_TIMEOUT
    return constants.default_pg_timeout


def _fresh_store(world: World, timeout: datetime.timedelta) -> Any:
    """The rendezvous store of the next group this process makes, under a key prefix of its own.

    The store outlives a group: a second group on the same keys would read the first one's
    addresses (gloo: "connectFullMesh failed ... Connection refused"; NCCL: the first one's
    unique id). Every init is collective, so the n-th group made here is the n-th on every rank:
    the count names the prefix without a message between ranks. A restart of the workers
    (``TORCHELASTIC_RESTART_COUNT``) is told apart too, where the launcher keeps its store across
    restarts. Where no launcher hosts the store (srun, mpirun, an operator: rank 0 serves it
    itself), this process keeps its store for the next group of the same world: made anew, rank
    0's server would go with the first group while a faster rank already knocks on it for the
    second ("Failed to recv ... Connection was likely closed").
    """
    import torch.distributed as dist

    url = f"tcp://{_host_for_url(str(world.master_addr))}:{world.master_port}"
    key = (url, world.rank, world.world_size)
    if CURRENT.store is None or CURRENT.store[0] != key:
        store, _, _ = next(dist.rendezvous(url, world.rank, world.world_size, timeout=timeout))
        CURRENT.store = (key, store)
    store = CURRENT.store[1]
    store.set_timeout(timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    CURRENT.groups_made += 1
    return dist.PrefixStore(f"autoddp/{restart}/{CURRENT.groups_made}", store)


def _name_interface(world: World) -> None:
    """In a world that spans machines, have gloo and NCCL use the interface that reaches rank 0.

    Here the launcher started this very process, so the variables go into its own environment
    (where gloo and NCCL read them), unless the user set either; local rank 0 says which.
    """
    assert world.master_addr is not None
    from autoddp.core.environment import network  # (multi-machine worlds only)

    choice = network.choose(world.master_addr, os.environ)
    if choice.variables:
        os.environ.update(choice.variables)
        if world.local_rank == 0:
            say(f"node {world.node_rank}: {choice.summary}")


def own_group_arguments(
    world: World, arguments: dict[str, Any], timeout: datetime.timedelta | None = None
) -> dict[str, Any]:
    """What a script's own ``init_process_group`` call (``arguments``, by name) is made with here.

    A call that passes no ``timeout=`` gets the run's (``--timeout``, when given): a collective
    the network cuts ends the run within the bound the user gave, not torch's 30 minutes.

    A rank or world size that is not this process's (a script written for one process:
    ``rank=0, world_size=1``, in the call or a ``tcp://`` init_method's query) is refused: every
    process would claim its own world. A ``tcp://`` address other than the launcher's store gets
    a store that rank 0 hosts there, as the script's own processes would have it: torchrun's
    variables (``TORCHELASTIC_USE_AGENT_STORE``) make torch connect every rank to it as a client,
    and nobody serves it (a silent rendezvous of 30 minutes, under torchrun too).
    """
    from urllib.parse import parse_qs, urlparse

    import torch.distributed as dist

    given = {name: arguments.get(name, -1) for name in ("rank", "world_size")}
    method = arguments.get("init_method")
    url = urlparse(method) if isinstance(method, str) else None
    for name, values in parse_qs(url.query if url else "").items():
        if name in given and given[name] in (-1, None):
            given[name] = values[-1]
    wanted = {"rank": world.rank, "world_size": world.world_size}
    if any(
        value not in (-1, None) and str(value).strip() != str(wanted[name]) for name, value in given.items()
    ):
        said = ", ".join(f"{name}={value}" for name, value in given.items() if value not in (-1, None))
        raise ConfigurationError(
            f"this script makes its own process group with {said}, but autoddp runs it in "
            f"{world.world_size} processes and this one is rank {world.rank} of {world.world_size}: "
            "every process would claim a world of its own. Let it join autoddp's world: call "
            "init_process_group without rank= and world_size= (init_method 'env://', the default), "
            "or pass rank=int(os.environ['RANK']), world_size=int(os.environ['WORLD_SIZE']); or run "
            "it in one process (autoddp -n 1, or python)"
        )
    if arguments.get("timeout") is None and timeout is not None:
        arguments = {**arguments, "timeout": timeout}
    if url is None or url.scheme != "tcp" or url.port is None or arguments.get("store") is not None:
        return arguments  # (torch's own error for an address without a port)
    if url.port == world.master_port:
        return arguments  # the launcher's own store (torchrun's MASTER_ADDR:MASTER_PORT)
    timeout = arguments.get("timeout") or dist.constants.default_pg_timeout
    store = dist.TCPStore(str(url.hostname), url.port, world.world_size, world.rank == 0, timeout=timeout)
    rest = {name: value for name, value in arguments.items() if name != "init_method"}
    return {**rest, "store": store, "rank": world.rank, "world_size": world.world_size}
