"""Request bodies are bounded before they are read: an ASGI middleware around the whole HTTP app.

Django's ASGI handler reads a request's whole body (into a temporary file past
FILE_UPLOAD_MAX_MEMORY_SIZE) before any view, authentication or permission check runs, so without a
bound anyone, signed in or not, could make the server store an upload of any size. This middleware
answers 413 instead, whoever sends it:

- at once, reading nothing, when the declared Content-Length exceeds the path's limit;
- as soon as the bytes received exceed it (a chunked stream, or more than declared): the app is told the
  client went away, so it stops reading and deletes what it spooled, and the client gets the 413.

The limit is MAX_REQUEST_BYTES, or MAX_UPLOAD_REQUEST_BYTES for the archive upload endpoints
(``UPLOAD_VIEWS``). The connection is closed after a 413: the rest of the body is never read.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from django.conf import settings
from django.urls import Resolver404, resolve

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UPLOAD_VIEWS = frozenset({"agents:task-list", "agents:repository-list", "api-tasks", "api-repositories"})
"""Views that take an archive upload (a task's or a repository's code)."""


def body_limit_for(path: str) -> int:
    """The most bytes a request body to ``path`` may have."""
    try:
        view = resolve(path).view_name
    except Resolver404:
        view = ""
    return settings.MAX_UPLOAD_REQUEST_BYTES if view in UPLOAD_VIEWS else settings.MAX_REQUEST_BYTES


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length itself; the count below still holds
    return None


async def _refuse(send: Send, limit: int) -> None:
    body = json.dumps({"detail": f"the request body is larger than this endpoint accepts ({limit} bytes)",
                       "limit_bytes": limit}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class RequestBodyLimit:
    """Wraps an ASGI HTTP app; other scope types pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        root = scope.get("root_path") or ""
        limit = body_limit_for(path[len(root):] if root and path.startswith(root) else path)
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            await _refuse(send, limit)
            return
        state = {"received": 0, "over": False, "started": False}

        async def bounded_receive() -> Message:
            if state["over"]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > limit:
                    state["over"] = True
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        await self.app(scope, bounded_receive, tracked_send)
        if state["over"] and not state["started"]:
            await _refuse(send, limit)
