"""Hosts and ports in IPv4, IPv6 and names (util/addresses.py)."""

from __future__ import annotations

import pytest

from farloco.util.addresses import (
    announced_host,
    bind_multiaddr,
    is_unspecified,
    join_host_port,
    multiaddr_host,
    split_host_port,
    tcp_multiaddr,
)


@pytest.mark.parametrize(
    ("host", "port", "address", "maddr"),
    [
        ("10.0.0.7", 31338, "10.0.0.7:31338", "/ip4/10.0.0.7/tcp/31338"),
        ("2001:db8::7", 31338, "[2001:db8::7]:31338", "/ip6/2001:db8::7/tcp/31338"),
        ("[2001:db8::7]", 1, "[2001:db8::7]:1", "/ip6/2001:db8::7/tcp/1"),
        ("node-3.example.org", 443, "node-3.example.org:443", "/dns/node-3.example.org/tcp/443"),
    ],
)
def test_addresses_of_each_family_round_trip(host: str, port: int, address: str, maddr: str) -> None:
    assert join_host_port(host, port) == address
    assert split_host_port(address) == (host.strip("[]"), port)
    assert tcp_multiaddr(host, port) == maddr
    assert multiaddr_host(maddr + "/p2p/QmX") == host.strip("[]")


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.7", "host:port"),
        ("::1:80", "takes brackets"),
        ("[::1:80", r"\[ipv6\]:port"),
        ("h:0", "host:port"),
    ],
)
def test_malformed_addresses_are_refused_naming_the_form(address: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        split_host_port(address)


def test_names_resolve_for_binding_and_literals_stay() -> None:
    assert bind_multiaddr("localhost", 5) == "/ip4/127.0.0.1/tcp/5"
    assert bind_multiaddr("::1", 5) == "/ip6/::1/tcp/5"
    with pytest.raises(ValueError, match="cannot resolve"):
        bind_multiaddr("no-such-host.invalid", 5)


def test_a_node_bound_to_every_interface_announces_an_address_of_its_own() -> None:
    seen = [
        "/ip4/127.0.0.1/tcp/4/p2p/Qm",
        "/ip6/fe80::1/tcp/4/p2p/Qm",
        "/ip6/2001:db8::5/tcp/4/p2p/Qm",
        "/ip4/192.0.2.9/tcp/4/p2p/Qm",
    ]
    assert is_unspecified("0.0.0.0") and is_unspecified("::") and not is_unspecified("10.0.0.1")
    assert announced_host("0.0.0.0", "", seen) == "192.0.2.9"  # its own family first
    assert announced_host("::", "", seen) == "2001:db8::5"
    assert announced_host("0.0.0.0", "gw.example.org", seen) == "gw.example.org"
    assert announced_host("10.1.2.3", "", seen) == "10.1.2.3"
    with pytest.raises(ValueError, match=r"set network\.announce_host"):
        announced_host("0.0.0.0", "", ["/ip4/127.0.0.1/tcp/4"])
