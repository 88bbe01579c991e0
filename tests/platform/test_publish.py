"""One batched publisher for every app: live task events, fleet and notification messages alike."""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.layers import get_channel_layer
from django.db import transaction

from webapp.core.notifications import notification_send_on_commit, user_group_name
from webapp.core.publish import DEFAULT_CHANNEL_LAYER, LIVE_CHANNEL_LAYER, coalesce_events
from webapp.fleet.events import FLEET_GROUP, fleet_event_send_on_commit


def test_events_of_one_group_on_two_layers_never_merge():
    def event(seq):
        return {"type": "task.event", "seq": seq, "ts": 1.0, "event_json": f'{{"seq": {seq}}}'}

    merged = coalesce_events([((LIVE_CHANNEL_LAYER, "g"), event(0)), ((LIVE_CHANNEL_LAYER, "g"), event(1)),
                              ((DEFAULT_CHANNEL_LAYER, "g"), event(2))])
    assert [(key, message["seq"], message["last_seq"]) for key, message in merged] == [
        ((LIVE_CHANNEL_LAYER, "g"), 0, 1), ((DEFAULT_CHANNEL_LAYER, "g"), 2, 2)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("send", "group", "expected"), [
    (lambda: fleet_event_send_on_commit(event={"kind": "host", "n": 1}), FLEET_GROUP,
     {"type": "fleet.event", "event": {"kind": "host", "n": 1}}),
    (lambda: notification_send_on_commit(user_id=424242, event={"text": "done"}), user_group_name(424242),
     {"type": "notify", "event": {"text": "done"}}),
], ids=["fleet", "notification"])
def test_messages_reach_the_default_layer_after_commit_and_not_before(send, group, expected):
    layer = get_channel_layer(DEFAULT_CHANNEL_LAYER)
    committed_at = []

    def send_in_a_transaction():
        with transaction.atomic():
            send()
            time.sleep(0.3)  # a message sent before the commit would arrive during this pause
        committed_at.append(time.monotonic())

    async def scenario():
        channel = await layer.new_channel()
        await layer.group_add(group, channel)
        try:
            receiving = asyncio.ensure_future(layer.receive(channel))
            arrived_at = []
            receiving.add_done_callback(lambda _: arrived_at.append(time.monotonic()))
            await sync_to_async(send_in_a_transaction)()
            message = await asyncio.wait_for(receiving, 10)
            return message, arrived_at[0]
        finally:
            await layer.group_discard(group, channel)

    message, received_at = async_to_sync(scenario)()
    assert message == expected
    assert received_at >= committed_at[0]
