"""The rendezvous store of a single-node run: hosted by the launching process, on loopback only."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from autoddp.core import _compat
from autoddp.core.environment import LOOPBACK
from autoddp.core.errors import ConfigurationError


@contextlib.contextmanager
def loopback_store(nproc: int, host: str = LOOPBACK, port: int | None = None) -> Iterator[int]:
    """The rendezvous store of a single-node run, hosted here and reachable from this machine only.

    The listening socket is bound to ``host`` (loopback unless ``--master-addr`` named another
    address of this machine) before torch's TCPStore takes it over (a TCPStore binding by itself
    listens on every interface). The port is ``port`` (``--master-port``), else the one in
    ``MASTER_PORT`` if the user set it, else one the operating system picks, so simultaneous jobs
    never race for a port.
    Only the port leaves this function: the store must not outlive the run in some reference
    cycle, where a later forked worker's garbage collection would try to stop its server thread.
    """
    import socket

    from torch.distributed import TCPStore

    requested = str(port) if port is not None else os.environ.get("MASTER_PORT", "0")
    named, fix = (
        (f"--master-port {port}", "choose another, or leave --master-port out")
        if port is not None
        else (f"MASTER_PORT={requested}", "choose another, or unset MASTER_PORT")
    )
    if not requested.isdigit() or int(requested) > 65535:
        raise ConfigurationError(f"MASTER_PORT={requested!r} is not a port number; fix or unset it")
    try:
        family, _, _, _, address = socket.getaddrinfo(host, int(requested), type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigurationError(
            f"{host!r} (--master-addr, --rdzv-endpoint) is not a known host name or address ({exc}); on "
            "one machine leave it out (autoddp listens on 127.0.0.1) or give an address of this machine"
        ) from None
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart's port in TIME_WAIT
    try:
        listener.bind(address)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigurationError(
                f"{named}: port {requested} on {host} cannot be used, another run or program holds it; "
                f"{fix} to let autoddp pick a free port"
            ) from None
        raise ConfigurationError(
            f"cannot listen on {host}{'' if requested == '0' else ' port ' + requested} ({exc.strerror}): "
            "--master-addr (or --rdzv-endpoint) on one machine must be an address of this machine (or "
            "leave it out: autoddp listens on 127.0.0.1)"
        ) from None
    listener.listen(max(128, nproc))
    try:
        store = TCPStore(
            host,
            listener.getsockname()[1],
            nproc,
            is_master=True,
            wait_for_workers=False,
            # shared with any other store this process opens on the port (elastic's rendezvous)
            multi_tenant=True,
            master_listen_fd=listener.fileno(),
            **_compat.store_listening_on_socket(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now and closes it when it goes
    try:
        yield store.port
    finally:
        del store
