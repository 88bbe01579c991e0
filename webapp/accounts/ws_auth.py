"""Websocket authentication: the browser's session cookie, or an API token for programs.

A program passes its token as ``Authorization: Token <key>`` or ``?token=<key>``; it needs no
``Origin`` header. A token decides alone: a wrong one is anonymous even beside a valid session
cookie, so adding ``?token=x`` cannot carry a cookie session past the Origin check. Cookie sessions
(and anonymous connections) must come from an allowed Origin (``ALLOWED_HOSTS``), which stops
cross-site websocket hijacking; otherwise they are closed with 4403. Consumers check
``scope["user"].is_authenticated`` and close with 4401 otherwise, 4404 for what the user cannot see.

Refusals are close codes the client can read: ``CloseCodeMiddleware`` accepts the handshake before a
close that comes ahead of it (a close before the accept would reach the client as a bare HTTP 403).
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.auth.models import AnonymousUser

CLOSE_UNAUTHENTICATED = 4401
CLOSE_BAD_ORIGIN = 4403
CLOSE_NOT_FOUND = 4404


@database_sync_to_async
def _user_for_token(key: str):
    from rest_framework.authtoken.models import Token

    try:
        token = Token.objects.select_related("user").get(key=key)
    except Token.DoesNotExist:
        return AnonymousUser()
    return token.user if token.user.is_active else AnonymousUser()


def _token_from_scope(scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            if scheme.lower() == "token" and key:
                return key.strip()
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    keys = query.get("token")
    return keys[0] if keys else None


class TokenAuthMiddleware:
    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        key = _token_from_scope(scope)
        if key:
            scope = dict(scope, user=await _user_for_token(key), auth_method="token")
        else:
            scope = dict(scope, auth_method="session")
        return await self.inner(scope, receive, send)


class SessionOriginValidator:
    """The Origin check of ``ALLOWED_HOSTS`` for cookie sessions; token connections skip it."""

    def __init__(self, inner):
        self.inner = inner
        self.validator = AllowedHostsOriginValidator(inner)

    async def __call__(self, scope, receive, send):
        if scope.get("auth_method") == "token":
            return await self.inner(scope, receive, send)
        origin = None
        for name, value in scope.get("headers", []):
            if name == b"origin":
                origin = urlparse(value.decode("latin-1"))
        if self.validator.valid_origin(origin):
            return await self.inner(scope, receive, send)
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": CLOSE_BAD_ORIGIN})


class CloseCodeMiddleware:
    """Accept the handshake before a refusal, so the client reads the close code instead of a 403."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        accepted = False

        async def send_accepting_first(message):
            nonlocal accepted
            if message["type"] == "websocket.accept":
                accepted = True
            elif message["type"] == "websocket.close" and not accepted:
                accepted = True
                await send({"type": "websocket.accept"})
            await send(message)

        return await self.inner(scope, receive, send_accepting_first)


class NotFoundConsumer:
    """The last websocket route: an unknown path is closed with 4404."""

    @classmethod
    def as_asgi(cls):
        async def app(scope, receive, send):
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": CLOSE_NOT_FOUND})
        return app


def SessionOrTokenAuthMiddleware(inner):  # CamelCase mirrors channels' AuthMiddlewareStack
    return CloseCodeMiddleware(AuthMiddlewareStack(TokenAuthMiddleware(SessionOriginValidator(inner))))
