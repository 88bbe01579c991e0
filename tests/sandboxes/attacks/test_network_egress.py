"""Networked sandboxes (a repository's setup phase) reach public addresses only.

The attacker registers setup commands, which run with network on, and aims them at what the host can
reach but the internet cannot: the host's own non-loopback addresses, private and link-local ranges,
cloud metadata. The test builds those targets itself: a network namespace joined to the host by a
veth pair, with private, link-local and public-looking addresses on both ends and listeners behind
them. Nothing is sent anywhere else: the public-looking address is routed into the test's namespace
(checked before any probe), and the metadata address is probed only once the firewall is known to be
loaded, so its packets are rejected inside the sandbox (the rule counters show it).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

from sandboxes import netguard
from sandboxes.base import BackendUnavailable, RepoSource, SandboxLimits
from tests.sandboxes.conftest import TEST_LIMITS, _traversable_tempdir

NET_LIMITS = SandboxLimits(cpu_seconds=20, memory_mb=512, max_processes=64, disk_mb=64, command_timeout_s=30,
                           lifetime_s=300, network=True)
HOST_PRIVATE, NS_PRIVATE = "10.213.7.1", "10.213.7.2"
HOST_LINK_LOCAL, NS_LINK_LOCAL = "169.254.213.1", "169.254.213.2"
HOST_PUBLIC, NS_PUBLIC = "192.88.99.214", "192.88.99.213"
"""Public per the refused table (a retired anycast prefix); both are pinned to the test's veth."""

PROBE = """
import socket, sys
for target in sys.argv[2:]:
    try:
        socket.create_connection((target, int(sys.argv[1])), timeout=3).close()
        print(target, "CONNECTED")
    except OSError as exc:
        print(target, "BLOCKED", type(exc).__name__)
"""

LISTENER = """
import select, socket, sys
servers = []
for address in sys.argv[2:]:
    server = socket.socket()
    server.bind((address, int(sys.argv[1])))
    server.listen(16)
    servers.append(server)
print("READY", flush=True)
while True:
    for server in select.select(servers, [], [])[0]:
        conn, peer = server.accept()
        print("ACCEPT", server.getsockname()[0], flush=True)
        conn.close()
"""

TAMPER = """
for tool in /usr/sbin/nft /sbin/nft /usr/sbin/iptables /usr/sbin/iptables-legacy /usr/sbin/ip6tables; do
  [ -x "$tool" ] || continue
  case "$tool" in *nft) "$tool" flush ruleset ;; *) "$tool" -P OUTPUT ACCEPT; "$tool" -F ;; esac \\
    >/dev/null 2>&1 && echo "TAMPERED $tool"
done
ip route add 10.213.7.0/30 dev lo >/dev/null 2>&1 && echo "TAMPERED route"
echo TAMPER-DONE
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Targets:
    """The test's network namespace, its veth pair and the listeners on both ends."""

    port: int
    accepted: list[str] = field(default_factory=list)


@pytest.fixture
def targets():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("building the target namespace needs root and iproute2")
    tag = secrets.token_hex(3)
    netns, host_end, ns_end = f"fse{tag}", f"fse{tag}h", f"fse{tag}n"
    port = 40000 + secrets.randbelow(20000)
    result = Targets(port)
    servers: list[socket.socket] = []
    listener = None
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", netns)
        for address in (f"{HOST_PRIVATE}/30", f"{HOST_LINK_LOCAL}/30", f"{HOST_PUBLIC}/32"):
            _ip("addr", "add", address, "dev", host_end)
        _ip("link", "set", host_end, "up")
        for address in (f"{NS_PRIVATE}/30", f"{NS_LINK_LOCAL}/30", f"{NS_PUBLIC}/32"):
            _ip("-n", netns, "addr", "add", address, "dev", ns_end)
        _ip("-n", netns, "link", "set", ns_end, "up")
        _ip("-n", netns, "route", "add", "default", "via", HOST_PRIVATE)
        _ip("route", "add", f"{NS_PUBLIC}/32", "dev", host_end, "src", HOST_PRIVATE)
        route = subprocess.run(["ip", "route", "get", NS_PUBLIC], capture_output=True, text=True, check=True).stdout
        assert f"dev {host_end}" in route, f"{NS_PUBLIC} must stay inside the test's veth, not {route!r}"
        listener = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-c", LISTENER, str(port), NS_PRIVATE, NS_LINK_LOCAL,
             NS_PUBLIC], stdout=subprocess.PIPE, text=True)
        assert listener.stdout is not None and listener.stdout.readline().strip() == "READY"
        threading.Thread(target=lambda: [result.accepted.append(line.split()[1]) for line in listener.stdout],
                         daemon=True).start()
        for address in (HOST_PRIVATE, HOST_PUBLIC):
            server = socket.socket()
            server.bind((address, port))
            server.listen(16)
            servers.append(server)
            threading.Thread(target=_accept_into, args=(server, result.accepted), daemon=True).start()
        # Positive control: from the host, every target answers.
        for address in (NS_PRIVATE, NS_LINK_LOCAL, NS_PUBLIC, HOST_PRIVATE, HOST_PUBLIC):
            socket.create_connection((address, port), timeout=3).close()
        _wait_for(lambda: len(result.accepted) >= 5)
        result.accepted.clear()
        yield result
    finally:
        for server in servers:
            server.close()
        if listener is not None:
            listener.kill()
            listener.wait()
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", host_end)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", netns)


def _accept_into(server: socket.socket, accepted: list[str]) -> None:
    with contextlib.suppress(OSError):
        while True:
            conn, _ = server.accept()
            accepted.append(conn.getsockname()[0])
            conn.close()


def _wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _probe(box, port: int, *addresses: str) -> dict[str, str]:
    box.write_bytes("probe.py", PROBE.encode())
    result = box.exec(f"python3 probe.py {port} {' '.join(addresses)}")
    verdicts = dict(line.split()[:2] for line in result.stdout.splitlines() if line.strip())
    assert set(verdicts) == set(addresses), (result.stdout, result.stderr)
    return verdicts


def _counters(pid: int) -> dict[str, int]:
    """Packets each counting rule of the egress table matched, keyed by the set or port it tests."""
    listed = subprocess.run(["nsenter", f"--target={pid}", "--net", "nft", "-j", "list", "table", "inet",
                             netguard.TABLE], capture_output=True, text=True, timeout=10)
    assert listed.returncode == 0, f"no egress firewall in the sandbox's namespace: {listed.stderr.strip()}"
    counts: dict[str, int] = {}
    for item in json.loads(listed.stdout)["nftables"]:
        rule = item.get("rule")
        if not rule:
            continue
        text = json.dumps(rule["expr"])
        key = next((name for name in ("@host4", "@host6", "@refused4", "@refused6") if f'"{name}"' in text),
                   "dns" if '"dport"' in text else "public" if '"accept"' in text else "dropped")
        for expr in rule["expr"]:
            if "counter" in expr:
                counts[key] = counts.get(key, 0) + expr["counter"]["packets"]
    return counts


def _refused_runtime(backend) -> bool:
    """Docker under another runtime than runc (gVisor sends past the firewall): network=True must be refused."""
    return backend.name == "docker" and backend.runtime != "runc"


def _networked(backend, snapshot):
    if _refused_runtime(backend):
        with pytest.raises(BackendUnavailable, match="runc containers only"):
            backend.sandbox_create(snapshot=snapshot, limits=NET_LIMITS)
        pytest.skip(f"network=True is refused under {backend.runtime}, as it must be")
    try:
        return backend.sandbox_create(snapshot=snapshot, limits=NET_LIMITS)
    except BackendUnavailable as exc:
        if "firewall" in str(exc) or "nft" in str(exc):
            raise
        pytest.skip(str(exc))


INTERNAL = (NS_PRIVATE, NS_LINK_LOCAL, HOST_PRIVATE, HOST_PUBLIC)


def test_networked_sandbox_reaches_only_public_addresses(sandbox_backend, make_snapshot, targets):
    box = _networked(sandbox_backend, make_snapshot({"a.txt": "a\n"}))
    try:
        assert _probe(box, targets.port, *INTERNAL) == dict.fromkeys(INTERNAL, "BLOCKED")
        time.sleep(0.3)
        assert targets.accepted == [], f"internal listeners were reached: {targets.accepted}"
        # The public-looking address (routed into the test's namespace) is reachable: egress works.
        assert _probe(box, targets.port, NS_PUBLIC) == {NS_PUBLIC: "CONNECTED"}
        assert _wait_for(lambda: targets.accepted == [NS_PUBLIC]), targets.accepted

        pid = box.holder_pid
        before = _counters(pid)
        assert before.get("@host4", 0) >= 2 and before.get("@refused4", 0) >= 2, before
        # Cloud metadata: rejected inside the namespace, counted, never sent.
        assert _probe(box, 80, "169.254.169.254") == {"169.254.169.254": "BLOCKED"}
        after = _counters(pid)
        assert after["@refused4"] > before["@refused4"] and after.get("public") == before.get("public"), after
    finally:
        box.destroy()


def test_sandbox_commands_cannot_lift_the_firewall(sandbox_backend, make_snapshot, targets):
    box = _networked(sandbox_backend, make_snapshot({"a.txt": "a\n"}))
    try:
        tamper = box.exec(TAMPER)
        assert "TAMPER-DONE" in tamper.stdout and "TAMPERED" not in tamper.stdout, tamper.stdout
        assert _probe(box, targets.port, NS_PRIVATE, HOST_PUBLIC) == dict.fromkeys((NS_PRIVATE, HOST_PUBLIC),
                                                                                   "BLOCKED")
        time.sleep(0.3)
        assert targets.accepted == []
        assert _counters(box.holder_pid).get("@refused4", 0) >= 1
    finally:
        box.destroy()


def test_dns_goes_to_the_namespace_forwarder_only(sandbox_backend, make_snapshot, targets):
    if sandbox_backend.name != "local":
        pytest.skip("the slirp4netns forwarder is the local backend's")
    box = _networked(sandbox_backend, make_snapshot({"a.txt": "a\n"}))
    try:
        # A query for "localhost." to the forwarder passes the firewall; port 80 of it does not.
        query = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                 "s.sendto(bytes.fromhex('abcd01000001000000000000096c6f63616c686f73740000010001'), "
                 "('10.0.2.3', 53))")
        before = _counters(box.holder_pid)
        assert box.exec(f'python3 -c "{query}"').exit_code == 0
        assert _probe(box, 80, "10.0.2.3") == {"10.0.2.3": "BLOCKED"}
        after = _counters(box.holder_pid)
        assert after["dns"] == before.get("dns", 0) + 1 and after["@refused4"] > before["@refused4"], after
    finally:
        box.destroy()


def test_setup_commands_cannot_reach_internal_addresses(sandbox_backend, tmp_path, targets):
    """The real attack path: a repository's setup commands, run with network on while building its snapshot."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "probe.py").write_text(PROBE)
    command = f"python3 probe.py {targets.port} {' '.join(INTERNAL)} > verdicts.txt"
    source = RepoSource(kind="path", location=str(repo))
    if _refused_runtime(sandbox_backend):
        with pytest.raises(BackendUnavailable, match="runc containers only"):
            sandbox_backend.snapshot_create(source=source, setup_commands=(command,), setup_limits=NET_LIMITS)
        assert targets.accepted == []
        return
    try:
        snapshot = sandbox_backend.snapshot_create(source=source, setup_commands=(command,), setup_limits=NET_LIMITS)
    except BackendUnavailable as exc:
        if "firewall" in str(exc) or "nft" in str(exc):
            raise
        pytest.skip(str(exc))
    try:
        box = sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
        try:
            text = box.read_bytes("verdicts.txt").decode()
        finally:
            box.destroy()
        assert dict(line.split()[:2] for line in text.splitlines()) == dict.fromkeys(INTERNAL, "BLOCKED"), text
        time.sleep(0.3)
        assert targets.accepted == [], f"setup commands reached {targets.accepted}"
    finally:
        sandbox_backend.snapshot_delete(snapshot=snapshot)


def test_network_is_refused_when_the_firewall_cannot_be_installed(tmp_path, monkeypatch):
    """No nft on the host: network=True names the cause instead of running unguarded, unless opted out."""
    from sandboxes.local_backend import LocalBackend, LocalBackendConfig

    if os.geteuid() != 0 or shutil.which("slirp4netns") is None:
        pytest.skip("needs root and slirp4netns (otherwise network=True is refused for that reason first)")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(netguard, "NFT_PATHS", (str(tmp_path / "no-nft"),))
    assert shutil.which("nft") is None
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.txt").write_text("a\n")
    state = _traversable_tempdir("flowstate-egress-")
    backend = LocalBackend(LocalBackendConfig(root=state))
    unguarded = LocalBackend(LocalBackendConfig(root=state, network_unguarded=True))
    try:
        snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
        with pytest.raises(BackendUnavailable, match="network=True is refused: .*nftables"):
            backend.sandbox_create(snapshot=snapshot, limits=NET_LIMITS)
        with pytest.raises(BackendUnavailable, match="nftables"):
            backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)), setup_commands=("true",),
                                    setup_limits=NET_LIMITS)
        box = unguarded.sandbox_create(snapshot=snapshot, limits=NET_LIMITS)
        try:
            assert box.exec("echo ran").stdout == "ran\n"
        finally:
            box.destroy()
    finally:
        backend.close()
        unguarded.close()
        shutil.rmtree(state, ignore_errors=True)


ROOTLESS_SCRIPT = """
import ipaddress, json, subprocess, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from sandboxes import netguard
from sandboxes.base import RepoSource, SandboxLimits
from sandboxes.local_backend import LocalBackend, LocalBackendConfig
backend = LocalBackend(LocalBackendConfig(root=Path(sys.argv[2]) / "state"))
snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=sys.argv[3]))
box = backend.sandbox_create(snapshot=snapshot, limits=SandboxLimits(lifetime_s=60, command_timeout_s=10))
backend._egress_guard(box.id, box.holder_pid)
tamper = box.exec("/usr/sbin/nft flush ruleset 2>&1; echo rc=$?").stdout
listed = subprocess.run(["nsenter", f"--target={box.holder_pid}", "--user", "--preserve-credentials", "--net",
                         "/usr/sbin/nft", "list", "table", "inet", netguard.TABLE], capture_output=True, text=True)
print(json.dumps({"rootless": backend.rootless, "tamper": tamper, "listed": listed.stdout}))
box.destroy()
backend.close()
"""


def test_rootless_owner_installs_the_firewall_and_namespace_root_cannot_lift_it():
    """Rootless, sandbox commands run as the namespace's root without capabilities: the owner's firewall holds.

    (slirp4netns itself needs /dev/net/tun open to the user; the firewall is checked on its own here.)
    """
    import psutil

    if os.geteuid() != 0 or not os.access("/usr/sbin/nft", os.X_OK) or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root to impersonate an unprivileged user, /usr/sbin/nft and /usr/bin/python3")
    import tempfile
    from pathlib import Path

    work = Path(tempfile.mkdtemp(prefix="flowstate-rootless-net-", dir="/tmp"))
    try:
        (work / "repo").mkdir()
        (work / "repo" / "a.txt").write_text("a\n")
        code = work / "code"
        root = Path(__file__).resolve().parents[3]
        shutil.copytree(root / "sandboxes", code / "sandboxes", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(Path(psutil.__file__).parent, code / "psutil", ignore=shutil.ignore_patterns("__pycache__"))
        for path in (work, *work.rglob("*")):
            os.chown(path, 65534, 65534)
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", ROOTLESS_SCRIPT,
             str(code), str(work), str(work / "repo")],
            capture_output=True, text=True, timeout=120, check=False, cwd="/tmp",
            env={"PATH": "/usr/bin:/bin", "HOME": str(work)})
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["rootless"] is True
        assert "Operation not permitted" in report["tamper"] and "rc=1" in report["tamper"], report["tamper"]
        assert "@refused4" in report["listed"] and "policy drop" in report["listed"], report["listed"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
