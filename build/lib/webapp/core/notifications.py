"""Per-user notification stream: services publish here after commit, the browser listens."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction


def user_group_name(user_id: int) -> str:
    return f"user.{user_id}"


def notification_send_on_commit(*, user_id: int, event: dict) -> None:
    """Publish `event` to the user's websocket group once the current transaction commits."""

    def publish() -> None:
        async_to_sync(get_channel_layer().group_send)(user_group_name(user_id), {"type": "notify", "event": event})

    transaction.on_commit(publish)
