"""The process-local fan-out of a channel-layer group (webapp.core.fanout), on Channels' in-memory layer."""

from __future__ import annotations

import asyncio

import pytest
from channels.layers import get_channel_layer

from webapp.core.fanout import GroupFanout

ALIAS = "live-fanout-test"


class Recorder:
    def __init__(self) -> None:
        self.messages: list[dict] = []

    def offer(self, message: dict) -> None:
        self.messages.append(message)


async def _until(predicate, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture
def layer(settings):
    settings.CHANNEL_LAYERS = {**settings.CHANNEL_LAYERS, ALIAS: {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    return get_channel_layer(ALIAS)


async def test_live_fanout_subscribes_once_and_offers_every_message_to_every_member_in_order(layer):
    fanout = GroupFanout(ALIAS)
    first, second = Recorder(), Recorder()
    await fanout.join("task-1", first)
    await fanout.join("task-1", second)
    assert len(layer.groups["task-1"]) == 1, "one subscription for all members of this process"

    for n in range(3):
        await layer.group_send("task-1", {"type": "task.event", "n": n})
    await _until(lambda: len(first.messages) == len(second.messages) == 3)
    assert [m["n"] for m in first.messages] == [m["n"] for m in second.messages] == [0, 1, 2]
    assert first.messages[0] is second.messages[0], "read once, shared"

    await fanout.leave("task-1", first)
    await fanout.leave("task-1", second)


async def test_live_fanout_unsubscribes_with_the_last_member_and_subscribes_again(layer):
    fanout = GroupFanout(ALIAS)
    first, second, later = Recorder(), Recorder(), Recorder()
    await fanout.join("task-2", first)
    await fanout.join("task-2", second)
    await fanout.leave("task-2", first)
    await layer.group_send("task-2", {"type": "task.event", "n": 0})
    await _until(lambda: len(second.messages) == 1)
    assert first.messages == []

    await fanout.leave("task-2", second)
    assert "task-2" not in layer.groups
    await fanout.leave("task-2", second)  # leaving twice is harmless

    await fanout.join("task-2", later)
    await layer.group_send("task-2", {"type": "task.event", "n": 1})
    await _until(lambda: len(later.messages) == 1)
    assert [m["n"] for m in later.messages] == [1] and second.messages[-1]["n"] == 0
    await fanout.leave("task-2", later)


async def test_live_fanout_keeps_groups_apart(layer):
    fanout = GroupFanout(ALIAS)
    one, other = Recorder(), Recorder()
    await fanout.join("task-3", one)
    await fanout.join("task-4", other)
    await layer.group_send("task-3", {"type": "task.event", "n": 3})
    await layer.group_send("task-4", {"type": "task.event", "n": 4})
    await _until(lambda: one.messages and other.messages)
    assert [m["n"] for m in one.messages] == [3] and [m["n"] for m in other.messages] == [4]
    await fanout.leave("task-3", one)
    await fanout.leave("task-4", other)


async def test_live_fanout_a_joiner_cancelled_while_subscribing_is_not_left_behind(layer, monkeypatch):
    subscribed, group_add = asyncio.Event(), layer.group_add

    async def slow_group_add(group, channel):
        await subscribed.wait()
        await group_add(group, channel)

    monkeypatch.setattr(layer, "group_add", slow_group_add)
    fanout = GroupFanout(ALIAS)
    gone, staying = Recorder(), Recorder()
    joining = [asyncio.ensure_future(fanout.join("task-5", member)) for member in (gone, staying)]
    await asyncio.sleep(0.05)
    assert not any(join.done() for join in joining), "join waits until the group is subscribed"
    joining[0].cancel()
    subscribed.set()
    await joining[1]
    with pytest.raises(asyncio.CancelledError):
        await joining[0]

    await layer.group_send("task-5", {"type": "task.event", "n": 5})
    await _until(lambda: staying.messages)
    assert gone.messages == [], "the cancelled joiner was removed; the subscription stayed for the other"
    await fanout.leave("task-5", staying)
    assert "task-5" not in layer.groups
