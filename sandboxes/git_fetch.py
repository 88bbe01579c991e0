"""Cloning untrusted git repositories on the host: validated values, checked addresses, no root.

- A ref is validated (no leading ``-``, ``git check-ref-format``) and is followed by ``--``; a URL
  goes after ``--``. No user value is ever read as an option.
- A URL's scheme must be http, https or git (no ``ext::``, ``file://``, ssh or scp-style); its host
  is resolved here and every address must be public (not loopback, private, link-local, metadata,
  multicast or reserved) unless the host is allow-listed (``FLOWSTATE_GIT_ALLOWED_HOSTS``). Git then
  connects only to the checked address: http(s) through ``http.curloptResolve`` pinning and no
  redirects, git:// by the address literal. The address check (``check_host``) is shared with every other
  connection to a user-given host (policy servers: ``sandboxes.outbound``).
- Clone and checkout run as an unprivileged uid with no capabilities and bounded memory/CPU.
- Errors shown to users are summaries; raw git stderr (which may quote a file git read) is logged.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from sandboxes import netguard
from sandboxes.base import SnapshotError
from sandboxes.extract_server import unprivileged_prefix
from sandboxes.settings import current as current_settings

logger = logging.getLogger(__name__)

ALLOWED_SCHEMES = ("http", "https", "git")
DEFAULT_PORTS = {"http": 80, "https": 443, "git": 9418}
GIT_MEMORY_BYTES = 2 * 1024 * 1024 * 1024
GIT_CPU_SECONDS = 600
_HEX_SHA = re.compile(r"^[0-9a-fA-F]{7,64}$")


class OutboundRefused(ValueError):
    """A user-given host may not be connected to (internal address, unresolvable); the message says why."""


class GitSourceRejected(SnapshotError):
    """A git URL or ref is unsafe or malformed; the message names the problem, never a host file."""


@dataclass(frozen=True)
class GitTarget:
    url: str
    """What git is given (a git:// host replaced by its checked address)."""
    config: tuple[str, ...]
    """``-c`` settings pinning the connection to the checked address."""


def allowed_hosts() -> frozenset[str]:
    """Hosts whose internal addresses are accepted: the configured GIT_ALLOWED_HOSTS plus the environment's
    FLOWSTATE_GIT_ALLOWED_HOSTS (``sandboxes.settings``)."""
    return current_settings().git_hosts_allowed()


def check_ref(ref: str) -> str:
    """A branch, tag or commit name; refuses option-looking and malformed values."""
    ref = (ref or "").strip()
    if not ref:
        return ""
    if ref.startswith("-") or any(ord(c) < 0x21 or c == "\x7f" for c in ref) or len(ref) > 255:
        raise GitSourceRejected("the git ref must be a branch, tag or commit name (no leading '-', spaces or "
                                "control characters)")
    if _HEX_SHA.match(ref):
        return ref
    result = subprocess.run(["git", "check-ref-format", "--allow-onelevel", ref], capture_output=True, check=False,
                            timeout=10, env={"PATH": "/usr/bin:/bin"})
    if result.returncode != 0:
        raise GitSourceRejected(f"{ref!r} is not a valid git ref name")
    return ref


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    # One table of refused ranges for git and for networked sandboxes' egress firewall.
    return netguard.is_public(address)


def check_url(url: str, *, hosts_allowed: frozenset[str] | None = None,
              resolve_required: bool = True) -> tuple[str, str, int, list[str]]:
    """Validate ``url``; return (scheme, host, port, checked addresses). Raises GitSourceRejected.

    ``resolve_required=False`` (form validation) accepts a name that does not resolve yet; the
    worker checks again, resolving, right before it clones.
    """
    url = (url or "").strip()
    if not url or url.startswith("-") or any(ord(c) < 0x21 for c in url):
        raise GitSourceRejected("the git URL must be an http(s):// or git:// URL without spaces")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ALLOWED_SCHEMES or "::" in url.split("/", 1)[0]:
        raise GitSourceRejected(f"git URLs must use {', '.join(s + '://' for s in ALLOWED_SCHEMES)}; "
                                f"{scheme or 'this form'} is not allowed")
    host = (parts.hostname or "").lower()
    try:
        port = parts.port or DEFAULT_PORTS[scheme]
    except ValueError:
        raise GitSourceRejected("the git URL has an invalid port") from None
    if not host or host.startswith("-"):
        raise GitSourceRejected("the git URL has no valid host name")
    try:
        addresses = check_host(host, port, label="git host", hosts_allowed=hosts_allowed,
                               resolve_required=resolve_required)
    except OutboundRefused as exc:
        raise GitSourceRejected(str(exc)) from None
    return scheme, host, port, addresses


def check_host(host: str, port: int, *, label: str, hosts_allowed: frozenset[str] | None = None,
               resolve_required: bool = True) -> list[str]:
    """The outbound address guard of every user-given host (git URLs, policy servers): resolve ``host``
    and return its addresses, sorted; every one must be public unless ``host`` is allow-listed
    (``allowed_hosts``). Raises OutboundRefused naming ``label``.

    A name that does not resolve is refused, or with ``resolve_required=False`` (form validation)
    returned with no addresses: the connecting side checks again, resolving, and pins what it checked.
    """
    allowed = allowed_hosts() if hosts_allowed is None else hosts_allowed
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        if resolve_required:
            raise OutboundRefused(f"the {label} {host!r} could not be resolved") from None
        infos = []
    addresses = sorted({str(info[4][0]) for info in infos})
    if host not in allowed:
        refused = [a for a in addresses if not _is_public(ipaddress.ip_address(a.split("%", 1)[0]))]
        if refused:
            raise OutboundRefused(
                f"the {label} {host!r} resolves to an internal address; fetching from internal addresses is "
                "refused (an administrator can allow-list the host in FLOWSTATE_GIT_ALLOWED_HOSTS)")
    return addresses


def resolve_target(url: str, *, hosts_allowed: frozenset[str] | None = None) -> GitTarget:
    """Check ``url`` and pin the connection to the address checked (no DNS rebinding, no redirects)."""
    scheme, host, port, addresses = check_url(url, hosts_allowed=hosts_allowed)
    address = addresses[0]
    literal = f"[{address}]" if ":" in address else address
    if scheme == "git":
        parts = urlsplit(url.strip())
        netloc = literal if parts.port is None else f"{literal}:{parts.port}"
        return GitTarget(parts._replace(netloc=netloc).geturl(), ())
    return GitTarget(url.strip(), ("-c", f"http.curloptResolve={host}:{port}:{literal}",
                                   "-c", "http.followRedirects=false"))


def _git_env(home: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "GIT_TERMINAL_PROMPT": "0", "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ALLOW_PROTOCOL": "http:https:git:file", "LANG": "C"}


def _run(argv: list[str], *, run_as: tuple[int, int] | None, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    prefix = unprivileged_prefix(run_as, memory_bytes=GIT_MEMORY_BYTES, cpu_seconds=GIT_CPU_SECONDS) \
        if run_as is not None and os.geteuid() == 0 else []
    return subprocess.run([*prefix, *argv], capture_output=True, text=True, env=_git_env(cwd), cwd=cwd,
                          timeout=timeout, check=False)


def git_materialize(*, location: str, ref: str | None, tree: Path, run_as: tuple[int, int] | None) -> None:
    """Clone ``location`` (a checked URL, or an existing local directory given by the server) into ``tree``."""
    ref = check_ref(ref or "")
    if location.startswith("/"):
        if not Path(location).is_dir():
            raise SnapshotError("git clone failed: the local repository does not exist")
        # A server directory (staff or the demo registered it): trusted, cloned as this process.
        target, run_as = GitTarget(location, ("-c", "protocol.file.allow=always")), None
    else:
        target = resolve_target(location)
    tree.mkdir(exist_ok=True)
    if run_as is not None and os.geteuid() == 0:
        os.chown(tree, *run_as)
    argv = ["git", *target.config, "-c", "core.hooksPath=/dev/null", "clone", "--quiet", "--no-hardlinks",
            *(["--no-checkout"] if ref else []), "--", target.url, "."]
    try:
        result = _run(argv, run_as=run_as, cwd=tree, timeout=GIT_CPU_SECONDS)
    except subprocess.TimeoutExpired:
        raise SnapshotError("git clone timed out") from None
    if result.returncode != 0:
        logger.warning("git clone %s failed: %s", location, result.stderr[-2000:])
        raise SnapshotError(f"git clone of {location} failed (exit {result.returncode}); check the URL and that "
                            "the repository is public")
    if ref:
        # check_ref refused a leading '-'; the trailing '--' stops git reading the ref as a path.
        argv = ["git", "-c", "core.hooksPath=/dev/null", "checkout", "--quiet", ref, "--"]
        result = _run(argv, run_as=run_as, cwd=tree, timeout=300)
        if result.returncode != 0:
            logger.warning("git checkout %s failed: %s", ref, result.stderr[-2000:])
            raise SnapshotError(f"git checkout of ref {ref!r} failed: no such branch, tag or commit")
