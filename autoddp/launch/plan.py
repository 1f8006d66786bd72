"""The multi-node options, checked: how many machines take part and how they meet (a ``Nodes``)."""

from __future__ import annotations

import dataclasses

from autoddp.errors import ConfigurationError

RDZV_BACKENDS = ("static", "c10d")


@dataclasses.dataclass(frozen=True)
class Nodes:
    """How many machines take part and how they meet."""

    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int | None = None
    endpoint: str | None = None  # host:port of the rendezvous (node 0's store for static)
    backend: str = "static"
    run_id: str = "autoddp"

    @property
    def multi(self) -> bool:
        return self.max_nodes > 1


def plan(
    nnodes: str | int | None = None,
    node_rank: int | None = None,
    master: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str | None = None,
    rdzv_id: str | None = None,
) -> Nodes:
    """Check the multi-node options and turn them into a ``Nodes`` plan (one node if unset)."""
    min_nodes, max_nodes = _node_counts(nnodes)
    if max_nodes == 1:
        if node_rank not in (None, 0):
            raise ConfigurationError(
                f"node_rank={node_rank} needs nnodes > 1; set nnodes to the number of machines"
            )
        return Nodes()
    backend = rdzv_backend or ("c10d" if rdzv_endpoint and not master else "static")
    if backend not in RDZV_BACKENDS:
        raise ConfigurationError(f"unknown rendezvous backend {backend!r}: use 'static' or 'c10d'")
    endpoint = rdzv_endpoint or master
    if not endpoint:
        raise ConfigurationError(
            f"nnodes={nnodes} needs the address of node 0: --master HOST:PORT (or --rdzv-endpoint HOST:PORT)"
        )
    split_endpoint(endpoint)
    if backend == "static":
        if min_nodes != max_nodes:
            raise ConfigurationError(
                "an elastic node range (MIN:MAX) needs the c10d rendezvous: --rdzv-backend c10d"
            )
        if node_rank is None or not 0 <= node_rank < max_nodes:
            raise ConfigurationError(
                f"give every machine its own node rank from 0 to {max_nodes - 1} with --node-rank "
                "(node 0 hosts the rendezvous at the --master address)"
            )
    return Nodes(min_nodes, max_nodes, node_rank, endpoint, backend, rdzv_id or "autoddp")


def _node_counts(nnodes: str | int | None) -> tuple[int, int]:
    if nnodes is None:
        return 1, 1
    text = str(nnodes)
    low, _, high = text.partition(":")
    try:
        counts = int(low), int(high or low)
    except ValueError:
        raise ConfigurationError(f"nnodes={nnodes!r} is not a number of machines (N, or MIN:MAX)") from None
    if not 1 <= counts[0] <= counts[1]:
        raise ConfigurationError(f"nnodes={nnodes!r} needs 1 <= MIN <= MAX")
    return counts


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT``; ConfigurationError with an example otherwise."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigurationError(f"{endpoint!r} is not HOST:PORT (for example node0.cluster:29500)")
    return host.strip("[]"), int(port)
