"""The fleet's live stream: services publish after commit, every dashboard websocket listens."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

FLEET_GROUP = "fleet"


def fleet_event_send_on_commit(*, event: dict) -> None:
    """Publish ``event`` to the fleet group once the current transaction commits."""

    def publish() -> None:
        async_to_sync(get_channel_layer().group_send)(FLEET_GROUP, {"type": "fleet.event", "event": event})

    # robust: a broker outage loses a dashboard update, never the heartbeat that was just stored.
    transaction.on_commit(publish, robust=True)
