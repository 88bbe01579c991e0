"""The refused-range table: every internal address an attacker could name is in it, for git and egress alike."""

from __future__ import annotations

import ipaddress
import random

import pytest

from sandboxes import git_fetch, netguard

INTERNAL = [
    "127.0.0.1", "127.255.255.254", "0.0.0.0", "10.1.2.3", "172.17.0.1", "172.31.255.255", "192.168.1.1",
    "100.64.0.1", "100.100.100.200", "169.254.169.254", "169.254.0.1", "198.18.0.1", "198.19.255.255",
    "192.0.2.1", "198.51.100.1", "203.0.113.1", "224.0.0.1", "239.255.255.250", "240.0.0.1", "255.255.255.255",
    "192.0.0.1", "::", "::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "64:ff9b::a00:1",
    "64:ff9b:1::1", "100::1", "2001::1", "2001:db8::1", "2002:a00:1::1", "fc00::1", "fd00:ec2::254", "fe80::1",
    "fec0::1", "ff02::1", "::a00:1", "3fff::1",
]


@pytest.mark.parametrize("address", INTERNAL)
def test_internal_addresses_are_refused(address):
    assert not netguard.is_public(address)
    assert not git_fetch._is_public(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "192.88.99.1", "2001:4860:4860::8888",
                                     "::ffff:8.8.8.8", "2606:4700::1111"])
def test_public_addresses_pass(address):
    assert netguard.is_public(address)


def test_table_refuses_everything_the_standard_library_calls_internal():
    """A random sweep: whatever Python's ipaddress deems not global (or special) is refused by the table."""
    rng = random.Random(7)
    for _ in range(20000):
        for address in (ipaddress.IPv4Address(rng.getrandbits(32)), ipaddress.IPv6Address(rng.getrandbits(128)),
                        ipaddress.IPv6Address((1 << 125) | rng.getrandbits(125))):
            internal = (not address.is_global or address.is_private or address.is_loopback or address.is_multicast
                        or address.is_reserved or address.is_link_local or address.is_unspecified)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                continue
            if internal:
                assert not netguard.is_public(address), address


def test_firewall_sets_are_the_table():
    script = netguard.egress_ruleset(host=[], dns=[ipaddress.ip_address("10.0.2.3")])
    for version in (4, 6):
        for network in netguard.refused_networks(version):
            assert str(network) in script
    merged = netguard.refused_networks(4) + netguard.refused_networks(6)
    for cidr, _ in netguard.REFUSED_RANGES:
        assert any(ipaddress.ip_network(cidr).subnet_of(n) for n in merged if n.version == ipaddress.ip_network(cidr).version)
