"""Which processes of a run listen on the network, and on which addresses.

Standard library and psutil only, no Django: ``scripts/run.py`` checks its children with it before
Django is configured. Sockets are read from this process's network namespace (psutil maps each
socket's inode to the processes holding it), which is the namespace the machine's interfaces are
in; a process inside a private network namespace (a sandbox) is not reachable through them.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    proto: str  # "tcp" | "udp"
    address: str
    port: int

    def describe(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.process} (pid {self.pid}) on {self.proto} {host}:{self.port}"


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped loopback; a wildcard (0.0.0.0, ::) or any other address is not."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def addresses_of(host: str) -> set[str]:
    """The IP addresses a server told to bind ``host`` listens on (a wildcard stays a wildcard)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return set()
    return {str(info[4][0]) for info in infos}


def _process_name(pid: int) -> str:
    try:
        process = psutil.Process(pid)
        command = process.cmdline()
        return " ".join(" ".join(command).split())[:120] if command else process.name()
    except psutil.Error:
        return "?"


def listening(pids: Iterable[int]) -> list[Listener]:
    """Every listening TCP socket and every unconnected (receiving from anyone) UDP socket that one
    of ``pids`` holds."""
    wanted = set(pids)
    found: set[Listener] = set()
    names: dict[int, str] = {}
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid is None or conn.pid not in wanted or not conn.laddr:
            continue
        if conn.type == socket.SOCK_STREAM and conn.status != psutil.CONN_LISTEN:
            continue
        if conn.type == socket.SOCK_DGRAM and conn.raddr:
            continue
        if conn.pid not in names:
            names[conn.pid] = _process_name(conn.pid)
        proto = "tcp" if conn.type == socket.SOCK_STREAM else "udp"
        found.add(Listener(conn.pid, names[conn.pid], proto, conn.laddr.ip, conn.laddr.port))
    return sorted(found, key=lambda item: (item.pid, item.proto, item.port))


def exposed(listeners: Iterable[Listener], *, allowed: Iterable[tuple[str, int]] = ()) -> list[Listener]:
    """The listeners reachable beyond loopback, but the (address, port) pairs in ``allowed``."""
    permitted = {(address, port) for address, port in allowed}
    return [item for item in listeners
            if not is_loopback(item.address) and (item.address, item.port) not in permitted]
