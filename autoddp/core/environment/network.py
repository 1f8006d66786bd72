"""Which network interface reaches node 0: the one the kernel routes the master address through.

gloo (and NCCL's bootstrap) pick this machine's address from its host name unless
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name an interface. Where the host name resolves
to 127.0.0.1 (containers, many cluster nodes), a run over several machines then fails with
``Gloo connectFullMesh failed ... remote=[127.0.0.1]``, under torchrun too. autoddp asks the
kernel instead, with the standard library only:

1. resolve the master address (``getaddrinfo``);
2. ``connect()`` a UDP socket to it (no packet is sent) and read the local address the kernel
   chose to reach it (``getsockname``): that honours every routing table and rule;
3. find the interface holding that address: ``socket.if_nameindex()`` with the ``SIOCGIFADDR``
   ioctl for IPv4 (falling back to the longest matching prefix of ``/proc/net/route`` for an
   address the ioctl does not show, such as a secondary one), ``/proc/net/if_inet6`` for IPv6.

A master given by a host name that resolves to loopback *here* (Debian's ``127.0.1.1 node0``
line on node 0 itself) cannot be how the other machines reach this one: the interface of the
default route is used then (else the only interface with a non-loopback address), and the
reason is said. Nothing here writes the environment: the
launchers put ``Choice.variables`` into their workers' environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import socket
import struct
import sys
from collections.abc import Mapping

from autoddp.core.errors import ConfigurationError

#: The variables that name the interface gloo and NCCL use; set by the user, autoddp leaves both alone.
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

_SIOCGIFADDR = 0x8915
#: Any global address will do to ask for the default route (nothing is sent): TEST-NET-3.
_ANYWHERE = {socket.AF_INET: "203.0.113.1", socket.AF_INET6: "2001:db8::1"}


@dataclasses.dataclass(frozen=True)
class Route:
    """How this machine reaches ``host``: through ``interface``, from ``local_address``."""

    host: str
    address: str
    interface: str | None
    local_address: str
    note: str = ""  # why this interface, when it is not simply the route to ``address``

    @property
    def owns_address(self) -> bool:
        """True when ``host`` is one of this machine's own addresses, other than loopback."""
        return self.address == self.local_address and not ipaddress.ip_address(self.address).is_loopback


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a launcher adds to its workers' environment for the network, and one line saying why."""

    variables: Mapping[str, str]
    summary: str
    route: Route | None = None


def user_setting(environ: Mapping[str, str]) -> str:
    """``GLOO_SOCKET_IFNAME='eth0'``... for the interface variables the user set; empty if none."""
    return ", ".join(f"{name}={environ[name]!r}" for name in IFNAME_VARIABLES if name in environ)


def choose(master_host: str, environ: Mapping[str, str]) -> Choice:
    """The interface variables for workers whose node 0 is ``master_host``.

    The user's ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` win: when either is set, nothing is
    added. Otherwise both name the interface that routes to ``master_host``. Raises
    ``ConfigurationError`` when ``master_host`` does not resolve or no route reaches it.
    """
    own = user_setting(environ)
    if own:
        route = None
        with contextlib.suppress(ConfigurationError):
            route = route_to(master_host)
        return Choice({}, f"{own} set by you: autoddp leaves the network interface to it", route)
    route = route_to(master_host)
    if route.interface is None:
        return Choice(
            {},
            f"no interface found with address {route.local_address} (the one that routes to "
            f"{route.address}): set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface that "
            "reaches the other machines",
            route,
        )
    why = route.note or f"the one that routes to {_shown(route)}"
    summary = (
        f"network interface {route.interface} ({route.local_address}), {why}; GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME set to it (set either yourself to choose another)"
    )
    return Choice(dict.fromkeys(IFNAME_VARIABLES, route.interface), summary, route)


def _shown(route: Route) -> str:
    return route.address if route.host == route.address else f"{route.host} ({route.address})"


def route_to(host: str) -> Route:
    """The interface and local address this machine uses to reach ``host`` (a name or an address)."""
    host = host.strip("[]")
    try:
        family, *_, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise ConfigurationError(
            f"node 0's address {host!r} does not resolve on this machine ({error}): give --master / "
            "MASTER_ADDR as a host name or IP address that every machine can reach"
        ) from None
    address = str(sockaddr[0])
    if ipaddress.ip_address(address).is_loopback and not _names_loopback(host):
        # Node 0 itself, named by a host name that resolves to loopback only here: the other
        # machines reach it by another address, most likely through the default route.
        outward = _outward_interface(family)
        if outward is not None:
            note = f"{outward[2]}: {host} resolves to {address} here, which the other machines cannot reach"
            return Route(host, address, outward[0], outward[1], note)
    try:
        local = _source_address(family, address)
    except OSError as error:
        raise ConfigurationError(
            f"this machine has no network route to node 0 at {address} ({error.strerror or error}): "
            "check the --master / MASTER_ADDR address and this machine's network"
        ) from None
    return Route(host, address, _interface_with(local, family), local)


def _outward_interface(family: int) -> tuple[str, str, str] | None:
    """(interface, address, why) facing other machines: the default route's, else the only one."""
    with contextlib.suppress(OSError):
        local = _source_address(family, _ANYWHERE[family])
        name = _interface_with(local, family)
        if name is not None:
            return name, local, "the default route's"
    if family == socket.AF_INET:
        outward = [(name, addr) for name, addr in _ipv4_addresses() if not addr.startswith("127.")]
        if len(outward) == 1:
            return (*outward[0], "the only one with a non-loopback address")
    return None


def _names_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses written as such (all nodes on one machine)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _source_address(family: int, address: str) -> str:
    """The local address the kernel picks to reach ``address`` (a UDP connect sends nothing)."""
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return str(probe.getsockname()[0])


def _interface_with(address: str, family: int) -> str | None:
    """The name of the interface that holds ``address``, or None."""
    if not sys.platform.startswith("linux"):
        return None
    if family == socket.AF_INET6:
        return _ipv6_interface(address)
    return _ipv4_interface(address) or _ipv4_route_interface(address)


def _ipv4_interface(address: str) -> str | None:
    """The interface whose (primary) IPv4 address is ``address``."""
    for name, held in _ipv4_addresses():
        if held == address:
            return name
    return None


def _ipv4_addresses() -> list[tuple[str, str]]:
    """(interface, primary IPv4 address) of every interface that has one (the SIOCGIFADDR ioctl)."""
    import fcntl

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            found.append((name, socket.inet_ntoa(reply[20:24])))
    return found


def _ipv4_route_interface(address: str, table: str = "/proc/net/route") -> str | None:
    """The interface of the longest prefix in the main routing table that contains ``address``."""
    target = int(ipaddress.IPv4Address(address))
    best: tuple[int, str] | None = None
    try:
        with open(table) as handle:
            rows = handle.read().splitlines()[1:]
    except OSError:
        return None
    for row in rows:
        fields = row.split()
        if len(fields) < 8:
            continue
        name, destination, mask = fields[0], _host_order(fields[1]), _host_order(fields[7])
        if target & mask == destination and (best is None or mask > best[0]):
            best = (mask, name)
    return best[1] if best else None


def _host_order(hex_field: str) -> int:
    """An address from /proc/net/route (hex, in the machine's byte order) as a number."""
    return int.from_bytes(struct.pack("=I", int(hex_field, 16)), "big")


def _ipv6_interface(address: str, table: str = "/proc/net/if_inet6") -> str | None:
    """The interface that holds IPv6 ``address``, from ``/proc/net/if_inet6``."""
    wanted = ipaddress.IPv6Address(address.split("%")[0])
    try:
        with open(table) as handle:
            for row in handle:
                fields = row.split()
                if len(fields) >= 6 and ipaddress.IPv6Address(int(fields[0], 16)) == wanted:
                    return fields[5]
    except OSError:
        pass
    return None
