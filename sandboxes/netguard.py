"""Which addresses untrusted code may reach, and the firewall that holds a networked sandbox to it.

One table (``REFUSED_RANGES``) says which destinations are not public: loopback, private, shared
(carrier-grade NAT), link-local, cloud metadata, documentation, benchmark, multicast, reserved,
unspecified, and IPv6 prefixes that embed or translate an IPv4 address (mapped, NAT64, 6to4). The
git guard (``sandboxes.git_fetch``) refuses a URL whose host resolves into it, and a networked
sandbox's egress firewall drops packets addressed into it, so both refuse the same ranges.

``egress_ruleset`` is an nftables ruleset for a sandbox's own network namespace: its output chain
accepts loopback, DNS to the namespace's forwarder only, and public addresses that are not one of
the host's own (a public address on a host interface reaches the host's services, so every address
of the host's interfaces is dropped too). Everything else is rejected before it leaves the
namespace. ``install`` loads it as the host (the sandbox's commands hold no capability, so they
cannot change it) before any sandbox command runs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import subprocess
from collections.abc import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

REFUSED_RANGES: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "this network, unspecified"),
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "shared address space (carrier-grade NAT; holds a cloud metadata address)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local (holds the cloud metadata address 169.254.169.254)"),
    ("172.16.0.0/12", "private (holds Docker's bridges)"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation"),
    ("192.168.0.0/16", "private"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved, broadcast"),
    ("::/3", "reserved: unspecified, loopback, IPv4-mapped, NAT64, discard-only"),
    ("2001::/23", "IETF protocol assignments (Teredo, benchmarking, ORCHID)"),
    ("2001:db8::/32", "documentation"),
    ("2002::/16", "6to4 (embeds an IPv4 address)"),
    ("3fff::/20", "documentation"),
    ("4000::/2", "reserved"),
    ("8000::/2", "reserved"),
    ("c000::/3", "reserved"),
    ("e000::/4", "reserved"),
    ("f000::/5", "reserved"),
    ("f800::/6", "reserved"),
    ("fc00::/7", "unique local (holds the cloud metadata address fd00:ec2::254)"),
    ("fe00::/9", "reserved"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local"),
    ("ff00::/8", "multicast"),
)
"""Destinations untrusted code may not reach, with the reason for each (CIDR, reason)."""

TABLE = "flowstate_egress"
"""Name of the nftables table ``install`` loads into a sandbox's network namespace."""

_NETWORKS: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(cidr) for cidr, _ in REFUSED_RANGES)


class EgressGuardUnavailable(RuntimeError):
    """The egress firewall could not be installed; the message names the cause and the fix."""


def refused_networks(version: int) -> list[IPNetwork]:
    """``REFUSED_RANGES`` of one IP version, overlaps merged (what a firewall set needs)."""
    return list(ipaddress.collapse_addresses(n for n in _NETWORKS if n.version == version))  # type: ignore[type-var]


def is_public(address: IPAddress | str) -> bool:
    """Whether ``address`` lies outside every refused range (an IPv4-mapped IPv6 address counts as IPv4)."""
    if isinstance(address, str):
        address = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not any(address in network for network in _NETWORKS if network.version == address.version)


def host_addresses() -> list[IPAddress]:
    """Every address of this host's interfaces in the current network namespace, now."""
    try:  # here, not at import: the local backend also runs under a bare system Python
        import psutil
    except ImportError:
        raise EgressGuardUnavailable("listing the host's addresses for the egress firewall needs psutil") from None

    found: set[IPAddress] = set()
    for addresses in psutil.net_if_addrs().values():
        for entry in addresses:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                found.add(ipaddress.ip_address(entry.address.split("%", 1)[0]))
    return sorted(found, key=lambda a: (a.version, int(a)))


def _elements(items: Iterable[object]) -> str:
    listed = ", ".join(str(item) for item in items)
    return f"elements = {{ {listed} }}" if listed else ""


def egress_ruleset(*, host: Iterable[IPAddress], dns: Iterable[IPAddress]) -> str:
    """The nftables script that holds a namespace's egress to public, non-host addresses plus ``dns`` port 53.

    Refused packets are rejected in the namespace (the sender sees an error at once, nothing leaves);
    every rule counts, so a test can tell a refusal from a packet that left.
    """
    host = list(host)
    dns4 = sorted(str(a) for a in dns if a.version == 4)
    dns6 = sorted(str(a) for a in dns if a.version == 6)
    dns_rules = [f"{family} daddr {{ {', '.join(addresses)} }} meta l4proto {{ tcp, udp }} th dport 53 counter accept"
                 for family, addresses in (("ip", dns4), ("ip6", dns6)) if addresses]
    lines = [
        f"table inet {TABLE} {{",
        f"  set refused4 {{ type ipv4_addr; flags interval; {_elements(refused_networks(4))} }}",
        f"  set refused6 {{ type ipv6_addr; flags interval; {_elements(refused_networks(6))} }}",
        f"  set host4 {{ type ipv4_addr; {_elements(a for a in host if a.version == 4)} }}",
        f"  set host6 {{ type ipv6_addr; {_elements(a for a in host if a.version == 6)} }}",
        "  chain output {",
        "    type filter hook output priority filter; policy drop;",
        '    oifname "lo" accept',
        *(f"    {rule}" for rule in dns_rules),
        "    ip daddr @host4 counter reject with icmpx type admin-prohibited",
        "    ip6 daddr @host6 counter reject with icmpx type admin-prohibited",
        "    ip daddr @refused4 counter reject with icmpx type admin-prohibited",
        "    ip6 daddr @refused6 counter reject with icmpx type admin-prohibited",
        "    meta nfproto { ipv4, ipv6 } counter accept",
        "    counter",
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


NFT_PATHS = ("/usr/sbin/nft", "/sbin/nft")
"""Where nft is looked for besides PATH (a service's PATH often lacks the sbin directories)."""


def _nft() -> str:
    for candidate in (shutil.which("nft"), *NFT_PATHS):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise EgressGuardUnavailable(
        "networked sandboxes need nftables on the host to hold their egress to public addresses "
        "(apt-get install nftables)")


def install(pid: int, *, dns: Iterable[IPAddress], enter_user_namespace: bool) -> None:
    """Load the egress ruleset into the network namespace of process ``pid``; raise EgressGuardUnavailable.

    ``enter_user_namespace``: join the process's user namespace first (a rootless owner has
    CAP_NET_ADMIN over the namespace only from inside it); host root enters the network namespace alone.
    """
    nft = _nft()
    if shutil.which("nsenter") is None:
        raise EgressGuardUnavailable("installing the egress firewall needs nsenter (util-linux) on PATH")
    namespaces = ["--user", "--preserve-credentials", "--net"] if enter_user_namespace else ["--net"]
    # Only this table is added: rules others keep in the namespace (Docker's DNS redirects) stay, and a
    # packet any base chain drops is dropped whatever another chain accepts.
    script = egress_ruleset(host=host_addresses(), dns=dns)
    try:
        result = subprocess.run(["nsenter", f"--target={pid}", *namespaces, "--", nft, "-f", "-"],
                                input=script.encode(), capture_output=True, timeout=30, check=False,
                                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"})
    except subprocess.TimeoutExpired:
        raise EgressGuardUnavailable("loading the egress firewall (nft) timed out") from None
    if result.returncode != 0:
        error = result.stderr.decode(errors="replace").strip()[-500:]
        raise EgressGuardUnavailable(f"loading the egress firewall into the sandbox's network namespace failed: "
                                     f"{error or f'nft exited {result.returncode}'}")


def nameservers(resolv_conf: str) -> list[IPAddress]:
    """The nameserver addresses a resolv.conf lists (where a container's resolver sends its queries)."""
    found = []
    try:
        with open(resolv_conf, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) >= 2 and fields[0] == "nameserver":
                    with contextlib.suppress(ValueError):
                        found.append(ipaddress.ip_address(fields[1].split("%", 1)[0]))
    except OSError as exc:
        raise EgressGuardUnavailable(f"the container's resolv.conf could not be read: {exc.strerror}") from None
    return found


def install_in_container(inspected: dict, *, runtime: str) -> None:
    """Load the egress ruleset into a running Docker container's network namespace (``inspected``: the
    engine's inspect answer), allowing DNS to its resolv.conf's nameservers only.

    Only runc is accepted: gVisor (runsc) sends the container's packets from its own user-space network
    stack, past the namespace's output hook, and another runtime's path is unverified.
    """
    if runtime != "runc":
        raise EgressGuardUnavailable(f"the egress firewall holds runc containers only, not {runtime!r} ones "
                                     "(gVisor's own network stack sends past it)")
    pid = int((inspected.get("State") or {}).get("Pid") or 0)
    if pid <= 0:
        raise EgressGuardUnavailable("the container has no running process to hold its network namespace")
    install(pid, dns=nameservers(inspected.get("ResolvConfPath") or ""), enter_user_namespace=False)
