"""TaskEventsConsumer in-process (Channels' communicator, in-memory live layer): the resume cursor,
duplicates and gaps, and the shared per-process subscription of a task's viewers."""

from __future__ import annotations

import json

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from webapp.agents import consumers
from webapp.agents.consumers import TaskEventsConsumer
from webapp.agents.selectors import LIVE_CHANNEL_LAYER, event_to_wire, task_group_name

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def layer(settings):
    settings.CHANNEL_LAYERS = {**settings.CHANNEL_LAYERS,
                               LIVE_CHANNEL_LAYER: {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    return get_channel_layer(LIVE_CHANNEL_LAYER)


@pytest.fixture
def task(owner, demo_repository):
    from webapp.agents.services import task_create

    return task_create(owner=owner, prompt="watch me", repository=demo_repository, backend="scripted", enqueue=False)


@database_sync_to_async
def _store(task, *seqs: int) -> list[dict]:
    """Rows as a worker would have written them (the live tests cover the real writer)."""
    from webapp.agents.models import AgentTask, TaskEvent

    events = [TaskEvent.objects.create(task=task, seq=seq, kind="message", turn=seq, payload={"text": f"step {seq}"},
                                       ts=1000.0 + seq) for seq in seqs]
    AgentTask.objects.filter(pk=task.pk).update(last_seq=max(seqs))
    return [event_to_wire(event=event) for event in events]


def _event_message(wire: dict) -> dict:
    return {"type": "task.event", "seq": wire["seq"], "last_seq": wire["seq"],
            "text": json.dumps({"type": "events", "events": [wire]})}


async def _connect(task, owner, after: int = -1) -> WebsocketCommunicator:
    viewer = WebsocketCommunicator(TaskEventsConsumer.as_asgi(), f"/ws/tasks/{task.pk}/events/?after={after}")
    viewer.scope["user"] = owner
    viewer.scope["url_route"] = {"kwargs": {"task_id": task.pk}}
    connected, _ = await viewer.connect()
    assert connected
    return viewer


async def _next(viewer) -> dict:
    return json.loads(await viewer.receive_from(timeout=3))


def _seqs(message: dict) -> list[int]:
    assert message["type"] == "events", message
    return [event["seq"] for event in message["events"]]


async def test_live_consumer_sends_the_backlog_then_live_events_once_filling_gaps_from_the_database(layer, task, owner):
    group = task_group_name(task_id=task.pk)
    await _store(task, 0, 1)
    viewer = await _connect(task, owner)
    assert _seqs(await _next(viewer)) == [0, 1]
    assert (await _next(viewer))["type"] == "status"
    assert await _next(viewer) == {"type": "backlog_done", "last_seq": 1}

    (second,) = await _store(task, 2)
    await layer.group_send(group, _event_message({**second, "seq": 1}))  # already sent: dropped
    await layer.group_send(group, _event_message(second))
    assert _seqs(await _next(viewer)) == [2]

    *_, fifth = await _store(task, 3, 4, 5)
    await layer.group_send(group, _event_message(fifth))  # 3 and 4 were lost on the way
    assert _seqs(await _next(viewer)) == [3, 4, 5]

    await _store(task, 6)
    await layer.group_send(group, {"type": "task.status", "status": "succeeded", "reason": "", "last_seq": 6})
    assert _seqs(await _next(viewer)) == [6], "a status ahead of the viewer brings the missing events first"
    assert await _next(viewer) == {"type": "status", "status": "succeeded", "reason": "", "last_seq": 6}
    assert await viewer.receive_nothing()
    await viewer.disconnect()


async def test_live_consumer_an_event_published_during_the_backlog_follows_it(layer, task, owner, monkeypatch):
    group = task_group_name(task_id=task.pk)
    await _store(task, 0, 1)
    events_after = consumers._events_after

    async def backlog_then_a_new_event(*args, **kwargs):
        events = await events_after(*args, **kwargs)
        if not kwargs and args[1] == -1:
            (new,) = await _store(task, 2)
            await layer.group_send(group, _event_message(new))
        return events

    monkeypatch.setattr(consumers, "_events_after", backlog_then_a_new_event)
    viewer = await _connect(task, owner)
    assert _seqs(await _next(viewer)) == [0, 1]
    assert (await _next(viewer))["type"] == "status"
    assert await _next(viewer) == {"type": "backlog_done", "last_seq": 1}
    assert _seqs(await _next(viewer)) == [2]
    assert await viewer.receive_nothing()
    await viewer.disconnect()


async def test_live_consumer_viewers_of_a_task_share_one_subscription_until_the_last_leaves(layer, task, owner):
    group = task_group_name(task_id=task.pk)
    viewers = [await _connect(task, owner) for _ in range(3)]
    for viewer in viewers:  # no backlog yet
        assert [(await _next(viewer))["type"] for _ in range(2)] == ["status", "backlog_done"]
    assert len(layer.groups[group]) == 1

    (event,) = await _store(task, 0)
    await layer.group_send(group, _event_message(event))
    for viewer in viewers:
        assert _seqs(await _next(viewer)) == [0]
    for viewer in viewers:
        await viewer.disconnect()
    assert group not in layer.groups, "the last viewer to go unsubscribes the process"


async def test_live_consumer_closes_when_forwarding_fails(layer, task, owner, monkeypatch):
    viewer = await _connect(task, owner)
    for _ in range(2):
        await _next(viewer)

    async def database_down(*args, **kwargs):
        raise RuntimeError("database down")

    monkeypatch.setattr(consumers, "_events_after", database_down)
    await layer.group_send(task_group_name(task_id=task.pk), {"type": "task.event", "seq": 5, "last_seq": 5, "text": "{}"})
    assert await viewer.receive_output(timeout=3) == {"type": "websocket.close", "code": 1011}
    await viewer.disconnect()
