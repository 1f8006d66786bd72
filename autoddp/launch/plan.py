"""The multi-node options, checked: how many machines take part and how they meet (a ``Nodes``)."""

from __future__ import annotations

import dataclasses

from autoddp.core.environment import LOOPBACK
from autoddp.core.errors import ConfigurationError

RDZV_BACKENDS = ("static", "c10d")
DEFAULT_JOIN_TIMEOUT = 300.0  # seconds (elastic: 600 for the rendezvous, and 900 for its agent)


@dataclasses.dataclass(frozen=True)
class Nodes:
    """How many machines take part and how they meet."""

    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int | None = None
    endpoint: str | None = None  # host:port of the rendezvous (node 0's store for static)
    backend: str = "static"
    run_id: str = "none"  # torchrun's --rdzv-id default: the workers' TORCHELASTIC_RUN_ID
    conf: tuple[tuple[str, str], ...] = ()  # --rdzv-conf KEY=VALUE,... for the rendezvous
    local_addr: str | None = None  # the address the other machines reach this one by
    join_timeout: float = DEFAULT_JOIN_TIMEOUT  # seconds the nodes wait for each other to join

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
    rdzv_conf: str | None = None,
    local_addr: str | None = None,
    join_timeout: float | None = None,
) -> Nodes:
    """Check the multi-node options and turn them into a ``Nodes`` plan (one node if unset)."""
    min_nodes, max_nodes = _node_counts(nnodes)
    _join_timeout(join_timeout, None)
    if max_nodes == 1:
        if node_rank not in (None, 0):
            raise ConfigurationError(
                f"node_rank={node_rank} needs nnodes > 1; set nnodes to the number of machines"
            )
        for flag, value in (("--rdzv-conf", rdzv_conf), ("--local-addr", local_addr)):
            if value:
                raise ConfigurationError(
                    f"{flag} is for a run on several machines (--nnodes N); one machine has no rendezvous "
                    "to configure: drop it"
                )
        if master:  # one machine: where its store listens (as torchrun's --master-addr)
            one_node_store(master, None, None)
        return Nodes()
    backend = rdzv_backend or ("c10d" if rdzv_endpoint and not master else "static")
    if backend not in RDZV_BACKENDS:
        raise ConfigurationError(f"unknown rdzv_backend={backend!r}: use 'static' or 'c10d'")
    endpoint, option = (rdzv_endpoint, "rdzv_endpoint") if rdzv_endpoint else (master, "master")
    if not endpoint:
        raise ConfigurationError(
            f"nnodes={nnodes} needs the address of node 0: --master HOST:PORT (or --rdzv-endpoint HOST:PORT)"
        )
    split_endpoint(endpoint, option)
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
    conf = _conf(rdzv_conf)
    waited = _join_timeout(join_timeout, dict(conf).get("join_timeout"))
    conf = tuple((key, value) for key, value in conf if key != "join_timeout")
    return Nodes(
        min_nodes, max_nodes, node_rank, endpoint, backend, rdzv_id or "none", conf, local_addr, waited
    )


#: The longest join timeout taken (an infinite or huge one overflows the store's clock).
_LONGEST_JOIN = 365 * 24 * 3600.0


def _join_timeout(given: float | None, in_conf: str | None) -> float:
    """``join_timeout=`` (``--join-timeout``), or ``--rdzv-conf join_timeout=``: the same setting."""
    if in_conf is not None:
        try:
            conf = float(in_conf)
        except ValueError:
            raise ConfigurationError(
                f"--rdzv-conf join_timeout={in_conf!r} is not a number of seconds"
            ) from None
        if given is not None and given != conf:
            raise ConfigurationError(
                f"join_timeout={given:g} and --rdzv-conf join_timeout={in_conf} disagree: give the join "
                "timeout once (join_timeout= in @distributed, --join-timeout for the command)"
            )
        given = conf
    if given is None:
        return DEFAULT_JOIN_TIMEOUT
    if isinstance(given, bool) or not isinstance(given, (int, float)) or not 0 < given <= _LONGEST_JOIN:
        raise ConfigurationError(
            f"join_timeout={given!r} must be a number of seconds > 0 (at most {_LONGEST_JOIN:.0f}, a year): "
            "how long the machines of a run "
            f"wait for each other to join (e.g. join_timeout=600)  [default: {DEFAULT_JOIN_TIMEOUT:g}]"
        )
    return float(given)


def one_node_store(
    master: str | None, master_addr: str | None, master_port: int | None, option: str = "master"
) -> tuple[str, int | None]:
    """Where a one-machine run's store listens: ``--master`` (or ``--rdzv-endpoint``),
    ``--master-addr``/``--master-port`` honoured (a user opens that port in a firewall), else
    loopback on a free port (None)."""
    if master and master.rpartition(":")[2] == "0":  # torchrun's --rdzv-endpoint localhost:0: a free port
        return master.rpartition(":")[0].strip("[]") or LOOPBACK, None
    if master:
        return split_endpoint(master, option)
    return master_addr or LOOPBACK, master_port


def _conf(text: str | None) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE,KEY=VALUE`` as torchrun's ``--rdzv-conf`` takes it."""
    pairs = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(
                f"--rdzv-conf {text!r}: {item!r} is not KEY=VALUE (e.g. join_timeout=600,read_timeout=60)"
            )
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


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


def split_endpoint(endpoint: str, option: str = "master") -> tuple[str, int]:
    """(host, port) of ``HOST:PORT``; ConfigurationError naming ``option``, with an example, otherwise."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigurationError(f"{option}={endpoint!r} is not HOST:PORT (for example node0.cluster:29500)")
    return host.strip("[]"), int(port)
