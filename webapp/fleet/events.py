"""The fleet's live stream: services publish after commit, every dashboard websocket listens."""

from __future__ import annotations

from webapp.core.publish import DEFAULT_CHANNEL_LAYER, publish_on_commit

FLEET_GROUP = "fleet"


def fleet_event_send_on_commit(*, event: dict) -> None:
    """Publish ``event`` to the fleet group once the current transaction commits.

    Through the process's batched publisher (``webapp.core.publish``): a broker outage loses a
    dashboard update, never the heartbeat that was just stored, and never blocks the heartbeat.
    """
    publish_on_commit(group=FLEET_GROUP, message={"type": "fleet.event", "event": event}, layer=DEFAULT_CHANNEL_LAYER)
