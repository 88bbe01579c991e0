"""Per-user notification stream: services publish here after commit, the browser listens."""

from __future__ import annotations

from webapp.core.publish import DEFAULT_CHANNEL_LAYER, publish_on_commit


def user_group_name(user_id: int) -> str:
    return f"user.{user_id}"


def notification_send_on_commit(*, user_id: int, event: dict) -> None:
    """Publish `event` to the user's websocket group once the current transaction commits
    (through the process's batched publisher, ``webapp.core.publish``)."""
    publish_on_commit(group=user_group_name(user_id), message={"type": "notify", "event": event},
                      layer=DEFAULT_CHANNEL_LAYER)
