"""Websocket authentication: the browser's session cookie, or an API token for programs.

A program passes its token as ``Authorization: Token <key>`` or ``?token=<key>``. Consumers check
``scope["user"].is_authenticated`` and close with code 4401 otherwise.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from django.contrib.auth.models import AnonymousUser


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
        if key and not getattr(scope.get("user"), "is_authenticated", False):
            scope = dict(scope, user=await _user_for_token(key))
        return await self.inner(scope, receive, send)


def SessionOrTokenAuthMiddleware(inner):  # noqa: N802 - mirrors channels' AuthMiddlewareStack
    return AuthMiddlewareStack(TokenAuthMiddleware(inner))
