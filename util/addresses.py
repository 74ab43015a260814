"""Hosts and ports as the swarm writes them: IPv4, IPv6 and DNS names alike.

- A gRPC or data-plane address is "host:port", with an IPv6 literal in brackets ("[2001:db8::7]:31338").
- A DHT multiaddr is /ip4/..., /ip6/... or, for a name, /dns/NAME/tcp/PORT (libp2p resolves it to either family).
- A listener binds an address literal (or a name this machine resolves); "0.0.0.0" / "::" bind every interface
  and are never what others dial: a node then announces `network.announce_host`, else an address of its own that
  its DHT reports.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable


def ip_version(host: str) -> int | None:
    """4 or 6 for an address literal (IPv6 with or without brackets), None for a name."""
    try:
        return int(ipaddress.ip_address(host.strip("[]")).version)
    except ValueError:
        return None


def is_unspecified(host: str) -> bool:
    """Whether `host` is 0.0.0.0 or :: (bind every interface)."""
    try:
        return bool(ipaddress.ip_address(host.strip("[]")).is_unspecified)
    except ValueError:
        return False


def join_host_port(host: str, port: int | str) -> str:
    """ "host:port", an IPv6 literal in brackets."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ip_version(host) == 6 else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """(host without brackets, port) of "host:port" or "[v6]:port"; ValueError naming what was expected."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected 'host:port' or '[ipv6]:port', got {address!r}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"expected '[ipv6]:port', got {address!r}")
    elif ":" in host:
        raise ValueError(f"an IPv6 address takes brackets: expected '[{host}]:{port}', got {address!r}")
    return host.strip("[]"), int(port)


def bind_multiaddr(host: str, port: int) -> str:
    """The multiaddr a listener binds for `host`: an address literal as it is, a name resolved here (libp2p
    listens on addresses, not names); ValueError when the name does not resolve."""
    host = host.strip("[]")
    if ip_version(host) is None:
        try:
            host = str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
        except OSError as exc:
            raise ValueError(f"cannot resolve the host to listen on, {host!r}: {exc}") from None
    return tcp_multiaddr(host, port)


def tcp_multiaddr(host: str, port: int) -> str:
    """The libp2p multiaddr of TCP `host`:`port`: /ip4, /ip6, or /dns for a name."""
    host = host.strip("[]")
    kind = {4: "ip4", 6: "ip6"}.get(ip_version(host) or 0, "dns")
    return f"/{kind}/{host}/tcp/{port}"


def multiaddr_host(maddr: str) -> str | None:
    """The host of a /ip4, /ip6, /dns, /dns4 or /dns6 multiaddr, None for any other."""
    parts = maddr.split("/")
    if len(parts) >= 3 and parts[0] == "" and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
        return parts[2]
    return None


def announced_host(host: str, announce_host: str, visible_maddrs: Iterable[str]) -> str:
    """The host other nodes dial this node on: `announce_host`, else `host`, else (when `host` binds every
    interface) the first address of its DHT's that is neither loopback nor unspecified, of `host`'s family
    first. ValueError when there is none."""
    if announce_host:
        return announce_host.strip("[]")
    if not is_unspecified(host):
        return host.strip("[]")
    family, maddrs = ip_version(host), list(visible_maddrs)
    candidates = []
    for maddr in maddrs:
        candidate = multiaddr_host(maddr)
        if candidate is None or ip_version(candidate) is None:
            continue
        address = ipaddress.ip_address(candidate)
        if not (address.is_loopback or address.is_unspecified or address.is_link_local):
            candidates.append(candidate)
    candidates.sort(key=lambda c: ip_version(c) != family)
    if not candidates:
        raise ValueError(
            f"network.host = {host!r} listens on every interface, but none of this node's addresses is one other "
            f"nodes can dial (the DHT reports {maddrs}): set network.announce_host to the address "
            f"or DNS name they should dial"
        )
    return candidates[0]
