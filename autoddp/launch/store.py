"""The rendezvous store of a single-node run: hosted by the launching process, on loopback only."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from autoddp.environment import LOOPBACK
from autoddp.errors import ConfigurationError


@contextlib.contextmanager
def loopback_store(nproc: int) -> Iterator[int]:
    """The rendezvous store of a single-node run, hosted here and reachable from this machine only.

    The listening socket is bound to loopback before torch's TCPStore takes it over (a TCPStore
    binding by itself listens on every interface). The port is the one in ``MASTER_PORT`` if the
    user set it, else one the operating system picks, so simultaneous jobs never race for a port.
    Only the port leaves this function: the store must not outlive the run in some reference
    cycle, where a later forked worker's garbage collection would try to stop its server thread.
    """
    import socket

    from torch.distributed import TCPStore

    requested = os.environ.get("MASTER_PORT", "0")
    if not requested.isdigit() or int(requested) > 65535:
        raise ConfigurationError(f"MASTER_PORT={requested!r} is not a port number; fix or unset it")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, int(requested)))
    except OSError as exc:
        listener.close()
        raise ConfigurationError(
            f"MASTER_PORT={requested} cannot be used ({exc.strerror}); another program holds it. "
            "Unset MASTER_PORT to let autoddp pick a free port, or choose another."
        ) from None
    listener.listen(max(128, nproc))
    try:
        store = TCPStore(
            LOOPBACK,
            listener.getsockname()[1],
            nproc,
            is_master=True,
            wait_for_workers=False,
            # shared with any other store this process opens on the port (elastic's rendezvous)
            multi_tenant=True,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now and closes it when it goes
    try:
        yield store.port
    finally:
        del store
