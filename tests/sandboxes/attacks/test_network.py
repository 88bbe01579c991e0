"""No network: host loopback services and outside addresses are unreachable from a sandbox."""

from __future__ import annotations

import socket
import threading

import pytest

from sandboxes.tools import ToolCall, execute_tool_calls
from tests.sandboxes.conftest import host_is_healthy

PROBE = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), timeout=3).close()
    print("CONNECTED")
except OSError as exc:
    print("BLOCKED", type(exc).__name__, exc)
"""


@pytest.fixture
def host_listener():
    """A TCP server on the host's 127.0.0.1 — the positive control: the host can reach it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            while True:
                conn, _ = server.accept()
                accepted.append(conn)
        except OSError:
            return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    yield port
    server.close()
    for conn in accepted:
        conn.close()


def probe(sandbox, host, port):
    sandbox.write_bytes("probe.py", PROBE.encode())
    result = execute_tool_calls(sandbox=sandbox, calls=[
        ToolCall("c", "run_terminal", {"command": f"python3 probe.py {host} {port}", "timeout_s": 15})])[0]
    assert "BLOCKED" in result.output or "CONNECTED" in result.output, result.output
    return result.output


@pytest.mark.parametrize("port", [5432, 6379])
def test_host_database_and_broker_ports_are_unreachable(sandbox, port):
    assert "BLOCKED" in probe(sandbox, "127.0.0.1", port)


def test_any_host_loopback_listener_is_unreachable(sandbox, host_listener):
    assert "BLOCKED" in probe(sandbox, "127.0.0.1", host_listener)
    host_is_healthy()


@pytest.mark.parametrize("address", ["1.1.1.1", "8.8.8.8", "169.254.169.254"])
def test_egress_is_blocked(sandbox, address):
    assert "BLOCKED" in probe(sandbox, address, 80)


def test_only_loopback_interface_exists(sandbox):
    interfaces = sandbox.exec("ls /sys/class/net 2>/dev/null || cat /proc/net/dev").stdout
    names = {line.split(":")[0].strip() for line in interfaces.splitlines() if line.strip()}
    names = {n for n in names if n and not n.startswith(("Inter", "face"))}
    assert names <= {"lo"}, names


def _host_external_address() -> str | None:
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


def test_opt_in_network_reaches_no_host_address(sandbox_backend, make_snapshot):
    """network=True gives egress to public addresses only: host services stay unreachable, bound to loopback or
    to the host's external address (test_network_egress.py holds the public positive control)."""
    from sandboxes.base import BackendUnavailable, SandboxLimits

    external = _host_external_address()
    if external is None:
        pytest.skip("the host has no non-loopback IPv4 address to aim at")
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    port = server.getsockname()[1]
    limits = SandboxLimits(memory_mb=512, max_processes=64, disk_mb=64, command_timeout_s=20, lifetime_s=120,
                           network=True)
    try:
        try:
            box = sandbox_backend.sandbox_create(snapshot=make_snapshot({"a.txt": "a\n"}), limits=limits)
        except BackendUnavailable as exc:
            pytest.skip(str(exc))
        try:
            socket.create_connection((external, port), timeout=3).close()  # the host itself reaches it
            assert "BLOCKED" in probe(box, external, port)
            assert "BLOCKED" in probe(box, "127.0.0.1", port)
            assert "BLOCKED" in probe(box, "127.0.0.1", 5432)
            assert "BLOCKED" in probe(box, "10.0.2.2", port)
        finally:
            box.destroy()
    finally:
        server.close()
    host_is_healthy()
