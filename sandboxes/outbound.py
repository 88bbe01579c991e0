"""HTTP(S) connections to user-given servers (OpenAI-compatible policy servers): checked, then pinned.

- ``check_http_url`` applies the outbound address guard of git URLs (``sandboxes.git_fetch.check_host``:
  every address the host resolves to must be public unless the host is allow-listed in
  ``FLOWSTATE_GIT_ALLOWED_HOSTS``) to an http(s) URL; no user name or password in it.
- ``pinned_http_client`` checks the URL again when it is built (DNS may have changed since the URL was
  submitted) and returns an ``httpx2.Client`` that connects only to the address it checked. Every request
  must name the same scheme, host and port and goes to that address; the Host header and the TLS server
  name stay the host's, so a certificate is verified against the name. Redirects are not followed and
  environment proxies are ignored (a proxy would resolve the name again itself). A request carries only
  the credential the caller gave the client, whatever the client library added from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx2

from sandboxes.git_fetch import OutboundRefused, check_host

HTTP_SCHEMES = ("http", "https")
HTTP_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class HttpTarget:
    """A checked http(s) URL's connection: where requests may go, and the one address they reach."""

    scheme: str
    host: str
    port: int
    addresses: tuple[str, ...]
    """Every address the host resolved to when checked (empty: not resolved, ``resolve_required=False``)."""


def check_http_url(url: str, *, label: str, hosts_allowed: frozenset[str] | None = None,
                   resolve_required: bool = True) -> HttpTarget:
    """Validate ``url`` (an http(s) URL to a public host, or an allow-listed one); raises OutboundRefused
    whose message names ``label`` (the field the user filled in)."""
    url = (url or "").strip()
    if not url or any(ord(c) < 0x21 or c == "\x7f" for c in url):
        raise OutboundRefused(f"{label} must be an http(s):// URL without spaces")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in HTTP_SCHEMES:
        raise OutboundRefused(f"{label} must use http:// or https://; {scheme or 'this form'} is not allowed")
    if parts.username is not None or parts.password is not None:
        raise OutboundRefused(f"{label} must not contain a user name or password (give the key as api_key)")
    host = (parts.hostname or "").lower()
    try:
        port = parts.port or HTTP_PORTS[scheme]
    except ValueError:
        raise OutboundRefused(f"{label} has an invalid port") from None
    if not host:
        raise OutboundRefused(f"{label} has no host name")
    addresses = check_host(host, port, label=f"{label} host", hosts_allowed=hosts_allowed,
                           resolve_required=resolve_required)
    return HttpTarget(scheme, host, port, tuple(addresses))


PASSED_HEADERS = frozenset({"host", "accept", "accept-encoding", "content-type", "content-length", "connection",
                            "user-agent", "transfer-encoding"})
"""Headers a pinned request keeps; every other one the client added (credentials or organisation headers a
client library reads from this process's environment) is dropped, and only ``bearer_token`` is added."""


class PinnedTransport(httpx2.BaseTransport):
    """Sends each request to the first of ``target``'s checked addresses that connects, with ``PASSED_HEADERS``
    and, when given, ``Authorization: Bearer <bearer_token>``; refuses any other scheme, host or port."""

    def __init__(self, target: HttpTarget, *, bearer_token: str = "") -> None:
        if not target.addresses:
            raise OutboundRefused(f"{target.host!r} has no checked address to connect to")
        self.target = target
        self._bearer_token = bearer_token
        self._inner = httpx2.HTTPTransport(trust_env=False)

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        url, target = request.url, self.target
        port = url.port or HTTP_PORTS.get(url.scheme)
        if (url.scheme, url.host, port) != (target.scheme, target.host, target.port):
            raise httpx2.ConnectError(
                f"refused: this client may only reach {target.scheme}://{target.host}:{target.port}", request=request)
        headers = [(name, value) for name, value in request.headers.multi_items() if name.lower() in PASSED_HEADERS]
        if self._bearer_token:
            headers.append(("Authorization", f"Bearer {self._bearer_token}"))
        failure = httpx2.ConnectError(f"no checked address of {target.host!r} to connect to", request=request)
        # Every address was checked; the next is tried only when one cannot be connected to (an IPv6
        # address on a host without IPv6), before any byte of the request was sent.
        for address in target.addresses:
            pinned = httpx2.Request(request.method, url.copy_with(host=address), headers=headers,
                                    stream=request.stream,
                                    extensions={**request.extensions, "sni_hostname": target.host})
            try:
                return self._inner.handle_request(pinned)
            except httpx2.ConnectError as exc:
                failure = exc
        raise failure

    def close(self) -> None:
        self._inner.close()


def pinned_http_client(url: str, *, label: str, bearer_token: str = "", timeout_s: float = 600.0,
                       hosts_allowed: frozenset[str] | None = None) -> httpx2.Client:
    """An ``httpx2.Client`` for ``url``'s server, checked now (resolving) and pinned to the address checked;
    its requests carry ``bearer_token`` (none when empty) and no other credential."""
    target = check_http_url(url, label=label, hosts_allowed=hosts_allowed, resolve_required=True)
    return httpx2.Client(transport=PinnedTransport(target, bearer_token=bearer_token), follow_redirects=False,
                         trust_env=False,
                         timeout=httpx2.Timeout(timeout_s, connect=10.0))
